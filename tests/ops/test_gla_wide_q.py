"""GLA's wide q (GSA's passes): a float32 q with bf16 / fp16 k, v and decays. The kernels run in
k's dtype with q (and, in the backward, grad_o) rounded to it; o and dq come out in float32,
written from the fp32 accumulators, not rounded to k's dtype on the way."""
import pytest
import torch
import torch.nn.functional as F

import fla_ext
from conftest import DEVICES, TOL, assert_close
from fla_ext import reference

MODES = {"chunk": lambda q, k, v, g, gv, **kw: fla_ext.chunk_gla(q, k, v, g=g, gv=gv, **kw),
         "fused": lambda q, k, v, g, gv, **kw: fla_ext.fused_recurrent_gla(q, k, v, gk=g, gv=gv, **kw)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("side", ["g", "gv"])
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("T", [100, 1], ids=["T100", "decode"])
def test_wide_q(device, mode, side, low, T, gen):
    B, H, K, V = 2, 2, 32, 48
    r = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    q = r(B, T, H, K)  # full fp32 mantissas: rounding q to `low` changes it
    k, v = r(B, T, H, K).to(low), r(B, T, H, V).to(low)
    dec = F.logsigmoid(r(B, T, H, K if side == "g" else V)).to(low)
    h0 = r(B, H, K, V)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, dec, h0)]
    gates = dict(g=ins[3] if side == "g" else None, gv=ins[3] if side == "gv" else None)
    o, ht = MODES[mode](*ins[:3], **gates, scale=0.3, initial_state=ins[4], output_final_state=True)
    assert o.dtype == torch.float32 and ht.dtype == torch.float32
    kw = dict(scale=0.3, initial_state=h0, gv=dec if side == "gv" else None)
    g_ref = dec if side == "g" else None
    qr = q.to(low)  # what the kernels read
    o_ref, ht_ref = reference.gla(qr, k, v, g_ref, **kw)
    tol, tol_dg, atol = TOL[low]
    assert_close("o", o, o_ref, tol, atol)
    assert_close("ht", ht, ht_ref, tol, atol)
    do, dht = r(B, T, H, V), r(B, H, K, V)
    ((o * do).sum() + (ht * dht).sum()).backward()
    grads = reference.gla_bwd(qr, k, v, g_ref, do.to(low), dht, **kw)
    assert ins[0].grad.dtype == torch.float32
    for name, x in zip(["q", "k", "v", side, "h0"], ins):
        assert_close(f"d{name}", x.grad, grads[name], tol_dg if name == side else tol, atol)


@pytest.mark.parametrize("device", DEVICES)
def test_wide_q_is_gla_only(device, gen):
    """RWKV6 keeps one dtype for every activation; GLA refuses a narrow q with wider k."""
    r = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    q, k, v = r(1, 8, 2, 4), r(1, 8, 2, 4).bfloat16(), r(1, 8, 2, 4).bfloat16()
    w = F.logsigmoid(r(1, 8, 2, 4)).bfloat16()
    with pytest.raises(ValueError, match="`k` has dtype BFloat16 but `r` has dtype Float"):
        fla_ext.chunk_rwkv6(q, k, v, w, r(2, 4).bfloat16())
    with pytest.raises(ValueError, match="`k` has dtype Float but `q` has dtype BFloat16"):
        fla_ext.chunk_gla(q.bfloat16(), k.float(), v.float(), w.float())
    with pytest.raises(ValueError, match="`v` has dtype Float but `k` has dtype BFloat16"):
        fla_ext.chunk_gla(q, k, v.float(), w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["chunk_gla", "fused_recurrent_gla"])
def test_wide_q_opcheck(device, op, gen):
    """The fake kernels give a wide q's o (and dq) float32."""
    r = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    q, k, v = r(1, 20, 2, 8), r(1, 20, 2, 8).bfloat16(), r(1, 20, 2, 16).bfloat16()
    g = F.logsigmoid(r(1, 20, 2, 8)).bfloat16()
    torch.library.opcheck(getattr(torch.ops.fla, op).default, (q, k, v, g))

