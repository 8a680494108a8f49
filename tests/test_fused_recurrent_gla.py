"""fla::fused_recurrent_gla: forward and every gradient vs the float64 oracle, on CPU and CUDA."""
import itertools
import math

import pytest
import torch

from conftest import DEVICES, TOL, assert_close
from fla_ext import fused_recurrent_gla, reference
from inputs import STRESS, make_diag

NAMES = ["q", "k", "v", "g", "h0"]


def run_and_check(q, k, v, g, h0, *, dht_on=True, scale=None, reverse=False, cu=None,
                  head_first=False, gen=None):
    dtype = q.dtype
    tol, tol_dg, atol = TOL[dtype]
    ins = [None if t is None else t.detach().clone().requires_grad_(True) for t in (q, k, v, g, h0)]
    o, ht = fused_recurrent_gla(*ins[:3], gk=ins[3], scale=scale, initial_state=ins[4],
                                output_final_state=True, reverse=reverse, cu_seqlens=cu,
                                head_first=head_first)
    g_ref = g if g is not None else torch.zeros_like(q)
    o_ref, ht_ref = reference.gla(q, k, v, g_ref, scale=scale, initial_state=h0, reverse=reverse,
                                  cu_seqlens=cu, head_first=head_first)
    assert_close("o", o, o_ref, tol, atol)
    assert_close("ht", ht, ht_ref, tol, atol)
    do = torch.randn(o.shape, generator=gen).to(o)
    dht = torch.randn(ht.shape, generator=gen).to(ht) if dht_on else None
    ((o * do).sum() + ((ht * dht).sum() if dht_on else 0)).backward()
    grads = reference.gla_bwd(q, k, v, g_ref, do, dht, scale=scale, initial_state=h0,
                              reverse=reverse, cu_seqlens=cu, head_first=head_first)
    for name, x in zip(NAMES, ins):
        if x is None:
            continue
        assert x.grad is not None, f"no gradient for {name}"
        assert_close(f"d{name}", x.grad, grads[name], tol_dg if name == "g" else tol, atol)
    return o, ht


SHAPES = [(2, 37, 3, 16, 64), (2, 20, 2, 128, 32), (1, 1, 2, 64, 64), (2, 33, 2, 60, 100)]
FLAGS = list(itertools.product([False, True], repeat=3))  # (head_first, noncontig, reverse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}V{}".format(*s))
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "hf{}nc{}rev{}".format(*map(int, f)))
def test_grid(device, dtype, shape, flags, gen):
    head_first, noncontig, reverse = flags
    q, k, v, g, h0 = make_diag(*shape, dtype, device, gen, head_first=head_first,
                               noncontig=noncontig, h0=(shape[1] + int(reverse)) % 2 == 0 or head_first)
    run_and_check(q, k, v, g, h0, dht_on=not noncontig or reverse, reverse=reverse,
                  head_first=head_first, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 19, 2, 32, 16), (2, 1, 2, 64, 64)], ids=["T19", "T1"])
def test_no_decay(device, shape, gen):
    q, k, v, _, h0 = make_diag(*shape, torch.float32, device, gen)
    run_and_check(q, k, v, None, h0, gen=gen, scale=0.4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cu", [[0, 3, 3, 9], [0, 1, 17, 81, 145, 400, 1000]], ids=["empty", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_varlen(device, cu, dtype, gen):
    T, N = cu[-1], len(cu) - 1
    q, k, v, g, h0 = make_diag(1, T, 2, 32, 16, dtype, device, gen, N=N)
    cu_t = torch.tensor(cu, dtype=torch.long, device=device)
    o, ht = run_and_check(q, k, v, g, h0, cu=cu_t, gen=gen, reverse=True)
    same = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for n in range(N):
        a, b = cu[n], cu[n + 1]
        on, hn = fused_recurrent_gla(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b],
                                     initial_state=h0[n:n + 1], output_final_state=True, reverse=True)
        torch.testing.assert_close(on, o[:, a:b], **same)
        torch.testing.assert_close(hn, ht[n:n + 1], **same)
    if cu == [0, 3, 3, 9]:
        torch.testing.assert_close(ht[1], h0[1], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("w_kind", STRESS)
def test_stress_gates(device, dtype, w_kind, gen):
    q, k, v, g, h0 = make_diag(2, 70, 2, 64, 32, dtype, device, gen, w_kind=w_kind)
    run_and_check(q, k, v, g, h0, gen=gen)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,w_kind", [(4096, "typical"), (8192, "typical"), (4096, "zero")])
def test_stress_long(device, T, w_kind, gen):
    q, k, v, g, h0 = make_diag(1, T, 1, 64, 64, torch.float32, device, gen, w_kind=w_kind)
    run_and_check(q, k, v, g, h0, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("g_fill", [-1e4, -math.inf])
def test_analytic_hard_decay(device, g_fill, gen):
    """ALGORITHMS.md §8.4 item 2: o_t = s (q_t.k_t) v_t, hT = k_{T-1} v_{T-1}^T, dh0 = 0, dg = 0."""
    q, k, v, _, h0 = make_diag(2, 11, 2, 16, 8, torch.float32, device, gen)
    g = torch.full_like(q, g_fill)
    s = 16 ** -0.5
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, h0)]
    o, ht = fused_recurrent_gla(*ins[:3], gk=ins[3], initial_state=ins[4], output_final_state=True)
    torch.testing.assert_close(o, s * (q * k).sum(-1, keepdim=True) * v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, torch.einsum("bhk,bhv->bhkv", k[:, -1], v[:, -1]))
    (o.sum() + ht.sum()).backward()
    assert torch.equal(ins[4].grad, torch.zeros_like(h0))
    assert torch.equal(ins[3].grad, torch.zeros_like(g))  # d/dg of exp(g) = 0 factors, exactly


