"""The ops are real dispatcher ops: opcheck, fake kernels, torch.compile, CUDA graphs."""
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import fla_ext
from conftest import DEVICES, assert_compiles_same


@dataclass(frozen=True)
class Sample:
    q: torch.Tensor  # r for RWKV6
    k: torch.Tensor
    v: torch.Tensor
    w: torch.Tensor  # g for GLA
    u: torch.Tensor
    s0: object       # initial state or None
    fin: bool        # output_final_state
    cu: object       # cu_seqlens or None
    hf: bool         # head_first
    wv: object = None  # a value-side log decay [.., V] (chunk_gla's gv)

    def grads_in(self):
        N = self.cu.numel() - 1 if self.cu is not None else self.q.shape[0]
        shape = (N, *self.u.shape, self.v.shape[-1])  # [N, H, K, V]
        dht = torch.randn(shape, device=self.v.device) if self.fin else None
        return torch.randn_like(self.v), dht

    def inputs(self):
        return [self.q, self.k, self.v, self.w, self.u, self.s0, self.wv]


@dataclass(frozen=True)
class Op:
    """An op family's forward and backward ops, their schema arguments built from a Sample, and
    the Python entry point (always returning the final state)."""
    fwd: Callable
    bwd: Callable
    fwd_args: Callable   # Sample -> tuple
    bwd_args: Callable   # Sample, do, dht -> tuple
    call: Callable       # (q, k, v, w, u, s0, wv) -> (o, ht)
    wrt: tuple = (0, 1, 2, 3, 5)  # the differentiable inputs it reads (indices into inputs())
    cuda: bool = True


OPS = {
    "fused_recurrent_rwkv6": Op(
        torch.ops.fla.fused_recurrent_rwkv6.default,
        torch.ops.fla.fused_recurrent_rwkv6_bwd.default,
        lambda s: (s.q, s.k, s.v, s.w, s.u, None, s.s0, s.fin, False, s.cu, s.hf),
        lambda s, do, dht: (s.q, s.k, s.v, s.w, s.u, do, dht, 0.5, s.s0, False, s.cu, s.hf),
        lambda q, k, v, w, u, s0, wv: fla_ext.fused_recurrent_rwkv6(q, k, v, w, u, initial_state=s0,
                                                                output_final_state=True),
        wrt=(0, 1, 2, 3, 4, 5)),
    "chunk_rwkv6": Op(
        torch.ops.fla.chunk_rwkv6.default, torch.ops.fla.chunk_rwkv6_bwd.default,
        lambda s: (s.q, s.k, s.v, s.w, s.u, None, s.s0, s.fin, s.cu, s.hf),
        lambda s, do, dht: (s.q, s.k, s.v, s.w, s.u, do, dht, 0.5, s.s0, s.cu, s.hf),
        lambda q, k, v, w, u, s0, wv: fla_ext.chunk_rwkv6(q, k, v, w, u, initial_state=s0,
                                                      output_final_state=True),
        wrt=(0, 1, 2, 3, 4, 5)),
    "fused_recurrent_gla": Op(  # both decays: gk = w, gv = wv
        torch.ops.fla.fused_recurrent_gla.default,
        torch.ops.fla.fused_recurrent_gla_bwd.default,
        lambda s: (s.q, s.k, s.v, s.w, s.wv, None, s.s0, s.fin, False, s.cu, s.hf),
        lambda s, do, dht: (s.q, s.k, s.v, s.w, s.wv, do, dht, 0.5, s.s0, False, s.cu, s.hf),
        lambda q, k, v, w, u, s0, wv: fla_ext.fused_recurrent_gla(
            q, k, v, w, wv, initial_state=s0, output_final_state=True),
        wrt=(0, 1, 2, 3, 5, 6)),
    "chunk_gla": Op(
        torch.ops.fla.chunk_gla.default, torch.ops.fla.chunk_gla_bwd.default,
        lambda s: (s.q, s.k, s.v, s.w, None, None, s.s0, s.fin, s.cu, s.hf),
        lambda s, do, dht: (s.q, s.k, s.v, s.w, None, do, dht, 0.5, s.s0, s.cu, s.hf),
        lambda q, k, v, w, u, s0, wv: fla_ext.chunk_gla(q, k, v, w, initial_state=s0,
                                                        output_final_state=True)),
    # the value-side decay alone (GSA pass 1), and with the key-side one (CPU only)
    "chunk_gla_gv": Op(
        torch.ops.fla.chunk_gla.default, torch.ops.fla.chunk_gla_bwd.default,
        lambda s: (s.q, s.k, s.v, None, s.wv, None, s.s0, s.fin, s.cu, s.hf),
        lambda s, do, dht: (s.q, s.k, s.v, None, s.wv, do, dht, 0.5, s.s0, s.cu, s.hf),
        lambda q, k, v, w, u, s0, wv: fla_ext.chunk_gla(q, k, v, gv=wv, initial_state=s0,
                                                        output_final_state=True),
        wrt=(0, 1, 2, 5, 6)),
    "chunk_gla_kv": Op(
        torch.ops.fla.chunk_gla.default, torch.ops.fla.chunk_gla_bwd.default,
        lambda s: (s.q, s.k, s.v, s.w, s.wv, None, s.s0, s.fin, s.cu, s.hf),
        lambda s, do, dht: (s.q, s.k, s.v, s.w, s.wv, do, dht, 0.5, s.s0, s.cu, s.hf),
        lambda q, k, v, w, u, s0, wv: fla_ext.chunk_gla(q, k, v, w, gv=wv, initial_state=s0,
                                                        output_final_state=True),
        wrt=(0, 1, 2, 3, 5, 6), cuda=False),
}
OP_NAMES = list(OPS)
# (device, op name) for every op a backend implements
DEVICE_OPS = [pytest.param(d.values[0], n, id=f"{d.id}-{n}", marks=d.marks)
              for d in DEVICES for n in OP_NAMES if d.values[0] == "cpu" or OPS[n].cuda]


