"""fla::chunk_rwkv7 (chunked DPLR, 16-row chunks), what the fused_recurrent mode has no
counterpart for: fla's defaults and call site, chunk == fused_recurrent, T = 0, a non-default
scale under stress, CUDA graph capture. The checks both modes run are in test_rwkv7.py.
CPU and CUDA (the same tests, marked `cuda`)."""
import pytest
import torch

from conftest import DEVICES, HAS_CUDA, assert_close
from fla_ext import chunk_rwkv7, fused_recurrent_rwkv7, reference
from rwkv7_cases import CHUNK, NAMES, bwd_args, make, run_and_check, samples


@pytest.mark.parametrize("device", DEVICES)
def test_defaults(device, gen):
    """fla's defaults: scale = 1.0, output_final_state = False; scale=None means K ** -0.5."""
    r, w, k, v, a, b, _ = make(2, 9, 2, 16, 8, torch.float32, device, gen, h0=False)
    o, ht = chunk_rwkv7(r, w, k, v, a, b)
    assert ht is None
    assert_close("o", o, reference.rwkv7(r, w, k, v, a, b, scale=1.0)[0], 1e-5, 1e-6)
    o2, _ = chunk_rwkv7(r, w, k, v, a, b, scale=None)
    assert_close("o(scale=None)", o2, reference.rwkv7(r, w, k, v, a, b, scale=16 ** -0.5)[0],
                 1e-5, 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_fla_call_site(device, gen):
    """The RWKV-7 layer's call (fla's tuning hints as keywords) runs unchanged, same result."""
    r, w, k, v, a, b, h0 = make(1, 70, 2, 16, 16, torch.float32, device, gen, N=2)
    cu = torch.tensor([0, 30, 70], device=device)
    o, ht = chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=h0, output_final_state=True,
                        cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), safe_gate=True,
                        lower_bound=-0.6065306597126334, chunk_size=64, disable_recompute=True)
    o_ref, ht_ref = reference.rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=h0, cu_seqlens=cu)
    assert_close("o", o, o_ref, 1e-5, 1e-6)
    assert_close("ht", ht, ht_ref, 1e-5, 1e-6)
    with pytest.raises(TypeError, match="build_cp_context"):  # a context is fla_ext.cp's
        chunk_rwkv7(r, w, k, v, a, b, cp_context=object())


# ---------------------------------------------------------------------------------------------
# chunk == fused_recurrent (fp32, <= 1e-5), with initial states and across sequences.

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,cu", [((2, 100, 2, 64, 64), None), ((1, 75, 3, 32, 20), None),
                                      ((1, 90, 2, 48, 72), [0, 7, 7, 40, 90])],
                         ids=["B2T100", "T75", "varlen"])
@pytest.mark.parametrize("w_kind", ["typical", "mixedinf", "u30"])
def test_chunk_equals_fused(device, shape, cu, w_kind, gen):
    N = len(cu) - 1 if cu else shape[0]
    r, w, k, v, a, b, h0 = make(*shape, torch.float32, device, gen, w_kind=w_kind, N=N)
    cu_t = torch.tensor(cu, device=device) if cu else None
    ins = [t.clone().requires_grad_(True) for t in (r, w, k, v, a, b, h0)]
    ins_f = [t.clone().requires_grad_(True) for t in (r, w, k, v, a, b, h0)]
    o, ht = chunk_rwkv7(*ins[:6], initial_state=ins[6], output_final_state=True, cu_seqlens=cu_t)
    of, htf = fused_recurrent_rwkv7(*ins_f[:6], scale=1.0, initial_state=ins_f[6], cu_seqlens=cu_t)
    assert_close("o", o, of, 1e-5, 1e-6)
    assert_close("ht", ht, htf, 1e-5, 1e-6)
    do, dht = torch.randn(o.shape, generator=gen).to(o), torch.randn(ht.shape, generator=gen).to(ht)
    ((o * do).sum() + (ht * dht).sum()).backward()
    ((of * do).sum() + (htf * dht).sum()).backward()
    for name, x, y in zip(NAMES, ins, ins_f):
        assert_close(f"d{name}", x.grad, y.grad, 5e-5 if name == "w" else 1e-5, 1e-6)


# ---------------------------------------------------------------------------------------------
# Edge cases and stress

@pytest.mark.parametrize("device", DEVICES)
def test_no_rows(device, gen):
    """T = 0: empty outputs, the state passes through (forward and backward)."""
    r, w, k, v, a, b, h0 = make(2, 0, 2, 8, 4, torch.float32, device, gen)
    h0g = h0.clone().requires_grad_(True)
    o, ht = chunk_rwkv7(r, w, k, v, a, b, initial_state=h0g, output_final_state=True)
    assert o.shape == v.shape
    torch.testing.assert_close(ht, h0, rtol=0, atol=0)
    dht = torch.randn(ht.shape, generator=gen).to(ht)
    (ht * dht).sum().backward()
    torch.testing.assert_close(h0g.grad, dht, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_stress_nondefault_scale(device, gen):
    ins = make(2, 40, 2, 32, 16, torch.float32, device, gen, w_kind="u5")
    run_and_check(CHUNK, *ins, scale=0.123, gen=gen)


# ---------------------------------------------------------------------------------------------
# The CUDA kernels' two load paths: whole aligned rows copied asynchronously (DplrChunkPass::
# paths.rows_16byte, contiguous last dims) or element by element (any strides). The same values must give
# the same results (up to a reordered fp32 product or two); an indexing slip in either is O(1).

@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-3)])
def test_row_copy_paths_agree(dtype, tol, gen):
    r, w, k, v, a, b, h0 = make(2, 70, 2, 64, 64, dtype, "cuda", gen, N=2)

    def strided(t):  # the same values, the last dim two elements apart
        s = torch.zeros(*t.shape, 2, dtype=t.dtype, device=t.device)
        s[..., 0] = t
        return s[..., 0]

    do = torch.randn(v.shape, generator=gen).to(v)
    dht = torch.randn(h0.shape, generator=gen).to(h0)

    def run(xs):
        xs = [x.requires_grad_(True) for x in xs]
        o, ht = chunk_rwkv7(*xs, scale=0.5, initial_state=h0, output_final_state=True)
        grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), xs)
        return [o, ht, *grads]

    fast = run([t.clone() for t in (r, w, k, v, a, b)])
    slow = run([strided(t) for t in (r, w, k, v, a, b)])
    for name, x, y in zip(["o", "ht", *(f"d{n}" for n in NAMES[:6])], fast, slow):
        assert_close(name, x, y, tol, 1e-6)


