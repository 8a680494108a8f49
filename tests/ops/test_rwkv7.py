"""The RWKV7 checks both modes run (fla::chunk_rwkv7 and fla::fused_recurrent_rwkv7), written once
and parametrized over the mode: forward and every gradient vs the float64 oracle (grid, state
options, fp16, varlen), the docs/algorithms.md §8.4 stress suite, gradcheck, real-op checks, errors.
CPU and CUDA (the same tests, marked `cuda`). What one mode has alone stays in its own module."""
import itertools
import math

import pytest
import torch

import fla_ext
from conftest import DEVICES, assert_compiles_same
from inputs import STRESS
from rwkv7_cases import (CHUNK, ERRORS, FUSED, MODES, NAMES, _good, bwd_args, check_bad_input,
                         make, run_and_check, samples)

# ---------------------------------------------------------------------------------------------
# The grid: T = 1, odd sizes, K != V both ways, V over several column tiles, K > 128, both
# layouts, strided inputs, h0 and dht on and off. chunk adds float64 (CPU only: the CUDA kernels
# are fp32/bf16/fp16), T a multiple of 16, K = 160 (8-column tiles), K = 128 over three column
# tiles (CUDA bf16: one grad CTA walks them; fp32: per-tile partials) and a non-default scale;
# fused_recurrent adds the reverse direction (chunk has none).

SHAPES = [(2, 37, 3, 16, 64), (2, 20, 2, 128, 32), (1, 1, 2, 64, 64), (2, 33, 2, 60, 100),
          (1, 18, 1, 256, 8)]
DTYPES = [(torch.float32, "fp32"), (torch.bfloat16, "bf16")]
GRIDS = [  # (mode, dtypes, shapes, reverse, scale)
    (CHUNK, [(torch.float64, "fp64")] + DTYPES,
     SHAPES + [(1, 48, 2, 160, 40), (2, 64, 1, 32, 16), (1, 40, 2, 128, 136)],
     [False], 0.7),
    (FUSED, DTYPES, SHAPES, [False, True], None),
]


def grid():
    for mode, dtypes, shapes, revs, scale in GRIDS:
        for d, (dtype, dt), shape, flags in itertools.product(
                DEVICES, dtypes, shapes, itertools.product([False, True], [False, True], revs)):
            if d.values[0] == "cuda" and dtype == torch.float64:
                continue
            yield pytest.param(mode, d.values[0], dtype, shape, flags, scale, marks=d.marks,
                               id="{}-{}-{}-B{}T{}H{}K{}V{}-hf{}nc{}rev{}".format(
                                   mode, d.id, dt, *shape, *map(int, flags)))


@pytest.mark.parametrize("mode,device,dtype,shape,flags,scale", list(grid()))
def test_grid(mode, device, dtype, shape, flags, scale, gen):
    head_first, noncontig, reverse = flags
    h0_on = (shape[1] + int(reverse)) % 2 == 0 or head_first  # both states of h0 over the grid
    dht_on = not noncontig or reverse
    ins = make(*shape, dtype, device, gen, head_first=head_first, noncontig=noncontig, h0=h0_on)
    run_and_check(mode, *ins, scale=scale, dht_on=dht_on, reverse=reverse, head_first=head_first,
                  gen=gen)


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("h0_on,dht_on", [(False, False), (True, False), (False, True), (True, True)])
def test_state_options(mode, device, h0_on, dht_on, gen):
    ins = make(2, 23, 2, 32, 48, torch.float32, device, gen, h0=h0_on)
    run_and_check(mode, *ins, dht_on=dht_on, scale=1.0, gen=gen)


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_fp16(mode, device, gen):
    r, w, k, v, a, b, h0 = make(2, 29, 2, 64, 64, torch.float16, device, gen)
    run_and_check(mode, r * 0.5, w, k * 0.5, v, a, b, h0, scale=mode.scale, gen=gen)


# ---------------------------------------------------------------------------------------------
# Variable length