def samples(device, dtype=torch.float32, requires_grad=True):
    g = torch.Generator().manual_seed(7)
    out = []
    # T = 70 crosses a chunk boundary; the varlen sample has a sequence over one (5 + 67 rows).
    for (B, T, H, K, V, hf, h0, fin, cu) in [(2, 9, 2, 8, 16, False, True, True, None),
                                            (1, 72, 2, 16, 8, True, False, False, [0, 5, 72]),
                                            (2, 1, 1, 4, 4, False, False, True, None),
                                            (1, 70, 1, 8, 4, False, True, True, None)]:
        shp = lambda D: (B, H, T, D) if hf else (B, T, H, D)  # noqa: E731
        mk = lambda D: torch.randn(shp(D), generator=g).to(device, dtype)  # noqa: E731
        r, k, v = mk(K), mk(K), mk(V)
        w = F.logsigmoid(mk(K).float()).to(dtype)
        u = torch.randn(H, K, generator=g).to(device, dtype)
        N = len(cu) - 1 if cu else B
        s0 = torch.randn(N, H, K, V, generator=g).to(device) if h0 else None
        if requires_grad:
            for t in [r, k, v, w, u] + ([s0] if h0 else []):
                t.requires_grad_(True)
        cu_t = torch.tensor(cu, device=device) if cu else None
        wv = F.logsigmoid(mk(V).float()).to(dtype)
        if requires_grad:
            wv.requires_grad_(True)
        out.append(Sample(r, k, v, w, u, s0, fin, cu_t, hf, wv))
    return out


@pytest.mark.parametrize("device,name", DEVICE_OPS)
def test_opcheck_forward(device, name):
    for s in samples(device):
        torch.library.opcheck(OPS[name].fwd, OPS[name].fwd_args(s))


@pytest.mark.parametrize("device,name", DEVICE_OPS)
def test_opcheck_backward(device, name):
    for s in samples(device, requires_grad=False):
        torch.library.opcheck(OPS[name].bwd, OPS[name].bwd_args(s, *s.grads_in()))


@pytest.mark.parametrize("device,name", DEVICE_OPS)
def test_compile_fullgraph_fwd_bwd(device, name):
    op = OPS[name]
    ins = samples(device)[0].inputs()

    def f(*ts):
        o, ht = op.call(*ts)
        return (o * o).sum() + ht.square().sum()

    assert_compiles_same(f, ins, [ins[i] for i in op.wrt], device)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", [n for n in OP_NAMES if OPS[n].cuda])
