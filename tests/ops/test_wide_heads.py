"""Head dims above the kernels' 256 (fla runs GLA at 320 and 512): GLA (g, gv, both) and RWKV6,
chunk and fused_recurrent, K and V up to 512 and unequal, against the float64 oracle: output,
final state and every gradient, with an initial state, varlen and head_first (fla_ext/wide.py:
the op over key and value slices)."""
import zlib

import pytest
import torch

from conftest import DEVICES
from families import CHUNK_FAMILIES, FUSED_FAMILIES, on_devices, run_and_check

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