@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cu", [[0, 3, 3, 9], [0, 1, 17, 81, 145, 400, 1000]], ids=["empty", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_varlen(mode, device, cu, dtype, gen):
    T, N = cu[-1], len(cu) - 1
    r, w, k, v, a, b, h0 = make(1, T, 2, 32, 40, dtype, device, gen, N=N)
    cu_t = torch.tensor(cu, dtype=torch.long, device=device)
    o, ht = run_and_check(mode, r, w, k, v, a, b, h0, scale=mode.scale, cu=cu_t, gen=gen)
    same = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for n in range(N):  # each sequence alone: same output and state
        s, e = cu[n], cu[n + 1]
        on, hn = mode(r[:, s:e], w[:, s:e], k[:, s:e], v[:, s:e], a[:, s:e], b[:, s:e],
                      initial_state=h0[n:n + 1])
        torch.testing.assert_close(on, o[:, s:e], **same)
        torch.testing.assert_close(hn, ht[n:n + 1], **same)
    if cu == [0, 3, 3, 9]:  # the empty sequence passes its state through, both ways
        torch.testing.assert_close(ht[1], h0[1], rtol=0, atol=0)
        h0g = h0.clone().requires_grad_(True)
        o, ht = mode(r, w, k, v, a, b, initial_state=h0g, cu_seqlens=cu_t)
        dht = torch.randn(ht.shape, generator=gen).to(ht)
        (ht * dht).sum().backward()
        torch.testing.assert_close(h0g.grad[1], dht[1], rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_varlen_int32_head_first(mode, device, gen):
    cu = torch.tensor([0, 5, 12, 40], dtype=torch.int32, device=device)
    ins = make(1, 40, 3, 16, 24, torch.float32, device, gen, N=3, head_first=True)
    # backwards in time where the mode can go that way
    run_and_check(mode, *ins, scale=mode.scale, cu=cu, head_first=True, reverse=mode.reverse,
                  gen=gen)


# ---------------------------------------------------------------------------------------------
# Stress suite (docs/algorithms.md §8.4): generic log decays (0, near 0, typical, U(-5,0), U(-30,0),
# -1e4, -inf, mixed, spikes at rows = 0 and 15 mod 16, RWKV-7's own range, 16-step sums at the
# CUDA chunk path's factoring bounds: -60, fp32 -16), with and without
# h0 and dht (chunk); the low-rank regimes (iclr 0 / 1: ||b a^T|| = 1; generic a, b); long T.

@pytest.mark.parametrize("mode,states", [pytest.param(CHUNK, True, id="chunk-states"),
                                         pytest.param(CHUNK, False, id="chunk-nostates"),
                                         pytest.param(FUSED, True, id="fused_recurrent")])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("w_kind", STRESS + ["rwkv7", "edge60", "edge16"])
def test_stress_gates(mode, states, device, dtype, w_kind, gen):
    ins = make(2, 70, 2, 64, 32, dtype, device, gen, w_kind=w_kind, h0=states)
    run_and_check(mode, *ins, scale=mode.scale, dht_on=states, gen=gen)


# fused_recurrent's other tests all draw RWKV-7's own pair ("rwkv"), so it is not repeated here.
LOW_RANK = [(m, lr) for m in MODES for lr in ["rwkv", "iclr0", "iclr1", "generic", "repeated"]
            if (m, lr) != (FUSED, "rwkv")]


@pytest.mark.parametrize("mode,lr", LOW_RANK, ids=str)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("w_kind", ["zero", "near0", "typical"])
def test_stress_low_rank(mode, lr, device, w_kind, gen):
    ins = make(2, 64, 2, 32, 48, torch.float32, device, gen, lr=lr, w_kind=w_kind)
    run_and_check(mode, *ins, scale=1.0, gen=gen)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,w_kind,lr", [(4096, "typical", "rwkv"), (8192, "typical", "iclr1"),
                                         (4096, "zero", "rwkv"), (4096, "near0", "iclr1")])
def test_stress_long(mode, device, T, w_kind, lr, gen):
    ins = make(1, T, 1, 64, 64, torch.float32, device, gen, w_kind=w_kind, lr=lr)
    run_and_check(mode, *ins, scale=1.0, gen=gen)


@pytest.mark.parametrize("mode,T", [(CHUNK, 21), (FUSED, 11)], ids=str)  # chunk: over two chunks
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("w_fill", [-1e4, -math.inf])
def test_analytic_hard_decay(mode, T, device, w_fill, gen):
    """exp(w) = 0: h_t = b_t (a_t^T h_{t-1}) + k_t v_t^T, so with a = 0 only the current token
    remains: o_t = s (r_t . k_t) v_t, hT = k v^T, dh0 = 0, dw = 0."""
    B, H, K, V = 2, 2, 16, 8
    r, _, k, v, a, b, h0 = make(B, T, H, K, V, torch.float32, device, gen)
    w = torch.full_like(r, w_fill)
    a = torch.zeros_like(a)
    ins = [t.clone().requires_grad_(True) for t in (r, w, k, v, a, b, h0)]
    o, ht = mode(*ins[:6], scale=0.5, initial_state=ins[6])
    expect = 0.5 * torch.einsum("bthk,bthk->bth", r, k)[..., None] * v
    torch.testing.assert_close(o, expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, torch.einsum("bhk,bhv->bhkv", k[:, -1], v[:, -1]))
    (o.square().sum() + ht.sum()).backward()
    assert (ins[6].grad == 0).all() and (ins[1].grad == 0).all()


# ---------------------------------------------------------------------------------------------
# Exact fp64 path: gradcheck, and inputs left untouched

