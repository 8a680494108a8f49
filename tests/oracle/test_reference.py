"""The float64 oracles in fla_ext.reference, validated on their own (docs/algorithms.md §8.1, §8.4 item 2).

Every hand-written BPTT (rwkv6_bwd, gla_bwd with gk, gv or both, rwkv7_bwd, gsa_bwd) is checked against central finite
differences of L = <dO, O> + <dHT, hT> (summed over both GSA states) w.r.t. every input, initial
states included, on tiny shapes. CPU only, float64.
"""
import math
from typing import Callable, Dict, Tuple

import pytest
import torch
import torch.nn.functional as F

from fla_ext import reference

Tensor = torch.Tensor
F64 = torch.float64

H, K, V, M = 2, 3, 4, 2   # K != V; M = GSA slots
EPS = 1e-6                # central-difference step
RTOL, ATOL = 1e-6, 1e-8   # ‖a − b‖/‖b‖ <= RTOL, or max|a − b| <= ATOL where the reference is ~0


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add overhead (restored for the other test files)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def fd_grads(loss: Callable[[Dict[str, Tensor]], float], inputs: Dict[str, Tensor],
             eps: float = EPS) -> Dict[str, Tensor]:
    """Central finite differences of the scalar ``loss(inputs)`` w.r.t. every element of every
    tensor in ``inputs`` (the tensors are perturbed in place and restored)."""
    grads = {}
    for name, x in inputs.items():
        g = torch.zeros_like(x)
        flat, gflat = x.view(-1), g.view(-1)
        for i in range(flat.numel()):
            x0 = flat[i].item()
            flat[i] = x0 + eps
            lp = loss(inputs)
            flat[i] = x0 - eps
            lm = loss(inputs)
            flat[i] = x0
            gflat[i] = (lp - lm) / (2 * eps)
        grads[name] = g
    return grads


def check(name: str, x: Tensor, ref: Tensor, rtol: float = RTOL, atol: float = ATOL):
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} != {tuple(ref.shape)}"
    assert x.dtype == F64, f"{name}: dtype {x.dtype}"
    assert torch.isfinite(x).all(), f"{name}: non-finite values"
    if x.numel() == 0:
        return
    den = ref.norm().item()
    rel = (x - ref).norm().item() / den if den > 0 else math.inf
    mx = (x - ref).abs().max().item()
    assert rel <= rtol or mx <= atol, f"{name}: rel err {rel:.3e} > {rtol:.0e}, max abs {mx:.3e}"


def seq_tensor(B, T, D, gen, head_first, fn=None):
    x = torch.randn(B, T, H, D, generator=gen, dtype=F64)
    if fn is not None:
        x = fn(x)
    return x.transpose(1, 2).contiguous() if head_first else x


def log_decay(x: Tensor) -> Tensor:
    return F.logsigmoid(x)


# ------------------------------------------------------------------------------------------------
# Families: inputs keyed by the names the *_bwd dicts use; forward -> (o, [final states])
# ------------------------------------------------------------------------------------------------

def make_rwkv6(B, T, N, gen, hf):
    x = dict(r=seq_tensor(B, T, K, gen, hf), k=seq_tensor(B, T, K, gen, hf),
             v=seq_tensor(B, T, V, gen, hf), w=seq_tensor(B, T, K, gen, hf, log_decay),
             u=torch.randn(H, K, generator=gen, dtype=F64),
             h0=torch.randn(N, H, K, V, generator=gen, dtype=F64))
    return x, [torch.randn(N, H, K, V, generator=gen, dtype=F64)]


def fwd_rwkv6(x, **kw):
    o, hT = reference.rwkv6(x["r"], x["k"], x["v"], x["w"], x["u"], initial_state=x.get("h0"), **kw)
    return o, [hT]


def bwd_rwkv6(x, do, dht, **kw):
    return reference.rwkv6_bwd(x["r"], x["k"], x["v"], x["w"], x["u"], do,
                               dht=None if dht is None else dht[0], initial_state=x.get("h0"), **kw)


