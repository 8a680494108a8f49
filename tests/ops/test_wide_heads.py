"""Head dims above the kernels' 256 (fla runs GLA at 320 and 512): GLA (g, gv, both), RWKV6 and
GSA (K, V and the slots M), chunk and fused_recurrent, up to 512 and unequal, against the
float64 oracle: output, final states and every gradient, with initial states, varlen, head_first,
grouped heads, GSA's g=None and reverse, the hard decay regimes, inputs left unchanged
(fla_ext/wide.py: the op over key and value slices;
GSA as its two GLA passes, fla_ext/gsa_passes.py)."""
import os
import sys
import zlib

import pytest
import torch

from conftest import DEVICES
from families import CHUNK_FAMILIES, FUSED_FAMILIES, on_devices, run_and_check

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # test_gsa's make and oracle

import fla_ext

SHAPES = [(320, 512), (512, 288), (300, 64)]


def _cases(families, mode):
    return [pytest.param(*p.values, mode, KV, id=f"{p.id}-{mode}-{KV[0]}x{KV[1]}", marks=p.marks)
            for mode_families in [families] for p in on_devices(DEVICES, mode_families) for KV in SHAPES]


@pytest.mark.parametrize("device, fam, mode, KV", _cases(CHUNK_FAMILIES, "chunk") + _cases(FUSED_FAMILIES, "fused"))
def test_wide_heads_against_the_oracle(device, fam, mode, KV):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((fam.name, mode, KV)).encode()))
    K, V = KV
    x = fam.make(1, 21, 2, K, V, torch.float32, device, gen, h0=True)
    run_and_check(fam, mode, x, gen=gen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("device, fam, mode, KV", [c for c in _cases(CHUNK_FAMILIES[:2], "chunk") + _cases(FUSED_FAMILIES[:2], "fused")
                                                    if c.values[3] == SHAPES[0]])
def test_wide_heads_16_bit(device, fam, mode, KV, dtype):
    """bf16 and fp16 at head dims above 256, at the 16-bit tolerances (the key slices' float32
    partial outputs are summed before the one rounding to the output dtype)."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((fam.name, mode, KV, str(dtype))).encode()))
    x = fam.make(1, 21, 2, *KV, dtype, device, gen, h0=True)
    run_and_check(fam, mode, x, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_wide_gsa_16_bit(device, dtype):
    import test_gsa
    gen = torch.Generator().manual_seed(11)
    x = test_gsa.make(*GSA_SHAPES[0], dtype, device, gen, g_kind="typical")
    test_gsa.run_and_check("chunk", x, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
def test_wide_heads_varlen_and_head_first(device):
    from families import GLA, RWKV6
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 7, 7, 30], device=device)
    for fam in (GLA, RWKV6):
        x = fam.make(1, 30, 2, 300, 260, torch.float32, device, gen, h0=True, N=3)
        run_and_check(fam, "chunk", x, gen=gen, cu_seqlens=cu)
        x = fam.make(2, 19, 2, 260, 300, torch.float32, device, gen, h0=True, head_first=True)
        run_and_check(fam, "fused", x, gen=gen, head_first=True)


def test_wide_heads_errors_name_the_argument():
    q = torch.randn(1, 8, 1, 320)
    v = torch.randn(1, 8, 1, 64)
    g = torch.nn.functional.logsigmoid(torch.randn(1, 8, 1, 320))
    with pytest.raises(ValueError, match=r"K \(last dim of q, k, g\) must agree: `q` has 320, `k` has 300"):
        fla_ext.chunk_gla(q, torch.randn(1, 8, 1, 300), v, g)
    with pytest.raises(ValueError, match=r"K \(last dim of q, k, g\) must be in \[1, 512\], got 520"):
        fla_ext.chunk_gla(torch.randn(1, 8, 1, 520), torch.randn(1, 8, 1, 520), v,
                          torch.randn(1, 8, 1, 520).clamp(max=0))
    with pytest.raises(ValueError, match=r"`initial_state` must end in \[K, V\] = \[320, 64\]"):
        fla_ext.fused_recurrent_gla(q, q, v, g, initial_state=torch.zeros(1, 1, 64, 320))


# GSA above 256 runs as its two GLA passes, each as slices: K, V and the slot count M.
GSA_SHAPES = [(1, 17, 2, 1, 320, 64, 300), (2, 9, 2, 2, 48, 288, 16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["chunk", "fused"])
@pytest.mark.parametrize("shape", GSA_SHAPES, ids=lambda s: "B{}T{}HQ{}H{}K{}V{}M{}".format(*s))
@pytest.mark.parametrize("with_g", [True, False], ids=["g", "gNone"])
def test_wide_gsa_against_the_oracle(device, mode, shape, with_g):
    import test_gsa
    gen = torch.Generator().manual_seed(zlib.crc32(repr((mode, shape, with_g)).encode()))
    x = test_gsa.make(*shape, torch.float32, device, gen, g_kind="typical" if with_g else None)
    test_gsa.run_and_check(mode, x, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
def test_wide_gsa_varlen_head_first_reverse(device):
    import test_gsa
    gen = torch.Generator().manual_seed(11)
    cu = [0, 5, 5, 23]
    x = test_gsa.make(1, 23, 2, 1, 16, 24, 260, torch.float32, device, gen, N=3, g_kind=None)
    test_gsa.run_and_check("chunk", x, gen=gen, cu_seqlens=torch.tensor(cu, device=device))
    x = test_gsa.make(2, 11, 2, 2, 270, 16, 8, torch.float32, device, gen, head_first=True)
    test_gsa.run_and_check("fused", x, gen=gen, head_first=True)
    x = test_gsa.make(1, 13, 2, 1, 16, 16, 290, torch.float32, device, gen)
    test_gsa.run_and_check("fused", x, gen=gen, reverse=True)


def test_wide_gsa_errors_name_the_argument():
    q, k = torch.randn(1, 6, 2, 300), torch.randn(1, 6, 1, 300)
    v, s = torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8)
    with pytest.raises(ValueError, match=r"`g` must have the shape of `s`"):
        fla_ext.chunk_gsa(q, k, v, s, -torch.rand(1, 6, 1, 9))
    with pytest.raises(ValueError, match=r"`initial_state\[1\]` must be \[N, 1, 8, 8\]"):
        fla_ext.chunk_gsa(q, k, v, s, initial_state=(torch.zeros(1, 1, 300, 8), torch.zeros(1, 1, 8, 9)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("w_kind", ["mixedinf", "u30", "zero"])
def test_wide_heads_stress_decays(device, w_kind):
    """The §8.4 hard regimes through the slices: -inf resets among small decays, decays to -30,
    none at all."""
    from families import GLA, RWKV6
    gen = torch.Generator().manual_seed(zlib.crc32(w_kind.encode()))
    for fam in (GLA, RWKV6):
        for mode in ("chunk", "fused"):
            x = fam.make(1, 40, 1, 300, 260, torch.float32, device, gen, h0=True, w_kind=w_kind)
            run_and_check(fam, mode, x, gen=gen)


def test_wide_heads_leave_inputs_unchanged():
    from families import GLA, RWKV6
    import test_gsa
    gen = torch.Generator().manual_seed(2)
    for fam in (GLA, RWKV6):
        x = fam.make(1, 9, 1, 300, 270, torch.float32, "cpu", gen, h0=True)
        before = {n: t.clone() for n, t in x.items() if t is not None}
        fam.call("chunk", x, output_final_state=True)
        assert all(torch.equal(x[n], t) for n, t in before.items())
    x = test_gsa.make(1, 9, 2, 1, 16, 16, 280, torch.float32, "cpu", gen, g_kind=None)
    before = {n: t.clone() for n, t in x.items() if t is not None}
    test_gsa.call("chunk", x, output_final_state=True)
    assert all(torch.equal(x[n], t) for n, t in before.items())
