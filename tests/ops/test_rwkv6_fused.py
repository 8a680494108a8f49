"""fla::fused_recurrent_rwkv6: forward and every gradient vs the float64 oracle, on CPU and CUDA."""
import itertools
import math

import pytest
import torch

import families
from conftest import DEVICES, assert_close
from inputs import STRESS, make_diag
from fla_ext import fused_recurrent_rwkv6, reference

NAMES = ["r", "k", "v", "w", "u", "h0"]


def make(B, T, H, K, V, dtype, device, gen, *, u_scale=1.0, **kw):
    """RWKV6 inputs (r, k, v, w, u, h0)."""
    r, k, v, w, h0 = make_diag(B, T, H, K, V, dtype, device, gen, **kw)
    u = (u_scale * torch.randn(H, K, generator=gen)).to(device=device, dtype=dtype)
    return r, k, v, w, u, h0


def run_and_check(r, k, v, w, u, h0, *, cu=None, **kw):
    """o, final state and every gradient vs the float64 oracle: families.run_and_check on the
    fused mode (kw: dht_on, scale, reverse, head_first, gen, tol_scale). Returns (o, ht)."""
    x = dict(zip(NAMES, (r, k, v, w, u, h0)))
    o, ht, _ = families.run_and_check(families.RWKV6, "fused", x, cu_seqlens=cu, **kw)
    assert ht.dtype == (torch.float64 if r.dtype == torch.float64 else torch.float32)
    return o, ht