def make_gla(B, T, N, gen, hf):
    x = dict(q=seq_tensor(B, T, K, gen, hf), k=seq_tensor(B, T, K, gen, hf),
             v=seq_tensor(B, T, V, gen, hf), g=seq_tensor(B, T, K, gen, hf, log_decay),
             h0=torch.randn(N, H, K, V, generator=gen, dtype=F64))
    return x, [torch.randn(N, H, K, V, generator=gen, dtype=F64)]


def fwd_gla(x, **kw):
    o, hT = reference.gla(x["q"], x["k"], x["v"], x["g"], initial_state=x.get("h0"), **kw)
    return o, [hT]


def bwd_gla(x, do, dht, **kw):
    return reference.gla_bwd(x["q"], x["k"], x["v"], x["g"], do,
                             dht=None if dht is None else dht[0], initial_state=x.get("h0"), **kw)


def make_gla_gv(B, T, N, gen, hf):
    """GLA with both decays: g (key side, [.., K]) and gv (value side, [.., V])."""
    x, dht = make_gla(B, T, N, gen, hf)
    x["gv"] = seq_tensor(B, T, V, gen, hf, log_decay)
    return x, dht


def make_gla_v(B, T, N, gen, hf):
    """GLA with the value-side decay only (no g)."""
    x, dht = make_gla_gv(B, T, N, gen, hf)
    del x["g"]
    return x, dht


def fwd_gla_gv(x, **kw):
    o, hT = reference.gla(x["q"], x["k"], x["v"], x.get("g"), gv=x["gv"],
                          initial_state=x.get("h0"), **kw)
    return o, [hT]


def bwd_gla_gv(x, do, dht, **kw):
    return reference.gla_bwd(x["q"], x["k"], x["v"], x.get("g"), do, gv=x["gv"],
                             dht=None if dht is None else dht[0], initial_state=x.get("h0"), **kw)


def make_rwkv7(B, T, N, gen, hf):
    half = lambda t: 0.5 * t  # noqa: E731  generic a, b (not the RWKV-7 parametrization)
    x = dict(r=seq_tensor(B, T, K, gen, hf), w=seq_tensor(B, T, K, gen, hf, log_decay),
             k=seq_tensor(B, T, K, gen, hf), v=seq_tensor(B, T, V, gen, hf),
             a=seq_tensor(B, T, K, gen, hf, half), b=seq_tensor(B, T, K, gen, hf, half),
             h0=torch.randn(N, H, K, V, generator=gen, dtype=F64))
    return x, [torch.randn(N, H, K, V, generator=gen, dtype=F64)]


def fwd_rwkv7(x, **kw):
    o, hT = reference.rwkv7(x["r"], x["w"], x["k"], x["v"], x["a"], x["b"],
                            initial_state=x.get("h0"), **kw)
    return o, [hT]


def bwd_rwkv7(x, do, dht, **kw):
    return reference.rwkv7_bwd(x["r"], x["w"], x["k"], x["v"], x["a"], x["b"], do,
                               dht=None if dht is None else dht[0], initial_state=x.get("h0"), **kw)


def make_gsa(B, T, N, gen, hf):
    x = dict(q=seq_tensor(B, T, K, gen, hf), k=seq_tensor(B, T, K, gen, hf),
             v=seq_tensor(B, T, V, gen, hf), s=seq_tensor(B, T, M, gen, hf),
             g=seq_tensor(B, T, M, gen, hf, log_decay),
             hk0=torch.randn(N, H, K, M, generator=gen, dtype=F64),
             hv0=torch.randn(N, H, M, V, generator=gen, dtype=F64))
    return x, [torch.randn(N, H, K, M, generator=gen, dtype=F64),
               torch.randn(N, H, M, V, generator=gen, dtype=F64)]


def _gsa_h0(x):
    return (x["hk0"], x["hv0"]) if "hk0" in x else None


def fwd_gsa(x, **kw):
    o, (hkT, hvT) = reference.gsa(x["q"], x["k"], x["v"], x["s"], x["g"],
                                  initial_state=_gsa_h0(x), **kw)
    return o, [hkT, hvT]


