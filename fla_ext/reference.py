"""Float64 oracles: the plain recurrences and hand-written BPTT (ALGORITHMS.md §8.1).

Independent of every kernel's algebra (no chunking, no closed forms), validated against finite
differences in tests/test_reference.py. All functions take fla-layout tensors ``[B, T, H, D]``
(or ``head_first=True``), any dtype (upcast exactly to float64), optional ``cu_seqlens``, and
return float64 results in the input layout. States are ``[N, H, K, V]``.

Conventions: decays are log decays (``exp(w)`` multiplies the state); ``reverse=True`` runs the
recurrence from the last token to the first.
"""
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor


def _f64(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.detach().to(torch.float64)


def _spans(B: int, T: int, cu_seqlens: Optional[Tensor]) -> List[Tuple[int, int, int]]:
    """(batch row, first t, end t) for each sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def _run(step_fn: Callable, seq_tensors: Sequence[Optional[Tensor]], head_first: bool,
         cu_seqlens: Optional[Tensor], reverse: bool, n_out: int):
    """Apply ``step_fn(n, [x[b, bos:eos] as [L, H, D] (time in processing order)])`` per sequence,
    which returns (per-step outputs [L, H, *] list of n_out, extras), and reassemble outputs."""
    xs = [None if x is None else (_f64(x).transpose(1, 2) if head_first else _f64(x))
          for x in seq_tensors]
    ref = xs[0]
    B, T = ref.shape[0], ref.shape[1]
    outs: List[Optional[Tensor]] = [None] * n_out
    extras = []
    for n, (b, bos, eos) in enumerate(_spans(B, T, cu_seqlens)):
        seq = [None if x is None else x[b, bos:eos] for x in xs]
        if reverse:
            seq = [None if x is None else x.flip(0) for x in seq]
        res, extra = step_fn(n, seq)
        extras.append(extra)
        for i, r in enumerate(res):
            if outs[i] is None:
                outs[i] = torch.zeros(B, T, *r.shape[1:], dtype=torch.float64)
            outs[i][b, bos:eos] = r.flip(0) if reverse else r
    for i, o in enumerate(outs):
        if o is not None and head_first:
            outs[i] = o.transpose(1, 2)
    return outs, extras


def _state(h0: Optional[Tensor], n: int, H: int, K: int, V: int) -> Tensor:
    return _f64(h0[n]).clone() if h0 is not None else torch.zeros(H, K, V, dtype=torch.float64)


# ------------------------------------------------------------------------------------------------
# RWKV6: o_t = s (h_{t-1} + diag(u) k_t v_t^T)^T r_t;  h_t = diag(e^{w_t}) h_{t-1} + k_t v_t^T
# ------------------------------------------------------------------------------------------------

def rwkv6(r, k, v, w, u, scale=None, initial_state=None, reverse=False, cu_seqlens=None,
          head_first=False) -> Tuple[Tensor, Tensor]:
    K, V = r.shape[-1], v.shape[-1]
    s = K ** -0.5 if scale is None else scale
    u64 = _f64(u)
    finals = []

    def seq(n, xs):
        r_, k_, v_, w_ = xs
        L, H = r_.shape[0], r_.shape[1]
        h = _state(initial_state, n, H, K, V)
        o = torch.zeros(L, H, V, dtype=torch.float64)
        for t in range(L):
            kv = k_[t, :, :, None] * v_[t, :, None, :]
            o[t] = s * torch.einsum("hk,hkv->hv", r_[t], h + u64[:, :, None] * kv)
            h = torch.exp(w_[t])[:, :, None] * h + kv
        finals.append(h)
        return [o], None

    (o,), _ = _run(seq, [r, k, v, w], head_first, cu_seqlens, reverse, 1)
    return o, torch.stack(finals)


def rwkv6_bwd(r, k, v, w, u, do, dht=None, scale=None, initial_state=None, reverse=False,
              cu_seqlens=None, head_first=False) -> Dict[str, Tensor]:
    K, V = r.shape[-1], v.shape[-1]
    s = K ** -0.5 if scale is None else scale
    u64 = _f64(u)
    du = torch.zeros_like(u64)
    dh0s = []

    def seq(n, xs):
        nonlocal du
        r_, k_, v_, w_, do_ = xs
        L, H = r_.shape[0], r_.shape[1]
        hs = [_state(initial_state, n, H, K, V)]
        for t in range(L):
            hs.append(torch.exp(w_[t])[:, :, None] * hs[-1] + k_[t, :, :, None] * v_[t, :, None, :])
        D = _f64(dht[n]).clone() if dht is not None else torch.zeros(H, K, V, dtype=torch.float64)
        dr, dk, dw = (torch.zeros(L, H, K, dtype=torch.float64) for _ in range(3))
        dv = torch.zeros(L, H, V, dtype=torch.float64)
        for t in reversed(range(L)):
            hp = hs[t]  # h_{t-1}
            dov = (do_[t] * v_[t]).sum(-1)                       # [H]
            ruk = (r_[t] * u64 * k_[t]).sum(-1)                  # [H]
            dr[t] = s * (torch.einsum("hkv,hv->hk", hp, do_[t]) + u64 * k_[t] * dov[:, None])
            du += s * r_[t] * k_[t] * dov[:, None]
            dk[t] = torch.einsum("hkv,hv->hk", D, v_[t]) + s * u64 * r_[t] * dov[:, None]
            dv[t] = torch.einsum("hkv,hk->hv", D, k_[t]) + s * do_[t] * ruk[:, None]
            dw[t] = torch.exp(w_[t]) * (D * hp).sum(-1)
            D = torch.exp(w_[t])[:, :, None] * D + s * r_[t, :, :, None] * do_[t, :, None, :]
        dh0s.append(D)
        return [dr, dk, dv, dw], None

    (dr, dk, dv, dw), _ = _run(seq, [r, k, v, w, do], head_first, cu_seqlens, reverse, 4)
    return dict(r=dr, k=dk, v=dv, w=dw, u=du, h0=torch.stack(dh0s))
