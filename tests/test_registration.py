"""The ops are real dispatcher ops: opcheck, fake kernels, torch.compile, CUDA graphs."""
import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES
from fla_ext import fused_recurrent_rwkv6


def samples(device, dtype=torch.float32, requires_grad=True):
    g = torch.Generator().manual_seed(7)
    out = []
    for (B, T, H, K, V, hf, h0, fin, cu) in [(2, 9, 2, 8, 16, False, True, True, None),
                                            (1, 12, 2, 16, 8, True, False, False, [0, 5, 12]),
                                            (2, 1, 1, 4, 4, False, False, True, None)]:
        shp = lambda D: (B, H, T, D) if hf else (B, T, H, D)  # noqa: E731
        mk = lambda D: torch.randn(shp(D), generator=g).to(device, dtype)  # noqa: E731
        r, k, v = mk(K), mk(K), mk(V)
        w = F.logsigmoid(mk(K).float()).to(dtype)
        u = torch.randn(H, K, generator=g).to(device, dtype)
        N = len(cu) - 1 if cu else B
        s0 = torch.randn(N, H, K, V, generator=g).to(device) if h0 else None
        ts = [r, k, v, w, u] + ([s0] if h0 else [])
        if requires_grad:
            for t in ts:
                t.requires_grad_(True)
        cu_t = torch.tensor(cu, device=device) if cu else None
        out.append((r, k, v, w, u, None, s0, fin, False, cu_t, hf))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_forward(device):
    for args in samples(device):
        torch.library.opcheck(torch.ops.fla.fused_recurrent_rwkv6.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_backward(device):
    for (r, k, v, w, u, scale, s0, fin, rev, cu, hf) in samples(device, requires_grad=False):
        do = torch.randn_like(v)
        N, H, K, V = (s0.shape if s0 is not None else (cu.numel() - 1 if cu is not None else r.shape[0],
                                                        u.shape[0], r.shape[-1], v.shape[-1]))
        dht = torch.randn(N, H, K, V, device=device) if fin else None
        torch.library.opcheck(torch.ops.fla.fused_recurrent_rwkv6_bwd.default,
                              (r, k, v, w, u, do, dht, 0.5, s0, rev, cu, hf))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_fwd_bwd(device):
    torch._dynamo.reset()
    r, k, v, w, u, _, s0, _, _, _, _ = samples(device)[0]

    def f(r, k, v, w, u, s0):
        o, ht = fused_recurrent_rwkv6(r, k, v, w, u, initial_state=s0, output_final_state=True)
        return (o * o).sum() + ht.square().sum()

    cf = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    ins = [r, k, v, w, u, s0]
    loss_c = cf(*ins)
    g_c = torch.autograd.grad(loss_c, ins)
    loss_e = f(*ins)
    g_e = torch.autograd.grad(loss_e, ins)
    torch.testing.assert_close(loss_c, loss_e)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_graph_capture():
    r, k, v, w, u, _, s0, _, _, _, _ = samples("cuda", requires_grad=False)[0]
    do = torch.randn_like(v)
    static = dict(o=None, dr=None)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture
        fused_recurrent_rwkv6(r, k, v, w, u, initial_state=s0, output_final_state=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static["o"], static["ht"] = fused_recurrent_rwkv6(r, k, v, w, u, initial_state=s0,
                                                          output_final_state=True)
        static["grads"] = torch.ops.fla.fused_recurrent_rwkv6_bwd(r, k, v, w, u, do, None, None, s0,
                                                                  False, None, False)
    for _ in range(2):
        r.copy_(torch.randn_like(r))  # new inputs in the captured buffers
        graph.replay()
        torch.cuda.synchronize()
        o, ht = fused_recurrent_rwkv6(r, k, v, w, u, initial_state=s0, output_final_state=True)
        grads = torch.ops.fla.fused_recurrent_rwkv6_bwd(r, k, v, w, u, do, None, None, s0, False,
                                                        None, False)
        torch.testing.assert_close(static["o"], o, rtol=0, atol=0)
        torch.testing.assert_close(static["ht"], ht, rtol=0, atol=0)
        for a, b in zip(static["grads"], grads):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
