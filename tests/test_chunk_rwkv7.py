"""fla::chunk_rwkv7 (chunked DPLR, 16-row chunks): forward and every gradient vs the float64
oracle, chunk == fused_recurrent, the ALGORITHMS.md §8.4 stress suite, real-op checks, errors.
CPU and CUDA (the same tests, marked `cuda`)."""
import itertools
import math

import pytest
import torch

import fla_ext
from conftest import DEVICES, HAS_CUDA, assert_close
from inputs import STRESS
from fla_ext import chunk_rwkv7, fused_recurrent_rwkv7, reference
from rwkv7_cases import ERRORS, NAMES, _good, check_bad_input, make, relayout, run_and_check


def check(*ins, **kw):
    return run_and_check(*ins, op=chunk_rwkv7, **kw)


# (device, dtype) pairs: float64 runs on the CPU only (the CUDA kernels are fp32/bf16/fp16).
DEV_DTYPES = [pytest.param(d.values[0], t, id=f"{d.id}-{n}", marks=d.marks)
              for d in DEVICES for t, n in [(torch.float64, "fp64"), (torch.float32, "fp32"),
                                            (torch.bfloat16, "bf16")]
              if not (d.values[0] == "cuda" and t == torch.float64)]


# ---------------------------------------------------------------------------------------------
# The grid: T a multiple of 16 or not, T = 1, K != V both ways, V over several column tiles,
# K > 128 (8-column tiles), both layouts, strided inputs, h0 and dht on and off.

SHAPES = [(2, 37, 3, 16, 64), (2, 20, 2, 128, 32), (1, 1, 2, 64, 64), (2, 33, 2, 60, 100),
          (1, 18, 1, 256, 8), (1, 48, 2, 160, 40), (2, 64, 1, 32, 16)]
FLAGS = list(itertools.product([False, True], repeat=2))  # (head_first, noncontig)


