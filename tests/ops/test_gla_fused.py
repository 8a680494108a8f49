"""fla::fused_recurrent_gla: forward and every gradient vs the float64 oracle, on CPU and CUDA,
with the key-side decay gk, the value-side decay gv, both, or neither."""
import itertools
import math

import pytest
import torch

from conftest import DEVICES, TOL, assert_close
from fla_ext import fused_recurrent_gla, reference
from inputs import STRESS, make_diag, make_gv

NAMES = ["q", "k", "v", "g", "gv", "h0"]
# Which decays a case passes: gk only (the original op), gv only, or both together.
DECAYS = ["gk", "gv", "gkgv"]


def run_and_check(q, k, v, g, h0, *, gv=None, dht_on=True, scale=None, reverse=False, cu=None,
                  head_first=False, gen=None, tol_decay=None):
    dtype = q.dtype
    tol, tol_dg, atol = TOL[dtype]
    tol_dg = tol_decay or tol_dg
    ins = [None if t is None else t.detach().clone().requires_grad_(True)
           for t in (q, k, v, g, gv, h0)]
    o, ht = fused_recurrent_gla(*ins[:3], gk=ins[3], gv=ins[4], scale=scale, initial_state=ins[5],
                                output_final_state=True, reverse=reverse, cu_seqlens=cu,
                                head_first=head_first)
    kw = dict(scale=scale, initial_state=h0, reverse=reverse, cu_seqlens=cu, head_first=head_first,
              gv=gv)
    o_ref, ht_ref = reference.gla(q, k, v, g, **kw)
    assert o.dtype == dtype
    assert_close("o", o, o_ref, tol, atol)
    assert_close("ht", ht, ht_ref, tol, atol)
    do = torch.randn(o.shape, generator=gen).to(o)
    dht = torch.randn(ht.shape, generator=gen).to(ht) if dht_on else None
    ((o * do).sum() + ((ht * dht).sum() if dht_on else 0)).backward()
    grads = reference.gla_bwd(q, k, v, g, do, dht, **kw)
    for name, x in zip(NAMES, ins):
        if x is None:
            continue
        assert x.grad is not None, f"no gradient for {name}"
        assert_close(f"d{name}", x.grad, grads[name], tol_dg if name in ("g", "gv") else tol, atol)
    return o, ht


def with_decays(decays, q, g, v, gen, **kw):
    """(gk, gv) for a DECAYS case: make_diag's g as gk, and a fresh gv like v (make_gv kw)."""
    gv = None
    if decays != "gk":
        B, T, H, V = (v.shape[0], v.shape[2], v.shape[1], v.shape[3]) if kw.get("head_first") \
            else tuple(v.shape)
        gv = make_gv(B, T, H, V, v.dtype, v.device, gen, **kw)
    return (g if decays != "gv" else None), gv


SHAPES = [(2, 37, 3, 16, 64), (2, 20, 2, 128, 32), (1, 1, 2, 64, 64), (2, 33, 2, 60, 100)]
FLAGS = list(itertools.product([False, True], repeat=3))  # (head_first, noncontig, reverse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}V{}".format(*s))
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "hf{}nc{}rev{}".format(*map(int, f)))
@pytest.mark.parametrize("decays", DECAYS)
def test_grid(device, dtype, shape, flags, decays, gen):
    head_first, noncontig, reverse = flags
    q, k, v, g, h0 = make_diag(*shape, dtype, device, gen, head_first=head_first,
                               noncontig=noncontig, h0=(shape[1] + int(reverse)) % 2 == 0 or head_first)
    g, gv = with_decays(decays, q, g, v, gen, head_first=head_first, noncontig=noncontig)
    run_and_check(q, k, v, g, h0, gv=gv, dht_on=not noncontig or reverse, reverse=reverse,
                  head_first=head_first, gen=gen)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}V{}".format(*s))
@pytest.mark.parametrize("decays", DECAYS)
def test_fp64(shape, decays, gen):
    """float64 (CPU): float64 states and math, to the oracle's precision; reversed, head_first."""
    q, k, v, g, h0 = make_diag(*shape, torch.float64, "cpu", gen, head_first=True)
    g, gv = with_decays(decays, q, g, v, gen, head_first=True)
    run_and_check(q, k, v, g, h0, gv=gv, reverse=True, head_first=True, gen=gen, scale=0.3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 19, 2, 32, 16), (2, 1, 2, 64, 64)], ids=["T19", "T1"])
