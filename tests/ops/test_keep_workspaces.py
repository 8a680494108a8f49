"""fla_ext.keep_workspaces(False): the chunk ops' training forwards keep only their inputs and the
backward makes the chunk-start states and workspaces again; outputs and every gradient equal the
default's (the same kernels build the same workspaces), and on CUDA less memory is held between
forward and backward."""
import os

import pytest
import torch

import fla_ext
import rwkv7_cases
from conftest import DEVICES, HAS_CUDA
from inputs import make_diag


def _gsa(q, k, v, s, g, h0):
    return fla_ext.chunk_gsa(q, k, v, s, g, output_final_state=True)


def _cases(device, gen):
    B, T, H, K, V = 2, 53, 2, 32, 24  # a partial last chunk
    q, k, v, g, h0 = make_diag(B, T, H, K, V, torch.float32, device, gen)
    r7, w7, k7, v7, a7, b7, h7 = rwkv7_cases.make(B, T, H, K, V, torch.float32, device, gen)
    u = torch.randn(H, K, generator=gen).to(device)
    s = torch.randn(B, T, H, 16, generator=gen).to(device)
    gs = torch.nn.functional.logsigmoid(torch.randn(B, T, H, 16, generator=gen)).to(device)
    return {
        "chunk_gla": (lambda *x: fla_ext.chunk_gla(*x[:4], initial_state=x[4], output_final_state=True),
                      (q, k, v, g, h0)),
        "chunk_rwkv6": (lambda *x: fla_ext.chunk_rwkv6(*x[:5], initial_state=x[5], output_final_state=True),
                        (q, k, v, g, u, h0)),
        "chunk_rwkv7": (lambda *x: fla_ext.chunk_rwkv7(*x[:6], initial_state=x[6], output_final_state=True),
                        (r7, w7, k7, v7, a7, b7, h7)),
        "chunk_gsa": (_gsa, (q, k, v, s, gs, None)),
    }


def _run(f, ins, keep):
    xs = [None if t is None else t.detach().clone().requires_grad_(True) for t in ins]
    with fla_ext.keep_workspaces(keep):
        outs = [o for o in f(*xs) if o is not None]
    outs = [t for o in outs for t in (o if isinstance(o, (tuple, list)) else (o,))]  # GSA: [hk, hv]
    gen = torch.Generator().manual_seed(7)
    loss = sum((o * torch.randn(o.shape, generator=gen).to(o)).sum() for o in outs)
    loss.backward()
    return outs, [t.grad for t in xs if t is not None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["chunk_gla", "chunk_rwkv6", "chunk_rwkv7", "chunk_gsa"])
def test_recomputed_workspaces_give_the_same_results(device, op):
    f, ins = _cases(device, torch.Generator().manual_seed(3))[op]
    kept_out, kept_grads = _run(f, ins, True)
    out, grads = _run(f, ins, False)
    for x, y in zip(out + grads, kept_out + kept_grads):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_less_memory_held_between_forward_and_backward():
    gen = torch.Generator().manual_seed(5)
    r, w, k, v, a, b, _ = rwkv7_cases.make(1, 4096, 4, 64, 64, torch.bfloat16, "cuda", gen)
    ins = [t.requires_grad_(True) for t in (r, w, k, v, a, b)]
    held = {}
    for keep in (True, False):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with fla_ext.keep_workspaces(keep):
            o, _ = fla_ext.chunk_rwkv7(*ins)
        torch.cuda.synchronize()
        held[keep] = torch.cuda.memory_allocated() - before - o.numel() * o.element_size()
        o.sum().backward()
        del o
    assert held[False] == 0 and held[True] >= 4 * 256 * 64 * 64 * 4  # at least the chunk states


def test_setting_is_scoped_and_checked(monkeypatch):
    monkeypatch.delenv("FLA_EXT_KEEP_WORKSPACES", raising=False)
    with fla_ext.keep_workspaces(False):
        assert os.environ["FLA_EXT_KEEP_WORKSPACES"] == "0"
        with fla_ext.keep_workspaces(True):
            assert os.environ["FLA_EXT_KEEP_WORKSPACES"] == "1"
        assert os.environ["FLA_EXT_KEEP_WORKSPACES"] == "0"
    assert "FLA_EXT_KEEP_WORKSPACES" not in os.environ
    with pytest.raises(TypeError, match="keep_workspaces"):
        with fla_ext.keep_workspaces(0):
            pass
    monkeypatch.setenv("FLA_EXT_KEEP_WORKSPACES", "maybe")
    q = torch.randn(1, 4, 1, 8, requires_grad=True)
    with pytest.raises(ValueError, match="FLA_EXT_KEEP_WORKSPACES"):
        fla_ext.chunk_gla(q, q, q, -torch.ones(1, 4, 1, 8))


@pytest.mark.parametrize("value,keeps", [("0", False), ("false", False), ("OFF", False), ("no", False),
                                         ("1", True), ("true", True), ("On", True), ("yes", True),
                                         ("", True), (None, True)])
def test_python_reads_the_setting_as_the_ops(value, keeps, monkeypatch):
    """The layers' lean forms follow memory.keeps_workspaces; it must read FLA_EXT_KEEP_WORKSPACES
    as the ops do (csrc/ops/common.cpp), or a layer and its op would disagree on `false`."""
    from fla_ext.memory import keeps_workspaces
    if value is None:
        monkeypatch.delenv("FLA_EXT_KEEP_WORKSPACES", raising=False)
    else:
        monkeypatch.setenv("FLA_EXT_KEEP_WORKSPACES", value)
    assert keeps_workspaces() is keeps
    q = torch.randn(1, 4, 1, 8, requires_grad=True)
    fla_ext.chunk_gla(q, q, q, -torch.ones(1, 4, 1, 8))  # the op accepts the same value
    monkeypatch.setenv("FLA_EXT_KEEP_WORKSPACES", "maybe")
    with pytest.raises(ValueError, match="FLA_EXT_KEEP_WORKSPACES"):
        keeps_workspaces()