def bwd_gsa(x, do, dht, **kw):
    return reference.gsa_bwd(x["q"], x["k"], x["v"], x["s"], x["g"], do,
                             dht=None if dht is None else tuple(dht), initial_state=_gsa_h0(x), **kw)


FAMILIES: Dict[str, Tuple[Callable, Callable, Callable]] = {
    "rwkv6": (make_rwkv6, fwd_rwkv6, bwd_rwkv6),
    "gla": (make_gla, fwd_gla, bwd_gla),
    "gla_gv": (make_gla_gv, fwd_gla_gv, bwd_gla_gv),
    "gla_v": (make_gla_v, fwd_gla_gv, bwd_gla_gv),
    "rwkv7": (make_rwkv7, fwd_rwkv7, bwd_rwkv7),
    "gsa": (make_gsa, fwd_gsa, bwd_gsa),
}
STATE_KEYS = {"rwkv6": ["h0"], "gla": ["h0"], "gla_gv": ["h0"], "gla_v": ["h0"], "rwkv7": ["h0"],
              "gsa": ["hk0", "hv0"]}

# (B, T, cu_seqlens): fixed lengths 1, 5, 7 and varlen with an empty sequence.
SHAPES = {"T1": (2, 1, None), "T5": (2, 5, None), "T7": (2, 7, None), "varlen": (1, 7, [0, 2, 2, 7])}


def setup(family, shape, head_first, seed=0):
    B, T, cu = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    N = B if cu is None else len(cu) - 1
    make, fwd, bwd = FAMILIES[family]
    x, dht = make(B, T, N, gen, head_first)
    o, _ = fwd(x, head_first=head_first, cu_seqlens=None if cu is None else torch.tensor(cu))
    do = torch.randn(o.shape, generator=gen, dtype=F64)
    return x, do, dht, (None if cu is None else torch.tensor(cu))


def run_fd_check(family, shape, head_first, reverse, scale=None):
    _, fwd, bwd = FAMILIES[family]
    x, do, dht, cu = setup(family, shape, head_first)
    kw = dict(head_first=head_first, reverse=reverse, cu_seqlens=cu)
    if scale is not None:
        kw["scale"] = scale

    def loss(inp):
        o, hs = fwd(inp, **kw)
        return ((do * o).sum() + sum((d * h).sum() for d, h in zip(dht, hs))).item()

    o, hs = fwd(x, **kw)
    assert o.dtype == F64 and o.shape == do.shape
    for h, d in zip(hs, dht):
        assert h.dtype == F64 and h.shape == d.shape
    got = bwd(x, do, dht, **kw)
    assert set(got) == set(x), f"gradient keys {sorted(got)} != inputs {sorted(x)}"
    want = fd_grads(loss, x)
    for name in x:
        check(f"{family}.d{name}", got[name], want[name])


# ------------------------------------------------------------------------------------------------
# Finite differences
# ------------------------------------------------------------------------------------------------

# (shape, head_first, reverse) cells: the full layout x direction grid for T=1 and varlen (cheap),
# and for T=5 / T=7 two complementary cells each, so every T meets both layouts and both directions
# while the whole file stays well under a minute (head_first at T=7 is also checked exactly by
# test_head_first_is_a_transpose).
FD_CELLS = ([("T1", hf, rev) for hf in (False, True) for rev in (False, True)]
            + [("varlen", hf, rev) for hf in (False, True) for rev in (False, True)]
            + [("T5", False, True), ("T5", True, False), ("T7", False, False), ("T7", True, True)])
FD_CASES = [
    pytest.param(fam, shape, hf, rev,
                 id=f"{fam}-{shape}-{'bhtd' if hf else 'bthd'}-{'rev' if rev else 'fwd'}")
    for fam in FAMILIES for shape, hf, rev in FD_CELLS
]