def test_no_decay(device, shape, gen):
    q, k, v, _, h0 = make_diag(*shape, torch.float32, device, gen)
    run_and_check(q, k, v, None, h0, gen=gen, scale=0.4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decays", DECAYS)
def test_zero_decays_equal_none(device, decays, gen):
    """gk = 0 and/or gv = 0 is the undecayed op exactly (forward and every gradient)."""
    q, k, v, g, h0 = make_diag(2, 13, 2, 16, 24, torch.float32, device, gen)
    g, gv = with_decays(decays, q, g, v, gen, w_kind="zero")
    g = None if g is None else torch.zeros_like(g)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, h0)]
    outs = []
    for kw in (dict(gk=g, gv=gv), dict()):
        xs = [t.detach().clone().requires_grad_(True) for t in ins]
        o, ht = fused_recurrent_gla(*xs[:3], initial_state=xs[3], output_final_state=True, **kw)
        (o.square().sum() + ht.sum()).backward()
        outs.append([o, ht] + [t.grad for t in xs])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cu", [[0, 3, 3, 9], [0, 1, 17, 81, 145, 400, 1000]], ids=["empty", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("decays", DECAYS)
def test_varlen(device, cu, dtype, decays, gen):
    T, N = cu[-1], len(cu) - 1
    q, k, v, g, h0 = make_diag(1, T, 2, 32, 16, dtype, device, gen, N=N)
    g, gv = with_decays(decays, q, g, v, gen)
    cu_t = torch.tensor(cu, dtype=torch.long, device=device)
    o, ht = run_and_check(q, k, v, g, h0, gv=gv, cu=cu_t, gen=gen, reverse=True)
    same = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    part = lambda x, a, b: None if x is None else x[:, a:b]  # noqa: E731
    for n in range(N):
        a, b = cu[n], cu[n + 1]
        on, hn = fused_recurrent_gla(q[:, a:b], k[:, a:b], v[:, a:b], part(g, a, b), part(gv, a, b),
                                     initial_state=h0[n:n + 1], output_final_state=True, reverse=True)
        torch.testing.assert_close(on, o[:, a:b], **same)
        torch.testing.assert_close(hn, ht[n:n + 1], **same)
    if cu == [0, 3, 3, 9]:
        torch.testing.assert_close(ht[1], h0[1], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("w_kind", STRESS)
@pytest.mark.parametrize("decays", DECAYS)
def test_stress_gates(device, dtype, w_kind, decays, gen):
    """docs/algorithms.md §8.4 gate regimes on the decays of the case (with both: both stressed).

    Written reason for the one wider tolerance: with gk and gv both U(-30, 0) every state entry
    decays by gk + gv, so the true dgk / dgv are ~10x smaller than with one side, while the closed
    form's absolute error is that of the one-sided case: ~u32 * |zeta| (zeta = rowsum(h_T * dh_T),
    O(10) here, from fp32 states), carried down every step until a factor is exactly 0 (measured
    4-8e-6 absolute for gk alone, gv alone and both). Relative to the smaller norm that is
    4e-5 .. 1.4e-4 for this case, so its decay gradients get 3e-4 in fp32."""
    q, k, v, g, h0 = make_diag(2, 70, 2, 64, 32, dtype, device, gen, w_kind=w_kind)
    g, gv = with_decays(decays, q, g, v, gen, w_kind=w_kind)
    wide = decays == "gkgv" and w_kind == "u30" and dtype == torch.float32
    run_and_check(q, k, v, g, h0, gv=gv, gen=gen, tol_decay=3e-4 if wide else None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("w_kind", ["typical", "u30", "mixedinf"])
def test_stress_mixed_sides(device, w_kind, gen):
    """A stressed decay on one side, the typical regime on the other (K > V and K < V)."""
    for K, V in ((48, 20), (20, 48)):
        q, k, v, g, h0 = make_diag(2, 40, 2, K, V, torch.float32, device, gen)
        gv = make_gv(2, 40, 2, V, torch.float32, device, gen, w_kind=w_kind)
        run_and_check(q, k, v, g, h0, gv=gv, gen=gen)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,w_kind", [(4096, "typical"), (8192, "typical"), (4096, "zero")])
@pytest.mark.parametrize("decays", ["gk", "gkgv"])
def test_stress_long(device, T, w_kind, decays, gen):
    q, k, v, g, h0 = make_diag(1, T, 1, 64, 64, torch.float32, device, gen, w_kind=w_kind)
    g, gv = with_decays(decays, q, g, v, gen, w_kind=w_kind)
    run_and_check(q, k, v, g, h0, gv=gv, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("g_fill", [-1e4, -math.inf])
@pytest.mark.parametrize("side", ["gk", "gv"])
def test_analytic_hard_decay(device, g_fill, side, gen):
    """docs/algorithms.md §8.4 item 2, on either side: o_t = s (q_t.k_t) v_t, hT = k_{T-1} v_{T-1}^T,
    dh0 = 0, and the hard decay's own gradient is exactly 0."""
    q, k, v, _, h0 = make_diag(2, 11, 2, 16, 8, torch.float32, device, gen)
    g = torch.full_like(q if side == "gk" else v, g_fill)
    s = 16 ** -0.5
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, h0)]
    o, ht = fused_recurrent_gla(*ins[:3], initial_state=ins[4], output_final_state=True,
                                **{side: ins[3]})
    torch.testing.assert_close(o, s * (q * k).sum(-1, keepdim=True) * v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, torch.einsum("bhk,bhv->bhkv", k[:, -1], v[:, -1]))
    (o.sum() + ht.sum()).backward()
    assert torch.equal(ins[4].grad, torch.zeros_like(h0))
    assert torch.equal(ins[3].grad, torch.zeros_like(g))  # d/dg of exp(g) = 0 factors, exactly


@pytest.mark.parametrize("decays", DECAYS)
def test_gradcheck_fp64(decays, gen):
    q, k, v, g, h0 = make_diag(1, 7, 2, 3, 4, torch.float64, "cpu", gen, N=2)
    g, gv = with_decays(decays, q, g, v, gen)
    cu = torch.tensor([0, 3, 7])
    names = [n for n, t in zip(NAMES, (q, k, v, g, gv, h0)) if t is not None]
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, gv, h0) if t is not None]

    def f(*xs):
        x = dict(zip(names, xs))
        return fused_recurrent_gla(x["q"], x["k"], x["v"], x.get("g"), x.get("gv"),
                                   initial_state=x["h0"], output_final_state=True, cu_seqlens=cu,
                                   reverse=True)

    assert torch.autograd.gradcheck(f, ins, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_compile(device, gen):
    q, k, v, g, h0 = make_diag(2, 9, 2, 8, 16, torch.float32, device, gen)
    gv = make_gv(2, 9, 2, 16, torch.float32, device, gen)
    for t in (q, k, v, g, gv, h0):
        t.requires_grad_(True)
    for args in [(q, k, v, g, None, None, h0, True, False, None, False),
                 (q, k, v, None, None, 0.5, None, False, True, None, False),
                 (q, k, v, None, gv, None, h0, True, True, None, False),
                 (q, k, v, g, gv, 0.7, h0, True, False, None, False)]:
        torch.library.opcheck(torch.ops.fla.fused_recurrent_gla.default, args)
    do, dht = torch.randn_like(v).detach(), torch.randn_like(h0).detach()
    for gk_, gv_ in ((g, None), (None, gv), (g, gv)):
        torch.library.opcheck(torch.ops.fla.fused_recurrent_gla_bwd.default,
                              tuple(t.detach() if isinstance(t, torch.Tensor) else t
                                    for t in (q, k, v, gk_, gv_, do, dht, None, h0, False, None,
                                              False)))
    torch._dynamo.reset()

    def f(q, k, v, g, gv, h0):
        o, ht = fused_recurrent_gla(q, k, v, g, gv, initial_state=h0, output_final_state=True)
        return (o * o).sum() + ht.square().sum()

    def f_gv(q, k, v, g, gv, h0):  # gv alone
        o, ht = fused_recurrent_gla(q, k, v, gv=gv, initial_state=h0, output_final_state=True)
        return (o * o).sum() + ht.square().sum()

    ins = [q, k, v, g, gv, h0]
    for fn, used in ((f, ins), (f_gv, [q, k, v, gv, h0])):
        cf = torch.compile(fn, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
        for a, b in zip(torch.autograd.grad(cf(*ins), used), torch.autograd.grad(fn(*ins), used)):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 1, 2, 128, 32), (2, 1, 3, 64, 6)], ids=["vec", "fallback"])
