"""fla::fused_recurrent_rwkv7 (DPLR): forward and every gradient vs the float64 oracle, CPU and CUDA."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES, assert_close
from inputs import STRESS, make_diag
from fla_ext import fused_mul_recurrent_rwkv7, fused_recurrent_rwkv7, reference
from rwkv7_cases import ERRORS, NAMES, _good, check_bad_input, make, relayout, run_and_check

# ---------------------------------------------------------------------------------------------
# The grid: shapes (K != V both ways, T = 1, odd sizes, V over several column tiles), dtypes,
# layouts, h0/dht, direction.

SHAPES = [(2, 37, 3, 16, 64), (2, 20, 2, 128, 32), (1, 1, 2, 64, 64), (2, 33, 2, 60, 100),
          (1, 18, 1, 256, 8)]
FLAGS = list(itertools.product([False, True], repeat=3))  # (head_first, noncontig, reverse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}V{}".format(*s))
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "hf{}nc{}rev{}".format(*map(int, f)))
def test_grid(device, dtype, shape, flags, gen):
    head_first, noncontig, reverse = flags
    h0_on = (shape[1] + int(reverse)) % 2 == 0 or head_first  # both states of h0 over the grid
    dht_on = not noncontig or reverse
    ins = make(*shape, dtype, device, gen, head_first=head_first, noncontig=noncontig, h0=h0_on)
    run_and_check(*ins, dht_on=dht_on, reverse=reverse, head_first=head_first, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("h0_on,dht_on", [(False, False), (True, False), (False, True), (True, True)])
def test_state_options(device, h0_on, dht_on, gen):
    ins = make(2, 23, 2, 32, 48, torch.float32, device, gen, h0=h0_on)
    run_and_check(*ins, dht_on=dht_on, scale=1.0, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16(device, gen):
    r, w, k, v, a, b, h0 = make(2, 29, 2, 64, 64, torch.float16, device, gen)
    run_and_check(r * 0.5, w, k * 0.5, v, a, b, h0, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
def test_defaults(device, gen):
    """fla's defaults: scale = K ** -0.5, output_final_state = True."""
    r, w, k, v, a, b, _ = make(2, 9, 2, 16, 8, torch.float32, device, gen, h0=False)
    o, ht = fused_recurrent_rwkv7(r, w, k, v, a, b)
    o_ref, ht_ref = reference.rwkv7(r, w, k, v, a, b, scale=16 ** -0.5)
    assert_close("o", o, o_ref, 1e-5, 1e-6)
    assert_close("ht", ht, ht_ref, 1e-5, 1e-6)
    o2, ht2 = fused_recurrent_rwkv7(r, w, k, v, a, b, scale=1.0, output_final_state=False)
    assert ht2 is None
    assert_close("o(scale=1)", o2, reference.rwkv7(r, w, k, v, a, b, scale=1.0)[0], 1e-5, 1e-6)


