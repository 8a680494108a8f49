"""Random inputs shared by the op tests: docs/algorithms.md §8.4 gate regimes, both layouts, strided."""
import math

import torch
import torch.nn.functional as F


def log_decay(kind: str, shape, gen) -> torch.Tensor:
    """docs/algorithms.md §8.4 gate regimes (float32, on the CPU)."""
    T = shape[1]
    if kind == "typical":
        return F.logsigmoid(torch.randn(shape, generator=gen))
    if kind == "near0":
        return F.logsigmoid(torch.randn(shape, generator=gen)) / 16
    if kind == "zero":
        return torch.zeros(shape)
    if kind == "u5":
        return -5 * torch.rand(shape, generator=gen)
    if kind == "u30":
        return -30 * torch.rand(shape, generator=gen)
    if kind == "edge60":  # 16-step sums straddle -60, chunk_rwkv7's bound for factored pair matrices
        return -3.7469 + 0.01 * (2 * torch.rand(shape, generator=gen) - 1)  # ~1 chunk in 3 factored
    if kind == "edge16":  # the same about -16, the bound for fp32 inputs
        return -0.996875 + 0.01 * (2 * torch.rand(shape, generator=gen) - 1)
    if kind == "rwkv7":  # RWKV-7's own parametrisation: -exp(-0.5) * sigmoid(x)
        return -math.exp(-0.5) * torch.sigmoid(torch.randn(shape, generator=gen))
    if kind == "rwkv":  # -exp(N(0, 2^2)), as RWKV6 layers produce
        return -torch.exp(2 * torch.randn(shape, generator=gen))
    if kind == "neg1e4":
        return torch.full(shape, -1e4)
    if kind == "neginf":
        return torch.full(shape, -math.inf)
    if kind in ("mixed1e4", "mixedinf"):
        w = -0.1 * torch.rand(shape, generator=gen)
        spike = torch.rand(shape, generator=gen) < 0.07
        return torch.where(spike, torch.tensor(-1e4 if kind == "mixed1e4" else -math.inf), w)
    if kind == "u60_20":  # GSA's strong slot gates: every decay <= -20
        return -20 - 40 * torch.rand(shape, generator=gen)
    if kind == "gsa_hard":  # logsigmoid gates with 30 % near-resets at -20 .. -80
        w = F.logsigmoid(torch.randn(shape, generator=gen))
        hard = torch.rand(shape, generator=gen) < 0.3
        return torch.where(hard, -20 - 60 * torch.rand(shape, generator=gen), w)
    if kind in ("spike0", "spike15"):
        w = -0.1 * torch.rand(shape, generator=gen)
        t = torch.arange(T).view(1, T, *([1] * (len(shape) - 2)))
        rows = (t % 16) == (0 if kind == "spike0" else 15)
        return torch.where(rows.expand(shape), torch.tensor(-1e4), w)
    raise ValueError(kind)


def layout(x, dtype, device, *, head_first=False, noncontig=False):
    """A [B, T, H, D] float32 CPU draw in the kernel dtype, head_first and/or as a strided view
    (every second element of a wider buffer)."""
    if head_first:
        x = x.transpose(1, 2)
    x = x.contiguous().to(device=device, dtype=dtype)
    if noncontig:
        wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], device=device, dtype=dtype)
        wide[..., ::2] = x
        x = wide[..., ::2]
    return x


def make_gv(B, T, H, V, dtype, device, gen, *, head_first=False, noncontig=False,
            w_kind="typical") -> torch.Tensor:
    """A value-side log decay [B, T, H, V] (fused_recurrent_gla's gv), laid out like make_diag's v."""
    return layout(log_decay(w_kind, (B, T, H, V), gen), dtype, device, head_first=head_first,
                  noncontig=noncontig)


def make_diag(B, T, H, K, V, dtype, device, gen, *, head_first=False, noncontig=False, h0=True,
              w_kind="typical", N=None):
    """(q, k, v, g, h0) of a diagonal-gate op in the kernel dtype (fla layout or head_first),
    built from float32 CPU draws; h0 is None unless requested."""
    def act(D, x=None):
        x = torch.randn(B, T, H, D, generator=gen) if x is None else x
        return layout(x, dtype, device, head_first=head_first, noncontig=noncontig)
    q, k, v = act(K), act(K), act(V)
    g = act(K, log_decay(w_kind, (B, T, H, K), gen))
    N = B if N is None else N
    state = torch.float64 if dtype == torch.float64 else torch.float32
    s0 = torch.randn(N, H, K, V, generator=gen).to(device=device, dtype=state) if h0 else None
    return q, k, v, g, s0


STRESS = ["typical", "near0", "zero", "u5", "u30", "rwkv", "neg1e4", "neginf", "mixed1e4",
          "mixedinf", "spike0", "spike15"]