@pytest.mark.parametrize("decays", DECAYS)
def test_decode(device, shape, decays, gen):
    """T = 1 (the decode kernel on CUDA; a gv is one more per-column factor there)."""
    q, k, v, g, h0 = make_diag(*shape, torch.float32, device, gen, w_kind="mixedinf")
    g, gv = with_decays(decays, q, g, v, gen, w_kind="mixedinf")
    run_and_check(q, k, v, g, h0, gv=gv, gen=gen)


def test_errors_and_inputs_unchanged(gen):
    q, k, v, g, h0 = make_diag(2, 5, 2, 4, 6, torch.float32, "cpu", gen)
    gv = make_gv(2, 5, 2, 6, torch.float32, "cpu", gen)
    with pytest.raises(ValueError, match=r"`gv` must have the shape of `v`"):
        fused_recurrent_gla(q, k, v, g, gv[..., :4])
    with pytest.raises(ValueError, match=r"`gv` must have the shape of `v`"):
        fused_recurrent_gla(q, k, v, gv=g)  # a key-side shape (K != V)
    with pytest.raises(ValueError, match=r"`gv` has dtype .*Double but `v` has dtype .*Float"):
        fused_recurrent_gla(q, k, v, g, gv.double())
    with pytest.raises(ValueError, match=r"`gv` must be 4-D"):
        fused_recurrent_gla(q, k, v, gv=gv[0])
    with pytest.raises(TypeError, match="`gv` must be a torch.Tensor"):
        fused_recurrent_gla(q, k, v, g, gv=0.5)
    with pytest.raises(ValueError, match=r"`gk` must have the shape of `q`"):
        fused_recurrent_gla(q, k, v, g[..., :3])
    with pytest.raises(ValueError, match=r"K \(last dim of q, k, gk\) must be in \[1, 512\]"):
        big = torch.randn(1, 2, 1, 520)
        fused_recurrent_gla(big, big, torch.randn(1, 2, 1, 4), -big.abs())
    with pytest.raises(TypeError, match="`q` must be a torch.Tensor"):
        fused_recurrent_gla(None, k, v, g)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, gv, h0)]
    before = [t.detach().clone() for t in ins]
    o, ht = fused_recurrent_gla(*ins[:5], initial_state=ins[5], output_final_state=True)
    (o.sum() + ht.sum()).backward()
    for a, b in zip(ins, before):
        assert torch.equal(a.detach(), b)