def test_gradcheck_fp64(gen):
    q, k, v, g, h0 = make_diag(1, 7, 2, 3, 4, torch.float64, "cpu", gen, N=2)
    cu = torch.tensor([0, 3, 7])
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, h0)]

    def f(q, k, v, g, h0):
        return fused_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True,
                                   cu_seqlens=cu, reverse=True)

    assert torch.autograd.gradcheck(f, ins, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_compile(device, gen):
    q, k, v, g, h0 = make_diag(2, 9, 2, 8, 16, torch.float32, device, gen)
    for t in (q, k, v, g, h0):
        t.requires_grad_(True)
    for args in [(q, k, v, g, None, h0, True, False, None, False),
                 (q, k, v, None, 0.5, None, False, True, None, False)]:
        torch.library.opcheck(torch.ops.fla.fused_recurrent_gla.default, args)
    do, dht = torch.randn_like(v).detach(), torch.randn_like(h0).detach()
    torch.library.opcheck(torch.ops.fla.fused_recurrent_gla_bwd.default,
                          tuple(t.detach() if isinstance(t, torch.Tensor) else t
                                for t in (q, k, v, g, do, dht, None, h0, False, None, False)))
    torch._dynamo.reset()

    def f(q, k, v, g, h0):
        o, ht = fused_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
        return (o * o).sum() + ht.square().sum()

    cf = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    ins = [q, k, v, g, h0]
    for a, b in zip(torch.autograd.grad(cf(*ins), ins), torch.autograd.grad(f(*ins), ins)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 1, 2, 128, 32), (2, 1, 3, 64, 6)], ids=["vec", "fallback"])
def test_decode(device, shape, gen):
    q, k, v, g, h0 = make_diag(*shape, torch.float32, device, gen, w_kind="mixedinf")
    run_and_check(q, k, v, g, h0, gen=gen)


def test_errors_and_inputs_unchanged(gen):
    q, k, v, g, h0 = make_diag(2, 5, 2, 4, 6, torch.float32, "cpu", gen)
    with pytest.raises(NotImplementedError, match="value-side decay `gv`"):
        fused_recurrent_gla(q, k, v, g, gv=torch.zeros_like(v))
    with pytest.raises(ValueError, match=r"`gk` must have the shape of `q`"):
        fused_recurrent_gla(q, k, v, g[..., :3])
    with pytest.raises(ValueError, match=r"K \(last dim of q, k, gk\) must be in \[1, 256\]"):
        big = torch.randn(1, 2, 1, 300)
        fused_recurrent_gla(big, big, torch.randn(1, 2, 1, 4), -big.abs())
    with pytest.raises(TypeError, match="`q` must be a torch.Tensor"):
        fused_recurrent_gla(None, k, v, g)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, h0)]
    before = [t.detach().clone() for t in ins]
    o, ht = fused_recurrent_gla(*ins[:4], initial_state=ins[4], output_final_state=True)
    (o.sum() + ht.sum()).backward()
    for a, b in zip(ins, before):
        assert torch.equal(a.detach(), b)