# ---------------------------------------------------------------------------------------------
# Variable length

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cu", [[0, 3, 3, 9], [0, 1, 17, 81, 145, 400, 1000]], ids=["empty", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_varlen(device, cu, dtype, gen):
    T, N = cu[-1], len(cu) - 1
    r, w, k, v, a, b, h0 = make(1, T, 2, 32, 40, dtype, device, gen, N=N)
    cu_t = torch.tensor(cu, dtype=torch.long, device=device)
    o, ht = run_and_check(r, w, k, v, a, b, h0, cu=cu_t, gen=gen)
    same = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for n in range(N):  # each sequence alone: same output and state
        s, e = cu[n], cu[n + 1]
        on, hn = fused_recurrent_rwkv7(r[:, s:e], w[:, s:e], k[:, s:e], v[:, s:e], a[:, s:e],
                                       b[:, s:e], initial_state=h0[n:n + 1])
        torch.testing.assert_close(on, o[:, s:e], **same)
        torch.testing.assert_close(hn, ht[n:n + 1], **same)
    if cu == [0, 3, 3, 9]:  # the empty sequence passes its state through, both ways
        torch.testing.assert_close(ht[1], h0[1], rtol=0, atol=0)
        h0g = h0.clone().requires_grad_(True)
        o, ht = fused_recurrent_rwkv7(r, w, k, v, a, b, initial_state=h0g, cu_seqlens=cu_t)
        dht = torch.randn(ht.shape, generator=gen).to(ht)
        (ht * dht).sum().backward()
        torch.testing.assert_close(h0g.grad[1], dht[1], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_int32_head_first(device, gen):
    cu = torch.tensor([0, 5, 12, 40], dtype=torch.int32, device=device)
    ins = make(1, 40, 3, 16, 24, torch.float32, device, gen, N=3, head_first=True)
    run_and_check(*ins, cu=cu, head_first=True, reverse=True, gen=gen)


# ---------------------------------------------------------------------------------------------
# Stress suite (ALGORITHMS.md §8.4): generic log decays (not only RWKV-7's [-0.61, 0]) with
# RWKV-7's low-rank pair, and the low-rank regimes (iclr 0 / 1: ||b a^T|| = 1; generic a, b).

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("w_kind", STRESS + ["rwkv7"])
def test_stress_gates(device, dtype, w_kind, gen):
    if w_kind == "rwkv7":  # RWKV-7's own parametrisation: w = -exp(-0.5) * sigmoid(x)
        ins = list(make(2, 70, 2, 64, 32, dtype, device, gen))
        x = torch.randn(ins[1].shape, generator=gen)
        ins[1] = relayout(-math.exp(-0.5) * torch.sigmoid(x), ins[0])
    else:
        ins = make(2, 70, 2, 64, 32, dtype, device, gen, w_kind=w_kind)
    run_and_check(*ins, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lr", ["iclr0", "iclr1", "generic"])
@pytest.mark.parametrize("w_kind", ["zero", "near0", "typical"])
def test_stress_low_rank(device, lr, w_kind, gen):
    ins = make(2, 64, 2, 32, 48, torch.float32, device, gen, lr=lr, w_kind=w_kind)
    run_and_check(*ins, scale=1.0, gen=gen)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,w_kind,lr", [(4096, "typical", "rwkv"), (8192, "typical", "iclr1"),
                                         (4096, "zero", "rwkv"), (4096, "near0", "iclr1")])