def test_value_checks_cover_gv(gen, monkeypatch):
    """FLA_EXT_CHECKS=1: a positive or NaN gv is named (forward and backward op)."""
    q, k, v, g, h0 = make_diag(1, 4, 1, 3, 5, torch.float32, "cpu", gen)
    gv = make_gv(1, 4, 1, 5, torch.float32, "cpu", gen)
    monkeypatch.setenv("FLA_EXT_CHECKS", "1")
    fused_recurrent_gla(q, k, v, g, gv)  # valid: no error
    bad = gv.clone()
    bad[0, 2, 0, 3] = 0.5
    with pytest.raises(ValueError, match=r"`gv` is a log decay and must be <= 0, but is positive at index \(0, 2, 0, 3\)"):
        fused_recurrent_gla(q, k, v, g, bad)
    bad[0, 2, 0, 3] = math.nan
    with pytest.raises(ValueError, match=r"`gv` has a NaN at index \(0, 2, 0, 3\)"):
        torch.ops.fla.fused_recurrent_gla_bwd(q, k, v, None, bad, torch.zeros_like(v), None, None,
                                              None, False, None, False)
    bad[0, 2, 0, 3] = -math.inf  # a hard reset is a valid log decay
    fused_recurrent_gla(q, k, v, g, bad)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gv_device_mismatch(gen):
    q, k, v, g, h0 = make_diag(1, 4, 1, 3, 5, torch.float32, "cuda", gen)
    gv = make_gv(1, 4, 1, 5, torch.float32, "cpu", gen)
    with pytest.raises(RuntimeError, match=r"`gv` is on cpu but `v` is on cuda"):
        fused_recurrent_gla(q, k, v, g, gv)