@pytest.mark.parametrize("family,shape,head_first,reverse", FD_CASES)
def test_bptt_vs_finite_differences(family, shape, head_first, reverse):
    run_fd_check(family, shape, head_first, reverse)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bptt_vs_finite_differences_scale(family):
    """Non-default scale (varlen, reverse, head_first)."""
    run_fd_check(family, "varlen", True, True, scale=0.7)


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_head_first_is_a_transpose(family, reverse):
    """head_first=True on [B, H, T, D] equals the fla layout on the transposed inputs, exactly."""
    _, fwd, bwd = FAMILIES[family]
    x, do, dht, cu = setup(family, "T7", False, seed=5)
    hf = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731  [B, T, H, D] -> [B, H, T, D]
    seq = [n for n in x if n not in STATE_KEYS[family] and n != "u"]
    x_hf = {n: (hf(t) if n in seq else t) for n, t in x.items()}
    o, hs = fwd(x, reverse=reverse)
    o_hf, hs_hf = fwd(x_hf, reverse=reverse, head_first=True)
    check("o", o_hf, hf(o), 0, 0)
    for h, h_hf in zip(hs, hs_hf):
        check("hT", h_hf, h, 0, 0)
    g = bwd(x, do, dht, reverse=reverse)
    g_hf = bwd(x_hf, hf(do), dht, reverse=reverse, head_first=True)
    for n in x:
        check(f"d{n}", g_hf[n], hf(g[n]) if n in seq else g[n], 0, 0)


