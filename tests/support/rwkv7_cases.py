"""RWKV7 test cases shared by the chunk_rwkv7 and fused_recurrent_rwkv7 tests: the two modes,
inputs (layouts, low-rank regimes), the check of o, final state and every gradient against the
float64 oracle, the real-op samples, and the bad-input table."""
import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import fla_ext
from conftest import TOL, assert_close
from fla_ext import reference
from inputs import make_diag

NAMES = ["r", "w", "k", "v", "a", "b", "h0"]


@dataclass(frozen=True)
class Mode:
    """An RWKV7 mode, as the tests both modes share call it."""
    name: str               # fla_ext.<name>_rwkv7, fla::<name>_rwkv7 and fla::<name>_rwkv7_bwd
    scale: Optional[float]  # fla's default scale: chunk 1.0, fused_recurrent None (K ** -0.5)
    reverse: bool           # has a `reverse` flag (chunk_rwkv7 has none)

    def __str__(self):  # the test id
        return self.name

    @property
    def op(self):
        return getattr(fla_ext, f"{self.name}_rwkv7")

    def __call__(self, *args, **kw):
        """(o, final state): the state is always asked for (chunk's default is not to return it)."""
        return self.op(*args, output_final_state=True, **kw)

    def raw(self, bwd=False):
        return getattr(torch.ops.fla, f"{self.name}_rwkv7" + ("_bwd" if bwd else ""))

    def tail(self, cu, head_first):
        """The raw ops' last arguments: fused_recurrent's take `reverse` (off) before these two."""
        return (False, cu, head_first) if self.reverse else (cu, head_first)


CHUNK = Mode("chunk", 1.0, False)
FUSED = Mode("fused_recurrent", None, True)
MODES = [CHUNK, FUSED]


def relayout(x, ref):
    """x (same shape as ref) with ref's dtype, device and kind of layout (strided or not)."""
    x = x.to(device=ref.device, dtype=ref.dtype)
    if ref.is_contiguous():
        return x.contiguous()
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], device=x.device, dtype=x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


def low_rank(kind, kk_src, gen):
    """(a, b) in float32 from a [.., K] draw: RWKV-7's a = -kk, b = kk * iclr (kk L2-normalised
    over K), with iclr U(0,1), 0 or 1 (then ||b a^T|| = 1), or a generic small pair. "repeated":
    nearly the same kk for every token and iclr = 1 (a repeated token): the chunk's A_ab has
    every entry near -exp(decay sum), and X = (I - A_ab)^-1 stays bounded only through
    cancellation in the series I + A + A^2 + .., whose terms grow like binomials."""
    if kind == "repeated":
        kk = F.normalize(1 + 0.01 * kk_src.float(), dim=-1)
        return -kk, kk.clone()
    kk = F.normalize(kk_src.float(), dim=-1)
    if kind == "rwkv":
        iclr = torch.rand(kk.shape, generator=gen)
    elif kind == "iclr0":
        iclr = torch.zeros(kk.shape)
    elif kind == "iclr1":
        iclr = torch.ones(kk.shape)
    elif kind == "generic":
        return 0.3 * kk_src.float() / math.sqrt(kk.shape[-1]), \
            0.3 * torch.randn(kk.shape, generator=gen) / math.sqrt(kk.shape[-1])
    else:
        raise ValueError(kind)
    return -kk, kk * iclr


def make(B, T, H, K, V, dtype, device, gen, *, lr="rwkv", **kw):
    """RWKV7 inputs (r, w, k, v, a, b, h0) in the kernel dtype and the requested layout."""
    r, k, v, w, h0 = make_diag(B, T, H, K, V, dtype, device, gen, **kw)
    src = torch.randn(r.shape, generator=gen)  # already in r's layout (head_first or not)
    a, b = low_rank(lr, src, gen)
    return r, w, k, v, relayout(a, r), relayout(b, r), h0