@pytest.mark.parametrize("device,dtype", DEV_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}V{}".format(*s))
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "hf{}nc{}".format(*map(int, f)))
def test_grid(device, dtype, shape, flags, gen):
    head_first, noncontig = flags
    h0_on = shape[1] % 2 == 0 or head_first
    dht_on = not noncontig
    ins = make(*shape, dtype, device, gen, head_first=head_first, noncontig=noncontig, h0=h0_on)
    check(*ins, scale=0.7, dht_on=dht_on, head_first=head_first, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("h0_on,dht_on", [(False, False), (True, False), (False, True), (True, True)])
def test_state_options(device, h0_on, dht_on, gen):
    ins = make(2, 23, 2, 32, 48, torch.float32, device, gen, h0=h0_on)
    check(*ins, dht_on=dht_on, scale=1.0, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16(device, gen):
    r, w, k, v, a, b, h0 = make(2, 29, 2, 64, 64, torch.float16, device, gen)
    check(r * 0.5, w, k * 0.5, v, a, b, h0, scale=1.0, gen=gen)


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
    with pytest.raises(NotImplementedError, match="cp_context"):
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
# Variable length

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cu", [[0, 3, 3, 9], [0, 1, 17, 81, 145, 400, 1000]], ids=["empty", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_varlen(device, cu, dtype, gen):
    T, N = cu[-1], len(cu) - 1
    r, w, k, v, a, b, h0 = make(1, T, 2, 32, 40, dtype, device, gen, N=N)
    cu_t = torch.tensor(cu, dtype=torch.long, device=device)
    o, ht = check(r, w, k, v, a, b, h0, scale=1.0, cu=cu_t, gen=gen)
    same = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for n in range(N):  # each sequence alone: same output and state
        s, e = cu[n], cu[n + 1]
        on, hn = chunk_rwkv7(r[:, s:e], w[:, s:e], k[:, s:e], v[:, s:e], a[:, s:e], b[:, s:e],
                             initial_state=h0[n:n + 1], output_final_state=True)
        torch.testing.assert_close(on, o[:, s:e], **same)
        torch.testing.assert_close(hn, ht[n:n + 1], **same)
    if cu == [0, 3, 3, 9]:  # the empty sequence passes its state through, both ways
        torch.testing.assert_close(ht[1], h0[1], rtol=0, atol=0)
        h0g = h0.clone().requires_grad_(True)
        o, ht = chunk_rwkv7(r, w, k, v, a, b, initial_state=h0g, output_final_state=True,
                            cu_seqlens=cu_t)
        dht = torch.randn(ht.shape, generator=gen).to(ht)
        (ht * dht).sum().backward()
        torch.testing.assert_close(h0g.grad[1], dht[1], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_int32_head_first(device, gen):
    cu = torch.tensor([0, 5, 12, 40], dtype=torch.int32, device=device)
    ins = make(1, 40, 3, 16, 24, torch.float32, device, gen, N=3, head_first=True)
    check(*ins, scale=1.0, cu=cu, head_first=True, gen=gen)


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


# ---------------------------------------------------------------------------------------------
# Stress suite (ALGORITHMS.md §8.4): generic log decays (0, near 0, typical, U(-5,0), U(-30,0),
# -1e4, -inf, mixed, spikes at rows = 0 and 15 mod 16, RWKV-7's own range), with and without
# h0 and dht; the low-rank regimes (iclr 0 / 1: ||b a^T|| = 1; generic a, b); long T.

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("states", [True, False], ids=["states", "nostates"])
@pytest.mark.parametrize("w_kind", STRESS + ["rwkv7"])
def test_stress_gates(device, dtype, states, w_kind, gen):
    if w_kind == "rwkv7":  # RWKV-7's own parametrisation: w = -exp(-0.5) * sigmoid(x)
        ins = list(make(2, 70, 2, 64, 32, dtype, device, gen, h0=states))
        x = torch.randn(ins[1].shape, generator=gen)
        ins[1] = relayout(-math.exp(-0.5) * torch.sigmoid(x), ins[0])
    else:
        ins = make(2, 70, 2, 64, 32, dtype, device, gen, w_kind=w_kind, h0=states)
    check(*ins, scale=1.0, dht_on=states, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lr", ["rwkv", "iclr0", "iclr1", "generic"])
@pytest.mark.parametrize("w_kind", ["zero", "near0", "typical"])
def test_stress_low_rank(device, lr, w_kind, gen):
    ins = make(2, 64, 2, 32, 48, torch.float32, device, gen, lr=lr, w_kind=w_kind)
    check(*ins, scale=1.0, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
def test_stress_nondefault_scale(device, gen):
    ins = make(2, 40, 2, 32, 16, torch.float32, device, gen, w_kind="u5")
    check(*ins, scale=0.123, gen=gen)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,w_kind,lr", [(4096, "typical", "rwkv"), (8192, "typical", "iclr1"),
                                         (4096, "zero", "rwkv"), (4096, "near0", "iclr1")])
def test_stress_long(device, T, w_kind, lr, gen):
    ins = make(1, T, 1, 64, 64, torch.float32, device, gen, w_kind=w_kind, lr=lr)
    check(*ins, scale=1.0, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("w_fill", [-1e4, -math.inf])
def test_analytic_hard_decay(device, w_fill, gen):
    """exp(w) = 0 and a = 0: only the current token remains: o_t = s (r_t . k_t) v_t,
    hT = k v^T, dh0 = 0, dw = 0."""
    B, T, H, K, V = 2, 21, 2, 16, 8
    r, _, k, v, a, b, h0 = make(B, T, H, K, V, torch.float32, device, gen)
    w = torch.full_like(r, w_fill)
    a = torch.zeros_like(a)
    ins = [t.clone().requires_grad_(True) for t in (r, w, k, v, a, b, h0)]
    o, ht = chunk_rwkv7(*ins[:6], scale=0.5, initial_state=ins[6], output_final_state=True)
    expect = 0.5 * torch.einsum("bthk,bthk->bth", r, k)[..., None] * v
    torch.testing.assert_close(o, expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, torch.einsum("bhk,bhv->bhkv", k[:, -1], v[:, -1]))
    (o.square().sum() + ht.sum()).backward()
    assert (ins[6].grad == 0).all() and (ins[1].grad == 0).all()


# ---------------------------------------------------------------------------------------------
# Exact fp64 path: gradcheck, and inputs left untouched

def test_gradcheck_fp64(gen):
    H, K, V = 2, 3, 4
    r, w, k, v, a, b, h0 = make(1, 40, H, K, V, torch.float64, "cpu", gen, N=3, lr="generic")
    cu = torch.tensor([0, 3, 3, 40])  # an empty sequence and one over three chunks
    ins = [t.clone().requires_grad_(True) for t in (r, w, k, v, a, b, h0)]

    def f(r, w, k, v, a, b, h0):
        return chunk_rwkv7(r, w, k, v, a, b, initial_state=h0, output_final_state=True,
                           cu_seqlens=cu)

    assert torch.autograd.gradcheck(f, ins, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_unchanged(device, gen):
    ins = make(2, 19, 2, 16, 40, torch.bfloat16, device, gen, noncontig=True)
    ins = [t.clone().requires_grad_(True) for t in ins]
    before = [t.detach().clone() for t in ins]
    o, ht = chunk_rwkv7(*ins[:6], initial_state=ins[6], output_final_state=True)
    (o.float().sum() + ht.sum()).backward()
    for name, x, y in zip(NAMES, ins, before):
        assert torch.equal(x.detach(), y), f"{name} was modified"


# ---------------------------------------------------------------------------------------------
# Real ops: opcheck (schema, fake kernel, autograd registration), torch.compile fullgraph, CUDA
# graph capture.

def samples(device, requires_grad=True):
    g = torch.Generator().manual_seed(11)
    out = []
    for (B, T, H, K, V, hf, h0, fin, cu) in [(2, 9, 2, 8, 40, False, True, True, None),
                                            (1, 40, 2, 16, 8, True, False, False, [0, 5, 5, 40]),
                                            (2, 1, 1, 4, 4, False, False, True, None)]:
        r, w, k, v, a, b, s0 = make(B, T, H, K, V, torch.float32, device, g, head_first=hf,
                                    h0=h0, N=len(cu) - 1 if cu else B)
        ts = [r, w, k, v, a, b] + ([s0] if h0 else [])
        if requires_grad:
            for t in ts:
                t.requires_grad_(True)
        cu_t = torch.tensor(cu, device=device) if cu else None
        out.append((r, w, k, v, a, b, 1.0, s0, fin, cu_t, hf))
    return out


def bwd_args(sample, device):
    r, w, k, v, a, b, _, s0, fin, cu, hf = sample
    N = cu.numel() - 1 if cu is not None else r.shape[0]
    H = r.shape[1] if hf else r.shape[2]
    dht = torch.randn(N, H, r.shape[-1], v.shape[-1], device=device) if fin else None
    return (r, w, k, v, a, b, torch.randn_like(v), dht, 0.5, s0, cu, hf)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for args in samples(device):
        torch.library.opcheck(torch.ops.fla.chunk_rwkv7.default, args)
    for s in samples(device, requires_grad=False):
        torch.library.opcheck(torch.ops.fla.chunk_rwkv7_bwd.default, bwd_args(s, device))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_fwd_bwd(device):
    torch._dynamo.reset()
    r, w, k, v, a, b, _, s0, _, _, _ = samples(device)[0]

    def f(r, w, k, v, a, b, s0):
        o, ht = chunk_rwkv7(r, w, k, v, a, b, initial_state=s0, output_final_state=True)
        return (o * o).sum() + ht.square().sum()

    cf = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    ins = [r, w, k, v, a, b, s0]
    loss_c = cf(*ins)
    g_c = torch.autograd.grad(loss_c, ins)
    loss_e = f(*ins)
    g_e = torch.autograd.grad(loss_e, ins)
    torch.testing.assert_close(loss_c, loss_e)
    for x, y in zip(g_c, g_e):
        torch.testing.assert_close(x, y)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_cuda_graph_capture():
    s = samples("cuda", requires_grad=False)[0]
    fwd = lambda: torch.ops.fla.chunk_rwkv7(*s)  # noqa: E731
    bargs = bwd_args(s, "cuda")
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


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, before any kernel runs.

@pytest.mark.parametrize("kw,exc,msg", ERRORS, ids=[e[2][:30] for e in ERRORS])
def test_bad_input(kw, exc, msg):
    check_bad_input(chunk_rwkv7, kw, exc, msg)


def test_bad_grad_shapes():
    x = _good()
    args = [x[n] for n in ("r", "w", "k", "v", "a", "b")]
    with pytest.raises(ValueError, match=r"`grad_o` must have the shape of `v`"):
        torch.ops.fla.chunk_rwkv7_bwd(*args, x["r"], None, None, None, None, False)
    with pytest.raises(ValueError, match=r"`grad_final_state` must have shape"):
        torch.ops.fla.chunk_rwkv7_bwd(*args, x["v"], torch.zeros(1, 2, 4, 6), None, None, None,
                                      False)


def test_value_checks():
    """FLA_EXT_CHECKS: a linear-space decay passed as `w` (positive) is a clear error, not NaN."""
    x = _good()
    x["a"][1, 2, 0, 3] = math.nan
    fla_ext.set_checks(True)
    try:
        with pytest.raises(ValueError, match=r"`a` has a non-finite value at index \(1, 2, 0, 3\)"):
            chunk_rwkv7(**x)
        x["a"][1, 2, 0, 3] = 0.0
        x["w"] = torch.sigmoid(torch.randn(x["w"].shape))  # exp(w) by mistake: in (0, 1)
        with pytest.raises(ValueError, match=r"`w` is a log decay and must be <= 0"):
            chunk_rwkv7(**x)
    finally:
        fla_ext.set_checks(False)