# ------------------------------------------------------------------------------------------------
# Structural checks: no initial state / no dHT equals zeros; varlen equals per-sequence runs
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_none_state_is_zero_state(family):
    _, fwd, bwd = FAMILIES[family]
    x, do, dht, cu = setup(family, "varlen", False, seed=1)
    kw = dict(cu_seqlens=cu)
    x_none = {n: t for n, t in x.items() if n not in STATE_KEYS[family]}
    x_zero = {n: (torch.zeros_like(t) if n in STATE_KEYS[family] else t) for n, t in x.items()}
    o_n, hs_n = fwd(x_none, **kw)
    o_z, hs_z = fwd(x_zero, **kw)
    check("o", o_n, o_z, 0, 0)
    for h_n, h_z in zip(hs_n, hs_z):
        check("hT", h_n, h_z, 0, 0)
    g_n = bwd(x_none, do, None, **kw)
    g_z = bwd(x_zero, do, [torch.zeros_like(d) for d in dht], **kw)
    assert set(g_n) == set(x), f"gradient keys {sorted(g_n)} != {sorted(x)}"
    for name in x:
        check(f"d{name}", g_n[name], g_z[name], 0, 0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_varlen_matches_separate_sequences(family):
    """Each cu_seqlens sequence equals running it alone (B=1); the empty one gives hT = h0, dh0 = dHT."""
    _, fwd, bwd = FAMILIES[family]
    x, do, dht, cu = setup(family, "varlen", False, seed=2)
    bounds = cu.tolist()
    o, hs = fwd(x, cu_seqlens=cu, reverse=True)
    g = bwd(x, do, dht, cu_seqlens=cu, reverse=True)
    states = STATE_KEYS[family]
    du_sum = 0
    for n in range(len(bounds) - 1):
        bos, eos = bounds[n], bounds[n + 1]
        xn = {k: (t[n:n + 1] if k in states else t if t.dim() < 4 else t[:, bos:eos])
              for k, t in x.items()}
        dhtn = [d[n:n + 1] for d in dht]
        if eos == bos:
            for h, h0 in zip(hs, states):
                check("hT(empty)", h[n], x[h0][n], 0, 0)
            for d, h0 in zip(dht, states):
                check("dh0(empty)", g[h0][n], d[n], 0, 0)
            continue
        on, hsn = fwd(xn, reverse=True)
        gn = bwd(xn, do[:, bos:eos], dhtn, reverse=True)
        check("o", o[:, bos:eos], on, 1e-14, 0)
        for h, h_n in zip(hs, hsn):
            check("hT", h[n:n + 1], h_n, 1e-14, 0)
        for name, t in gn.items():
            if name == "u":  # shared across sequences: the sum is checked below
                du_sum = du_sum + t
                continue
            ref = g[name][n:n + 1] if name in states else g[name][:, bos:eos]
            check(f"d{name}", ref, t, 1e-14, 0)
    if "u" in g:
        check("du", g["u"], du_sum, 1e-14, 0)


# ------------------------------------------------------------------------------------------------
# docs/algorithms.md §8.4 item 2: log decay -1e4 everywhere (exp underflows to exactly 0)
# ------------------------------------------------------------------------------------------------

def _order(L, reverse):
    return list(range(L))[::-1] if reverse else list(range(L))


@pytest.mark.parametrize("side", ["g", "gv"])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("shape", ["T1", "T5", "varlen"])
def test_gla_very_negative_decay(shape, reverse, side):
    """Either side's decay at -1e4 everywhere (gv alone: the value-side decay) gives the same map."""
    family = "gla" if side == "g" else "gla_v"
    _, fwd, bwd = FAMILIES[family]
    x, do, dht, cu = setup(family, shape, False, seed=3)
    x[side] = torch.full_like(x[side], -1e4)
    s = 0.9
    kw = dict(scale=s, reverse=reverse, cu_seqlens=cu)
    o, (hT,) = fwd(x, **kw)
    q, k, v = x["q"], x["k"], x["v"]
    o_ref = s * (q * k).sum(-1, keepdim=True) * v
    check("o", o, o_ref, 1e-14, 0)
    spans = reference._spans(q.shape[0], q.shape[1], cu)
    for n, (b, bos, eos) in enumerate(spans):
        if eos == bos:
            h_ref = x["h0"][n]
        else:
            t = _order(eos - bos, reverse)[-1] + bos   # last token processed
            h_ref = k[b, t, :, :, None] * v[b, t, :, None, :]
        check(f"hT[{n}]", hT[n], h_ref, 1e-14, 0)
    grads = bwd(x, do, dht, **kw)
    for n, (b, bos, eos) in enumerate(spans):
        want = dht[0][n] if eos == bos else torch.zeros_like(dht[0][n])
        check(f"dh0[{n}]", grads["h0"][n], want, 0, 0)


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("shape", ["T1", "T5", "varlen"])
def test_rwkv6_very_negative_decay(shape, reverse):
    x, do, dht, cu = setup("rwkv6", shape, False, seed=4)
    x["w"] = torch.full_like(x["w"], -1e4)
    s = 0.9
    kw = dict(scale=s, reverse=reverse, cu_seqlens=cu)
    o, (hT,) = fwd_rwkv6(x, **kw)
    r, k, v, u, h0 = x["r"], x["k"], x["v"], x["u"], x["h0"]
    o_ref = torch.zeros_like(o)
    dh0_ref = torch.zeros_like(h0)
    spans = reference._spans(r.shape[0], r.shape[1], cu)
    for n, (b, bos, eos) in enumerate(spans):
        order = [bos + i for i in _order(eos - bos, reverse)]
        for i, t in enumerate(order):
            bonus = (r[b, t] * u * k[b, t]).sum(-1, keepdim=True) * v[b, t]
            if i == 0:
                prev = torch.einsum("hk,hkv->hv", r[b, t], h0[n])
                dh0_ref[n] = s * r[b, t, :, :, None] * do[b, t, :, None, :]
            else:
                tp = order[i - 1]
                prev = (r[b, t] * k[b, tp]).sum(-1, keepdim=True) * v[b, tp]
            o_ref[b, t] = s * (prev + bonus)
        if not order:
            h_ref, dh0_ref[n] = h0[n], dht[0][n]
        else:
            h_ref = k[b, order[-1], :, :, None] * v[b, order[-1], :, None, :]
        check(f"hT[{n}]", hT[n], h_ref, 1e-14, 0)
    check("o", o, o_ref, 1e-14, 0)
    grads = bwd_rwkv6(x, do, dht, **kw)
    check("dh0", grads["h0"], dh0_ref, 1e-14, 0)