def run_and_check(mode, r, w, k, v, a, b, h0, *, dht_on=True, scale=None, reverse=False, cu=None,
                  head_first=False, gen=None, tol_scale=1.0):
    """o, final state and every gradient of `mode` vs the float64 oracle with the docs/algorithms.md
    §8.3 tolerances of the dtype; returns (o, ht)."""
    dtype = r.dtype
    tol, tol_dw, atol = TOL[dtype]
    tol, tol_dw = tol * tol_scale, tol_dw * tol_scale
    ins = [t.detach().clone().requires_grad_(True) for t in (r, w, k, v, a, b)]
    h0_in = h0.detach().clone().requires_grad_(True) if h0 is not None else None
    extra = dict(reverse=True) if reverse else {}  # chunk_rwkv7 has no `reverse`
    o, ht = mode(*ins, scale=scale, initial_state=h0_in, cu_seqlens=cu, head_first=head_first,
                 **extra)
    s = r.shape[-1] ** -0.5 if scale is None else scale  # the op's default; the oracle's is 1
    o_ref, ht_ref = reference.rwkv7(r, w, k, v, a, b, scale=s, initial_state=h0, reverse=reverse,
                                    cu_seqlens=cu, head_first=head_first)
    assert o.dtype == dtype and ht.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close("o", o, o_ref, tol, atol)
    assert_close("ht", ht, ht_ref, tol, atol)

    do = torch.randn(o.shape, generator=gen).to(o)
    dht = torch.randn(ht.shape, generator=gen).to(ht) if dht_on else None
    ((o * do).sum() + ((ht * dht).sum() if dht_on else 0)).backward()
    g_ref = reference.rwkv7_bwd(r, w, k, v, a, b, do, dht, scale=s, initial_state=h0,
                                reverse=reverse, cu_seqlens=cu, head_first=head_first)
    for name, x in zip(NAMES, ins + [h0_in]):
        if x is None:
            continue
        assert x.grad is not None, f"no gradient for {name}"
        assert_close(f"d{name}", x.grad, g_ref[name], tol_dw if name == "w" else tol, atol)
    # d/dw of a factor exp(w) = 0 is exactly 0 (no 0 * inf, no rounding carried across a reset)
    dead = torch.exp(w.detach().double()) == 0
    assert (ins[1].grad[dead] == 0).all(), "dw is not exactly 0 where exp(w) == 0"
    return o, ht


def samples(mode, device, requires_grad=True):
    """Arguments of the raw forward op: both layouts, h0 and the final state on and off, varlen
    with an empty sequence, T = 1."""
    g = torch.Generator().manual_seed(11)
    Tv = 40 if mode is CHUNK else 20  # chunk: the varlen sample's last sequence over three chunks
    out = []
    for (B, T, H, K, V, hf, h0, fin, cu) in [(2, 9, 2, 8, 40, False, True, True, None),
                                            (1, Tv, 2, 16, 8, True, False, False, [0, 5, 5, Tv]),
                                            (2, 1, 1, 4, 4, False, False, True, None)]:
        r, w, k, v, a, b, s0 = make(B, T, H, K, V, torch.float32, device, g, head_first=hf,
                                    h0=h0, N=len(cu) - 1 if cu else B)
        ts = [r, w, k, v, a, b] + ([s0] if h0 else [])
        if requires_grad:
            for t in ts:
                t.requires_grad_(True)
        cu_t = torch.tensor(cu, device=device) if cu else None
        out.append((r, w, k, v, a, b, mode.scale, s0, fin, *mode.tail(cu_t, hf)))
    return out


def bwd_args(mode, sample, device):
    """Arguments of the raw backward op for a `samples` entry."""
    (r, w, k, v, a, b, _, s0, fin), (cu, hf) = sample[:9], sample[-2:]
    N = cu.numel() - 1 if cu is not None else r.shape[0]
    H = r.shape[1] if hf else r.shape[2]
    dht = torch.randn(N, H, r.shape[-1], v.shape[-1], device=device) if fin else None
    return (r, w, k, v, a, b, torch.randn_like(v), dht, 0.5, s0, *mode.tail(cu, hf))


def _good():
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(r=mk(2, 5, 2, 4), w=-torch.rand(2, 5, 2, 4, generator=g), k=mk(2, 5, 2, 4),
                v=mk(2, 5, 2, 6), a=mk(2, 5, 2, 4), b=mk(2, 5, 2, 4))


ERRORS = [
    (dict(a=torch.randn(2, 5, 2, 3)), ValueError, r"`a` must have the shape of `r`"),
    (dict(b=torch.randn(2, 5, 2, 4, dtype=torch.float64)), ValueError, r"`b` has dtype Double but `r`"),
    (dict(b=torch.randn(2, 5, 4)), ValueError, r"`b` must be 4-D"),
    (dict(w=torch.randn(2, 5, 2, 3)), ValueError, r"`w` must have the shape of `r`"),
    (dict(k=torch.randn(2, 5, 2, 3)), ValueError, r"`k` must have the shape of `r`"),
    (dict(v=torch.randn(2, 4, 2, 6)), ValueError, r"`v` must be \[B, T, H, D\]"),
    (dict(v=torch.randn(2, 5, 2, 300)), ValueError, r"V \(last dim of v\) must be in \[1, 256\]"),
    (dict(initial_state=torch.randn(2, 2, 4, 5)), ValueError,
     r"`initial_state` must have shape \[N, H, K, V\] = \[2, 2, 4, 6\]"),
    (dict(cu_seqlens=torch.tensor([0, 5])), ValueError, r"batch size must be 1, got B = 2"),
    (dict(scale=math.inf), ValueError, r"`scale` must be finite"),
    (dict(a=None), TypeError, r"`a` must be a torch.Tensor, got NoneType"),
]


def check_bad_input(op, kw, exc, msg):
    """op(**good inputs updated with kw) raises exc matching msg (kw, an ERRORS entry, is shared
    by the test modules, so it is not modified)."""
    args = _good()
    extra = {n: t for n, t in kw.items() if n not in args}
    args.update({n: t for n, t in kw.items() if n in args})
    with pytest.raises(exc, match=msg):
        op(**args, **extra)