# ---------------------------------------------------------------------------------------------
# The grid: shapes (K != V both ways, T = 1, odd sizes), dtypes, layouts, h0/dht, direction.

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
    r, k, v, w, u, h0 = make(*shape, dtype, device, gen, head_first=head_first,
                             noncontig=noncontig, h0=h0_on)
    run_and_check(r, k, v, w, u, h0, dht_on=dht_on, reverse=reverse, head_first=head_first, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("h0_on,dht_on", [(False, False), (True, False), (False, True), (True, True)])
def test_state_options(device, h0_on, dht_on, gen):
    r, k, v, w, u, h0 = make(2, 23, 2, 32, 48, torch.float32, device, gen, h0=h0_on)
    run_and_check(r, k, v, w, u, h0, dht_on=dht_on, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16(device, gen):
    r, k, v, w, u, h0 = make(2, 29, 2, 64, 64, torch.float16, device, gen)
    run_and_check(r * 0.5, k * 0.5, v, w, u, h0, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
def test_no_final_state_and_defaults(device, gen):
    r, k, v, w, u, _ = make(2, 9, 2, 16, 8, torch.float32, device, gen, h0=False)
    o, ht = fused_recurrent_rwkv6(r, k, v, w, u)
    assert ht is None
    o_ref, _ = reference.rwkv6(r, k, v, w, u)
    assert_close("o", o, o_ref, 1e-5, 1e-6)
    # scale defaults to K ** -0.5; an explicit one is honoured
    o2, _ = fused_recurrent_rwkv6(r, k, v, w, u, scale=0.3)
    assert_close("o(scale)", o2, reference.rwkv6(r, k, v, w, u, scale=0.3)[0], 1e-5, 1e-6)


# ---------------------------------------------------------------------------------------------
# Variable length

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cu", [[0, 3, 3, 9], [0, 1, 17, 81, 145, 400, 1000]], ids=["empty", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_varlen(device, cu, dtype, gen):
    T, N = cu[-1], len(cu) - 1
    r, k, v, w, u, h0 = make(1, T, 2, 32, 16, dtype, device, gen, N=N)
    cu_t = torch.tensor(cu, dtype=torch.long, device=device)
    o, ht = run_and_check(r, k, v, w, u, h0, cu=cu_t, gen=gen)
    # each sequence alone gives the same output and state (states are independent); to rounding
    # only, since a lone 1-token sequence takes the decode instantiation (another sum order)
    same = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for n in range(N):
        a, b = cu[n], cu[n + 1]
        on, hn = fused_recurrent_rwkv6(r[:, a:b], k[:, a:b], v[:, a:b], w[:, a:b], u,
                                       initial_state=h0[n:n + 1], output_final_state=True)
        torch.testing.assert_close(on, o[:, a:b], **same)
        torch.testing.assert_close(hn, ht[n:n + 1], **same)
    if cu == [0, 3, 3, 9]:  # the empty sequence passes its state through, both ways
        torch.testing.assert_close(ht[1], h0[1], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_int32_head_first(device, gen):
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    r, k, v, w, u, h0 = make(1, 12, 3, 16, 24, torch.float32, device, gen, N=2, head_first=True)
    run_and_check(r, k, v, w, u, h0, cu=cu, head_first=True, reverse=True, gen=gen)


# ---------------------------------------------------------------------------------------------
# Stress suite (docs/algorithms.md §8.4): no NaN/Inf, errors within §8.3 tolerances.

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("w_kind", STRESS)
def test_stress_gates(device, dtype, w_kind, gen):
    r, k, v, w, u, h0 = make(2, 70, 2, 64, 32, dtype, device, gen, w_kind=w_kind)
    run_and_check(r, k, v, w, u, h0, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("u_scale", [0.0, 30.0])
def test_stress_bonus(device, u_scale, gen):
    r, k, v, w, u, h0 = make(2, 40, 2, 32, 32, torch.float32, device, gen, u_scale=u_scale)
    run_and_check(r, k, v, w, u, h0, scale=0.7, gen=gen)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,w_kind", [(4096, "typical"), (8192, "typical"), (4096, "zero")])
def test_stress_long(device, T, w_kind, gen):
    r, k, v, w, u, h0 = make(1, T, 1, 64, 64, torch.float32, device, gen, w_kind=w_kind)
    run_and_check(r, k, v, w, u, h0, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("w_fill", [-1e4, -math.inf])
def test_analytic_hard_decay(device, w_fill, gen):
    """docs/algorithms.md §8.4 item 2: with exp(w) = 0 only the previous token and the bonus remain."""
    B, T, H, K, V = 2, 11, 2, 16, 8
    r, k, v, _, u, h0 = make(B, T, H, K, V, torch.float32, device, gen)
    w = torch.full_like(r, w_fill)
    s = K ** -0.5
    ins = [t.clone().requires_grad_(True) for t in (r, k, v, w, u, h0)]
    o, ht = fused_recurrent_rwkv6(*ins[:5], initial_state=ins[5], output_final_state=True)
    expect = torch.zeros_like(o)
    expect[:, 1:] = torch.einsum("bthk,bthk->bth", r[:, 1:], k[:, :-1])[..., None] * v[:, :-1]
    expect[:, 0] = torch.einsum("bhk,bhkv->bhv", r[:, 0], h0)
    expect += torch.einsum("bthk,hk,bthk->bth", r, u, k)[..., None] * v
    torch.testing.assert_close(o, s * expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, torch.einsum("bhk,bhv->bhkv", k[:, -1], v[:, -1]))
    do = torch.randn(o.shape, generator=gen).to(o)
    (o * do).sum().backward()
    torch.testing.assert_close(ins[5].grad, s * torch.einsum("bhk,bhv->bhkv", r[:, 0], do[:, 0]),
                               rtol=1e-5, atol=1e-6)
    assert torch.isfinite(ins[3].grad).all()
    assert ins[3].grad.abs().max() < 1e-5  # d/dw of exp(w) = 0 factors is 0


# ---------------------------------------------------------------------------------------------
# Exact fp64 path: gradcheck, and inputs left untouched

def test_gradcheck_fp64(gen):
    T, H, K, V = 7, 2, 3, 4
    r, k, v, w, u, h0 = make(1, T, H, K, V, torch.float64, "cpu", gen, N=2)
    cu = torch.tensor([0, 3, 7])
    ins = [t.clone().requires_grad_(True) for t in (r, k, v, w, u, h0)]

    def f(r, k, v, w, u, h0):
        o, ht = fused_recurrent_rwkv6(r, k, v, w, u, initial_state=h0, output_final_state=True,
                                      cu_seqlens=cu)
        return o, ht

    assert torch.autograd.gradcheck(f, ins, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_unchanged(device, gen):
    r, k, v, w, u, h0 = make(2, 19, 2, 16, 24, torch.bfloat16, device, gen, noncontig=True)
    ins = [t.clone().requires_grad_(True) for t in (r, k, v, w, u)] + [h0.clone().requires_grad_(True)]
    before = [t.detach().clone() for t in ins]
    o, ht = fused_recurrent_rwkv6(*ins[:5], initial_state=ins[5], output_final_state=True)
    (o.float().sum() + ht.sum()).backward()
    for name, a, b in zip(NAMES, ins, before):
        assert torch.equal(a.detach(), b), f"{name} was modified"


# ---------------------------------------------------------------------------------------------
# Decode: one token with a state. CUDA takes a dedicated one-step kernel when V % 4 == 0 and the
# states are row-contiguous; the other cases (and the backward's gate sweeps) take the engine.

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 1, 2, 128, 32), (2, 1, 2, 16, 100), (2, 1, 3, 64, 6),
                                   (1, 1, 1, 256, 256), (4, 1, 2, 5, 12)],
                         ids=lambda s: "B{}T{}H{}K{}V{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode(device, shape, dtype, gen):
    r, k, v, w, u, h0 = make(*shape, dtype, device, gen, w_kind="mixedinf")
    run_and_check(r, k, v, w, u, h0, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_strided_state(device, gen):
    B, H, K, V = 2, 2, 32, 16
    r, k, v, w, u, _ = make(B, 1, H, K, V, torch.float32, device, gen, h0=False)
    wide = torch.randn(B, H, K, 2 * V, generator=gen).to(device)
    h0 = wide[..., ::2]  # not row-contiguous: the decode kernel must decline it
    o, ht = fused_recurrent_rwkv6(r, k, v, w, u, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = reference.rwkv6(r, k, v, w, u, initial_state=h0)
    assert_close("o", o, o_ref, 1e-5, 1e-6)
    assert_close("ht", ht, ht_ref, 1e-5, 1e-6)
