"""GSA as its two GLA passes in Python, where the GSA op itself cannot run: under context
parallelism (each pass under the context) and with head dims above the kernels' 256 (each pass
as key and value slices). The same arithmetic as the op: the slot logits float32 between the
passes, grouped query heads by repeating the key-side inputs, and the slot gate when ``g`` is
None (fla's ABC form): with z_t = log sum_{tau <= t} exp(s_tau) over each sequence, the slot keys
are exp(s_t - z_t) and the gate g_t = z_{t-1} - z_t (0 at a sequence's first row), float32."""
from typing import Callable, List, Optional

import torch


def running_lse(x: torch.Tensor, cu: List[int], time_dim: int) -> List[torch.Tensor]:
    """z of every sequence [cu[i], cu[i+1]) of x along ``time_dim``."""
    return [torch.logcumsumexp(x.narrow(time_dim, a, b - a), time_dim) for a, b in zip(cu[:-1], cu[1:])]


def keys_and_gates(x: torch.Tensor, parts: List[torch.Tensor], cu: List[int], time_dim: int,
                   z_in: Optional[torch.Tensor] = None):
    """(slot keys, gate) along x from the sequences' running log-sum-exps ``parts``; ``z_in``: the
    first sequence's sum before its first row here (context parallelism), else it starts here."""
    keys, gates = [], []
    for i, (z, a, b) in enumerate(zip(parts, cu[:-1], cu[1:])):
        first = z.narrow(time_dim, 0, min(1, b - a))
        start = (z_in.reshape(first.shape[:time_dim] + (1,) + first.shape[time_dim + 1:])
                 if i == 0 and z_in is not None else torch.full_like(first, -torch.inf))
        prev = torch.cat([start, z.narrow(time_dim, 0, max(b - a - 1, 0))], time_dim)  # b - a rows
        keys.append(torch.exp(x.narrow(time_dim, a, b - a) - z))
        gates.append(torch.where(torch.isinf(prev), torch.zeros_like(z), prev - z))
    return torch.cat(keys, time_dim), torch.cat(gates, time_dim)


def slot_gate(s: torch.Tensor, cu_seqlens: Optional[torch.Tensor], head_first: bool):
    """(slot keys, gate) of s [B, T, H, M] ([B, H, T, M] if head_first), float32; cu_seqlens:
    the packed sequences (B = 1; its host copy saves a device sync), else each row is one
    sequence."""
    td = 2 if head_first else 1
    x = s.float()
    cu = cu_seqlens.tolist() if cu_seqlens is not None else [0, x.shape[td]]
    return keys_and_gates(x, running_lse(x, cu, td), cu, td)


def two_passes(run_pass: Callable, q, k, v, s, g, scale, initial_state, output_final_state: bool,
               heads_dim: int):
    """(o, (hk, hv)) of GSA with the slot keys s and gate g given (the gate already formed when
    g was None): ``run_pass(q, k, v, gk, gv, scale, h0)`` -> (o, final state) runs one GLA
    pass; heads on ``heads_dim`` of the activations. Grouped query heads repeat k, v, s, g and
    the states for the heads of their group, as the GSA op does."""
    G = q.shape[heads_dim] // k.shape[heads_dim]
    rep = (lambda t, d: t.repeat_interleave(G, d)) if G > 1 else (lambda t, d: t)  # noqa: E731
    k, v, s, g = (rep(t, heads_dim) for t in (k, v, s, g))
    hk0, hv0 = initial_state if initial_state is not None else (None, None)
    hk0, hv0 = (None if h is None else rep(h, 1) for h in (hk0, hv0))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # the slot logits in float32 for bf16 / fp16 inputs (a wide q), as the GSA op keeps them
    ok, hk = run_pass(q.float(), k, s, None, g, scale, hk0)
    p = torch.softmax(ok.float(), dim=-1).to(q.dtype)
    o, hv = run_pass(p, s, v, g, None, 1.0, hv0)
    if not output_final_state:
        return o, (None, None)
    if G > 1:  # every query head of a group holds the same states: one per group
        hk, hv = hk[:, ::G].contiguous(), hv[:, ::G].contiguous()
    return o, (hk, hv)