# An empty sequence and one over several steps of the mode (chunk: three 16-row chunks).
@pytest.mark.parametrize("mode,T", [(CHUNK, 40), (FUSED, 20)], ids=str)
def test_gradcheck_fp64(mode, T, gen):
    H, K, V = 2, 3, 4
    r, w, k, v, a, b, h0 = make(1, T, H, K, V, torch.float64, "cpu", gen, N=3, lr="generic")
    cu = torch.tensor([0, 3, 3, T])
    ins = [t.clone().requires_grad_(True) for t in (r, w, k, v, a, b, h0)]

    def f(r, w, k, v, a, b, h0):
        return mode(r, w, k, v, a, b, initial_state=h0, cu_seqlens=cu)

    assert torch.autograd.gradcheck(f, ins, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_inputs_unchanged(mode, device, gen):
    ins = make(2, 19, 2, 16, 40, torch.bfloat16, device, gen, noncontig=True)
    ins = [t.clone().requires_grad_(True) for t in ins]
    before = [t.detach().clone() for t in ins]
    o, ht = mode(*ins[:6], initial_state=ins[6])
    (o.float().sum() + ht.sum()).backward()
    for name, x, y in zip(NAMES, ins, before):
        assert torch.equal(x.detach(), y), f"{name} was modified"


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_backward_deterministic(mode, device, gen):
    """Bitwise the same gradients on every call: the CUDA chunk backward adds two column tiles'
    K-vector partials into one slab atomically, in whichever order their CTAs finish (K = 64,
    V = 100: two 64-column tiles, one slab)."""
    ins = [t.requires_grad_(True) for t in make(2, 50, 2, 64, 100, torch.float32, device, gen)]
    do = torch.randn(2, 50, 2, 100, generator=gen).to(device)

    def grads():
        o, ht = mode(*ins[:6], initial_state=ins[6])
        return torch.autograd.grad((o * do).sum() + ht.sum(), ins)
    first = grads()
    for _ in range(3):
        for name, x, y in zip(NAMES, first, grads()):
            assert torch.equal(x, y), f"d{name} changed between calls"


# ---------------------------------------------------------------------------------------------
# Real ops: opcheck (schema, fake kernel, autograd registration) and torch.compile fullgraph
# (CUDA graph capture: test_rwkv7_chunk.py).

@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(mode, device):
    for args in samples(mode, device):
        torch.library.opcheck(mode.raw().default, args)
    for s in samples(mode, device, requires_grad=False):
        torch.library.opcheck(mode.raw(bwd=True).default, bwd_args(mode, s, device))


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_fwd_bwd(mode, device):
    s = samples(mode, device)[0]
    ins = list(s[:6]) + [s[7]]  # r, w, k, v, a, b, h0

    def f(r, w, k, v, a, b, s0):
        o, ht = mode(r, w, k, v, a, b, initial_state=s0)
        return (o * o).sum() + ht.square().sum()

    assert_compiles_same(f, ins, ins, device)


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, before any kernel runs.

@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("kw,exc,msg", ERRORS, ids=[e[2][:30] for e in ERRORS])
def test_bad_input(mode, kw, exc, msg):
    check_bad_input(mode.op, kw, exc, msg)


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_bad_grad_shapes(mode):
    x = _good()
    args = [x[n] for n in ("r", "w", "k", "v", "a", "b")]
    tail = (None, None, *mode.tail(None, False))  # scale, initial_state, [reverse,] cu, head_first
    with pytest.raises(ValueError, match=r"`grad_o` must have the shape of `v`"):
        mode.raw(bwd=True)(*args, x["r"], None, *tail)
    with pytest.raises(ValueError, match=r"`grad_final_state` must have shape"):
        mode.raw(bwd=True)(*args, x["v"], torch.zeros(1, 2, 4, 6), *tail)


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_value_checks(mode):
    """FLA_EXT_CHECKS: a non-finite input is named with its index; a positive `w` (one element,
    or a linear-space decay passed by mistake) is a clear error, not NaN."""
    x = _good()
    x["a"][1, 2, 0, 3] = math.nan
    fla_ext.set_checks(True)
    try:
        with pytest.raises(ValueError, match=r"`a` has a non-finite value at index \(1, 2, 0, 3\)"):
            mode.op(**x)
        x["a"][1, 2, 0, 3] = 0.0
        one = x["w"].clone()
        one[0, 1, 1, 1] = 0.25
        for w in (one, torch.sigmoid(torch.randn(x["w"].shape))):  # the latter: exp(w) by mistake
            with pytest.raises(ValueError, match=r"`w` is a log decay and must be <= 0"):
                mode.op(**dict(x, w=w))
    finally:
        fla_ext.set_checks(False)