def test_cuda_graph_capture(name):
    op = OPS[name]
    s = samples("cuda", requires_grad=False)[0]
    do, dht = s.grads_in()
    bwd_args = op.bwd_args(s, do, None)
    static = {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture
        op.call(*s.inputs())
        op.bwd(*bwd_args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static["o"], static["ht"] = op.call(*s.inputs())
        static["grads"] = op.bwd(*bwd_args)
    for _ in range(2):
        s.q.copy_(torch.randn_like(s.q))  # new inputs in the captured buffers
        graph.replay()
        torch.cuda.synchronize()
        o, ht = op.call(*s.inputs())
        grads = op.bwd(*bwd_args)
        torch.testing.assert_close(static["o"], o, rtol=0, atol=0)
        torch.testing.assert_close(static["ht"], ht, rtol=0, atol=0)
        for a, b in zip(static["grads"], grads):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


# The training forwards (chunk_*_train): their workspaces make the backward skip recomputation
# on CUDA; the results must not change, and a wrong workspace handed to _bwd must be refused.
TRAIN = {"chunk_rwkv6": torch.ops.fla.chunk_rwkv6_train.default,
         "chunk_gla": torch.ops.fla.chunk_gla_train.default}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(TRAIN))
def test_train_forward_keeps_workspaces(device, name):
    op = OPS[name]
    for s in samples(device, requires_grad=False):
        torch.library.opcheck(TRAIN[name], op.fwd_args(s))
        o, ht, hst, amat = TRAIN[name](*op.fwd_args(s))
        o_ref, ht_ref = op.fwd(*op.fwd_args(s))
        torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
        torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)
        assert (hst.numel() > 0) == (device == "cuda") and (amat.numel() > 0) == (device == "cuda")
        do, dht = s.grads_in()
        args = op.bwd_args(s, do, dht)
        torch.library.opcheck(op.bwd, args + (hst, amat))
        kept = op.bwd(*args, hst, amat)
        fresh = op.bwd(*args)
        if device == "cuda":  # a kept hst without its A (or the reverse) is refused
            with pytest.raises(ValueError, match="come together"):
                op.bwd(*args, hst, None)
            with pytest.raises(ValueError, match="come together"):
                op.bwd(*args, None, amat)
        for a, b in zip(kept, fresh):  # same kernels, same arithmetic: bitwise equal
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_value_side_train_keeps_states(dtype):
    # The value-side decay alone (GSA pass 1) keeps its chunk-start states and no pair matrices
    # (its backward's are of dO): the backward that reads them equals the one that rebuilds them.
    gen = torch.Generator(device="cuda").manual_seed(5)
    B, T, H, K, V = 2, 150, 2, 32, 48
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q, k, v = (r(B, T, H, D).to(dtype) for D in (K, K, V))
    gv = torch.nn.functional.logsigmoid(r(B, T, H, V)).to(dtype)
    h0 = r(B, H, K, V)
    fargs = (q, k, v, None, gv, 0.5, h0, True, None, False)
    o, ht, hst, amat = torch.ops.fla.chunk_gla_train(*fargs)
    o_ref, ht_ref = torch.ops.fla.chunk_gla(*fargs)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)
    assert hst.numel() > 0 and amat.numel() == 0
    bargs = (q, k, v, None, gv, r(B, T, H, V).to(dtype), r(B, H, K, V), 0.5, h0, None, False)
    kept = torch.ops.fla.chunk_gla_bwd(*bargs, hst, amat)
    fresh = torch.ops.fla.chunk_gla_bwd(*bargs, None, None)
    for a, b in zip(kept, fresh):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(TRAIN))
def test_backward_refuses_a_wrong_workspace(device, name):
    op = OPS[name]
    s = samples(device, requires_grad=False)[0]
    args = op.bwd_args(s, *s.grads_in())
    bad = torch.zeros(3, 2, 2, 2, device=device)
    with pytest.raises(ValueError, match="`hst` must be the"):
        op.bwd(*args, bad, None)
    with pytest.raises(ValueError, match="`amat` must be the"):
        op.bwd(*args, None, bad)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_workspaces_kept_only_when_recording():
    # A graph-recording call keeps hst and amat alive until backward; an inference (no_grad)
    # call goes to the plain forward and holds nothing beyond its outputs.
    s = samples("cuda")[0]
    N, H, K, V = s.s0.shape
    amat_bytes = N * 2 * H * 64 * 64 * 4  # 2 slots per sequence at T = 9

    def held(grad):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.set_grad_enabled(grad):
            out = fla_ext.chunk_rwkv6(s.q, s.k, s.v, s.w, s.u, initial_state=s.s0,
                                      output_final_state=True)
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before, out

    inference, (o_i, _) = held(False)
    training, (o_t, _) = held(True)
    assert o_i.grad_fn is None and o_t.grad_fn is not None
    assert inference < amat_bytes <= training
    torch.testing.assert_close(o_i, o_t, rtol=0, atol=0)