# ---------------------------------------------------------------------------------------------
# The training forward (chunk_rwkv7_train): on CUDA it keeps the chunk-start states and its
# per-chunk workspace (`saved`), and the backward that reads them skips prep and its forward sweep.

def _same(xs, ys):
    for x, y in zip(xs, ys):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_train_forward_keeps_states(device):
    train, bwd = torch.ops.fla.chunk_rwkv7_train.default, torch.ops.fla.chunk_rwkv7_bwd.default
    for s in samples(CHUNK, device, requires_grad=False):
        torch.library.opcheck(train, s)
        o, ht, saved = train(*s)
        _same((o, ht), torch.ops.fla.chunk_rwkv7(*s))
        assert (saved.numel() > 0) == (device == "cuda")
        bargs = bwd_args(CHUNK, s, device)
        torch.library.opcheck(bwd, bargs + (saved,))
        _same(bwd(*bargs, saved), bwd(*bargs))  # same kernels and arithmetic: bitwise equal
        if device == "cuda":
            with pytest.raises(ValueError, match="`saved` must be the"):
                bwd(*bargs, torch.zeros(3, 2, 2, 2, device=device))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_autograd_uses_kept_states(dtype, gen):
    """A recording call holds the states and prep's workspace until backward (an inference call
    holds nothing more than its outputs), and its gradients equal the rebuilt backward's
    bitwise."""
    B, T, H, K, V = 2, 100, 2, 64, 64
    r, w, k, v, a, b, h0 = make(B, T, H, K, V, dtype, "cuda", gen)
    xs = [t.requires_grad_(True) for t in (r, w, k, v, a, b, h0)]
    slots = B * (T // 16 + 2)
    per = 4 * 16 * K + K + 5 * 16 * 20  # DplrWorkspaceLayout::floats_per_chunk() (U0 / O0 are not kept)
    states = slots * H * (K * V + per) * 4

    def held(grad):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.set_grad_enabled(grad):
            out = chunk_rwkv7(*xs[:6], scale=0.5, initial_state=xs[6], output_final_state=True)
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before, out

    inference, _ = held(False)
    training, (o, ht) = held(True)
    assert inference < states <= training
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), xs)
    raw = torch.ops.fla.chunk_rwkv7_bwd(*[x.detach() for x in xs[:6]], do, dht, 0.5,
                                         xs[6].detach(), None, False)
    _same(grads, raw)


# ---------------------------------------------------------------------------------------------
# CUDA graph capture of the raw ops (opcheck and torch.compile: test_rwkv7.py).

@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_cuda_graph_capture():
    s = samples(CHUNK, "cuda", requires_grad=False)[0]
    fwd = lambda: torch.ops.fla.chunk_rwkv7(*s)  # noqa: E731
    bargs = bwd_args(CHUNK, s, "cuda")
    bwd = lambda: torch.ops.fla.chunk_rwkv7_bwd(*bargs)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture
        fwd(), bwd()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = (fwd(), bwd())
    for _ in range(2):
        s[0].copy_(torch.randn_like(s[0]))  # new inputs in the captured buffers
        graph.replay()
        torch.cuda.synchronize()
        for x, y in zip(static[0] + static[1], fwd() + bwd()):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["strided_states", "kept_workspace"])
def test_cuda_graph_capture_windows(dtype, monkeypatch):
    """The windows on two streams (FLA_EXT_RWKV7_PIPELINE=1 takes them at any length) under
    capture: the side stream forks from the capturing stream and joins it back, so the graph
    holds both streams' kernels, and replays equal eager calls bitwise. bf16 keeps the strided
    states from the sweep, fp32 every state and the workspace."""
    monkeypatch.setenv("FLA_EXT_RWKV7_PIPELINE", "1")
    gen = torch.Generator().manual_seed(0)
    r, w, k, v, a, b, h0 = make(1, 300, 2, 64, 64, dtype, "cuda", gen, w_kind="rwkv7")
    do, dht = torch.randn_like(v), torch.randn_like(h0)

    def step():
        o, ht, saved = torch.ops.fla.chunk_rwkv7_train(r, w, k, v, a, b, 0.7, h0, True, None, False)
        return (o, ht) + tuple(torch.ops.fla.chunk_rwkv7_bwd(r, w, k, v, a, b, do, dht, 0.7, h0, None, False, saved))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for _ in range(2):
        r.copy_(torch.randn_like(r))  # new inputs in the captured buffers
        graph.replay()
        torch.cuda.synchronize()
        for x, y in zip(static, step()):
            torch.testing.assert_close(x, y, rtol=0, atol=0)