def test_stress_long(device, T, w_kind, lr, gen):
    ins = make(1, T, 1, 64, 64, torch.float32, device, gen, w_kind=w_kind, lr=lr)
    run_and_check(*ins, scale=1.0, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("w_fill", [-1e4, -math.inf])
def test_analytic_hard_decay(device, w_fill, gen):
    """exp(w) = 0: h_t = b_t (a_t^T h_{t-1}) + k_t v_t^T, so with a = 0 only the current token
    remains: o_t = s (r_t . k_t) v_t, hT = k v^T, dh0 = 0, dw = 0."""
    B, T, H, K, V = 2, 11, 2, 16, 8
    r, _, k, v, a, b, h0 = make(B, T, H, K, V, torch.float32, device, gen)
    w = torch.full_like(r, w_fill)
    a = torch.zeros_like(a)
    ins = [t.clone().requires_grad_(True) for t in (r, w, k, v, a, b, h0)]
    o, ht = fused_recurrent_rwkv7(*ins[:6], scale=0.5, initial_state=ins[6])
    expect = 0.5 * torch.einsum("bthk,bthk->bth", r, k)[..., None] * v
    torch.testing.assert_close(o, expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, torch.einsum("bhk,bhv->bhkv", k[:, -1], v[:, -1]))
    (o.square().sum() + ht.sum()).backward()
    assert (ins[6].grad == 0).all() and (ins[1].grad == 0).all()


# ---------------------------------------------------------------------------------------------
# fused_mul_recurrent_rwkv7: a = -kk, b = kk * a formed inside, fla's defaults (scale 1.0, no
# final state); gradients reach kk and a through the products.

@pytest.mark.parametrize("device", DEVICES)
def test_fused_mul(device, gen):
    B, T, H, K, V = 2, 21, 2, 32, 16
    r, k, v, w, h0 = make_diag(B, T, H, K, V, torch.float32, device, gen)
    kk = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(device)
    iclr = torch.rand(B, T, H, K, generator=gen).to(device)
    ins = [t.clone().requires_grad_(True) for t in (r, w, k, v, kk, iclr, h0)]
    o, ht = fused_mul_recurrent_rwkv7(*ins[:6], initial_state=ins[6])
    assert ht is None
    o_ref, _ = reference.rwkv7(r, w, k, v, -kk, kk * iclr, scale=1.0, initial_state=h0)
    assert_close("o", o, o_ref, 1e-5, 1e-6)
    do = torch.randn(o.shape, generator=gen).to(o)
    (o * do).sum().backward()
    g = reference.rwkv7_bwd(r, w, k, v, -kk, kk * iclr, do, scale=1.0, initial_state=h0)
    dkk = -g["a"] + g["b"] * iclr.double().cpu()
    diclr = g["b"] * kk.double().cpu()
    for name, x, ref in [("r", ins[0], g["r"]), ("w", ins[1], g["w"]), ("kk", ins[4], dkk),
                         ("a", ins[5], diclr), ("h0", ins[6], g["h0"])]:
        assert_close(f"d{name}", x.grad, ref, 5e-5, 1e-6)
    o2, ht2 = fused_mul_recurrent_rwkv7(r, w, k, v, kk, iclr, scale=None, output_final_state=True,
                                        reverse=True)
    o2_ref, ht2_ref = reference.rwkv7(r, w, k, v, -kk, kk * iclr, scale=K ** -0.5, reverse=True)
    assert_close("o(reverse)", o2, o2_ref, 1e-5, 1e-6)
    assert_close("ht(reverse)", ht2, ht2_ref, 1e-5, 1e-6)


# ---------------------------------------------------------------------------------------------
# Exact fp64 path: gradcheck, and inputs left untouched

def test_gradcheck_fp64(gen):
    H, K, V = 2, 3, 4
    r, w, k, v, a, b, h0 = make(1, 20, H, K, V, torch.float64, "cpu", gen, N=3, lr="generic")
    cu = torch.tensor([0, 3, 3, 20])  # an empty sequence and one that spans two segments
    ins = [t.clone().requires_grad_(True) for t in (r, w, k, v, a, b, h0)]

    def f(r, w, k, v, a, b, h0):
        return fused_recurrent_rwkv7(r, w, k, v, a, b, initial_state=h0, cu_seqlens=cu)

    assert torch.autograd.gradcheck(f, ins, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_unchanged(device, gen):
    ins = make(2, 19, 2, 16, 40, torch.bfloat16, device, gen, noncontig=True)
    ins = [t.clone().requires_grad_(True) for t in ins]
    before = [t.detach().clone() for t in ins]
    o, ht = fused_recurrent_rwkv7(*ins[:6], initial_state=ins[6])
    (o.float().sum() + ht.sum()).backward()
    for name, x, y in zip(NAMES, ins, before):
        assert torch.equal(x.detach(), y), f"{name} was modified"


# ---------------------------------------------------------------------------------------------
# Decode: one token with a state (CUDA: a dedicated kernel for row-contiguous states and V % 4 == 0).

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 1, 2, 128, 32), (2, 1, 2, 16, 100), (2, 1, 3, 64, 6),
                                   (1, 1, 1, 256, 256), (4, 1, 2, 5, 12), (2, 1, 2, 64, 64)],
                         ids=lambda s: "B{}T{}H{}K{}V{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode(device, shape, dtype, gen):
    ins = make(*shape, dtype, device, gen, w_kind="mixedinf")
    run_and_check(*ins, scale=1.0, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_strided_state(device, gen):
    B, H, K, V = 2, 2, 32, 16
    r, w, k, v, a, b, _ = make(B, 1, H, K, V, torch.float32, device, gen, h0=False)
    wide = torch.randn(B, H, K, 2 * V, generator=gen).to(device)
    h0 = wide[..., ::2]  # not row-contiguous
    o, ht = fused_recurrent_rwkv7(r, w, k, v, a, b, initial_state=h0)
    o_ref, ht_ref = reference.rwkv7(r, w, k, v, a, b, scale=K ** -0.5, initial_state=h0)
    assert_close("o", o, o_ref, 1e-5, 1e-6)
    assert_close("ht", ht, ht_ref, 1e-5, 1e-6)


# ---------------------------------------------------------------------------------------------
# Real ops: opcheck (schema, fake kernel, autograd registration) and torch.compile fullgraph.

def samples(device, requires_grad=True):
    g = torch.Generator().manual_seed(11)
    out = []
    for (B, T, H, K, V, hf, h0, fin, cu) in [(2, 9, 2, 8, 40, False, True, True, None),
                                            (1, 20, 2, 16, 8, True, False, False, [0, 5, 5, 20]),
                                            (2, 1, 1, 4, 4, False, False, True, None)]:
        r, w, k, v, a, b, s0 = make(B, T, H, K, V, torch.float32, device, g, head_first=hf,
                                    h0=h0, N=len(cu) - 1 if cu else B)
        ts = [r, w, k, v, a, b] + ([s0] if h0 else [])
        if requires_grad:
            for t in ts:
                t.requires_grad_(True)
        cu_t = torch.tensor(cu, device=device) if cu else None
        out.append((r, w, k, v, a, b, None, s0, fin, False, cu_t, hf))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for args in samples(device):
        torch.library.opcheck(torch.ops.fla.fused_recurrent_rwkv7.default, args)
    for (r, w, k, v, a, b, _, s0, fin, rev, cu, hf) in samples(device, requires_grad=False):
        N = cu.numel() - 1 if cu is not None else r.shape[0]
        H = r.shape[1] if hf else r.shape[2]
        dht = torch.randn(N, H, r.shape[-1], v.shape[-1], device=device) if fin else None
        torch.library.opcheck(torch.ops.fla.fused_recurrent_rwkv7_bwd.default,
                              (r, w, k, v, a, b, torch.randn_like(v), dht, 0.5, s0, rev, cu, hf))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_fwd_bwd(device):
    torch._dynamo.reset()
    r, w, k, v, a, b, _, s0, _, _, _, _ = samples(device)[0]

    def f(r, w, k, v, a, b, s0):
        o, ht = fused_recurrent_rwkv7(r, w, k, v, a, b, initial_state=s0)
        return (o * o).sum() + ht.square().sum()

    cf = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    ins = [r, w, k, v, a, b, s0]
    loss_c = cf(*ins)
    g_c = torch.autograd.grad(loss_c, ins)
    loss_e = f(*ins)
    g_e = torch.autograd.grad(loss_e, ins)
    torch.testing.assert_close(loss_c, loss_e)
    for x, y in zip(g_c, g_e):
        torch.testing.assert_close(x, y)


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, before any kernel runs.

@pytest.mark.parametrize("kw,exc,msg", ERRORS, ids=[e[2][:30] for e in ERRORS])
def test_bad_input(kw, exc, msg):
    check_bad_input(fused_recurrent_rwkv7, kw, exc, msg)


def test_bad_grad_shapes():
    x = _good()
    args = [x[n] for n in ("r", "w", "k", "v", "a", "b")]
    with pytest.raises(ValueError, match=r"`grad_o` must have the shape of `v`"):
        torch.ops.fla.fused_recurrent_rwkv7_bwd(*args, x["r"], None, None, None, False, None, False)
    with pytest.raises(ValueError, match=r"`grad_final_state` must have shape"):
        torch.ops.fla.fused_recurrent_rwkv7_bwd(*args, x["v"], torch.zeros(1, 2, 4, 6), None, None,
                                                False, None, False)


def test_value_checks():
    import fla_ext
    x = _good()
    x["a"][1, 2, 0, 3] = math.nan
    fla_ext.set_checks(True)
    try:
        with pytest.raises(ValueError, match=r"`a` has a non-finite value at index \(1, 2, 0, 3\)"):
            fused_recurrent_rwkv7(**x)
        x["a"][1, 2, 0, 3] = 0.0
        x["w"][0, 1, 1, 1] = 0.25
        with pytest.raises(ValueError, match=r"`w` is a log decay and must be <= 0"):
            fused_recurrent_rwkv7(**x)
    finally:
        fla_ext.set_checks(False)
