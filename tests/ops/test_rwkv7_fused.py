"""fla::fused_recurrent_rwkv7 (DPLR), what the chunk mode has no counterpart for: fla's
defaults, fused_mul_recurrent_rwkv7, the one-token decode path. The checks both modes run are in
test_rwkv7.py. CPU and CUDA (the same tests, marked `cuda`)."""
import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES, assert_close
from inputs import make_diag
from fla_ext import fused_mul_recurrent_rwkv7, fused_recurrent_rwkv7, reference
from rwkv7_cases import FUSED, make, run_and_check


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
# Decode: one token with a state (CUDA: a dedicated kernel for row-contiguous states and V % 4 == 0).

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 1, 2, 128, 32), (2, 1, 2, 16, 100), (2, 1, 3, 64, 6),
                                   (1, 1, 1, 256, 256), (4, 1, 2, 5, 12), (2, 1, 2, 64, 64)],
                         ids=lambda s: "B{}T{}H{}K{}V{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode(device, shape, dtype, gen):
    ins = make(*shape, dtype, device, gen, w_kind="mixedinf")
    run_and_check(FUSED, *ins, scale=1.0, gen=gen)


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
