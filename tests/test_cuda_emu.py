"""The CUDA kernels of chunk_rwkv7 and of the chunk engine (chunk_gla, chunk_rwkv6), run on the
CPU (tests/cuda_emu: a fiber per CUDA thread, a barrier per __syncthreads, NaN-poisoned outputs
and workspaces), against fla_ext's CPU ops: forward and every gradient, fp32 and bf16. CI has no GPU; this is where it executes the
kernels' indexing, workspace layout and algebra (not their speed, nor races the barrier order
hides on the CPU). Needs the CUDA headers (CUDA_HOME) and a C++20 compiler."""
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import assert_close
from families import GLA, GLA_GV, RWKV6
from fla_ext import chunk_rwkv7
from rwkv7_cases import make

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_INC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(CUDA_INC, "cuda_runtime.h")),
                                reason="no CUDA headers")


def build(name, variant="", flags=()):
    from torch.utils.cpp_extension import load
    return load(f"fla_ext_{name}{variant}", [os.path.join(HERE, f"{name}.cpp")],
                extra_include_paths=[HERE, os.path.join(ROOT, "csrc", "kernels"), CUDA_INC],
                extra_cflags=["-std=c++20", "-O2", "-w", *flags])


@pytest.fixture(scope="module")
def emu():
    return build("dplr_chunk_emu")


@pytest.fixture(scope="module")
def emu_cp_async():
    """The kernels as built for GPUs before sm_90: the sweeps fetch a chunk's workspace block by
    cp.async, 16 bytes a thread, instead of bulk copies on an mbarrier (async_copy.cuh)."""
    return build("dplr_chunk_emu", "_cp_async", ["-DFLA_BULK_COPY=0"])


@pytest.fixture(scope="module")
def chunk_emu():
    return build("chunk_emu")


@pytest.fixture(scope="module")
def tile_emu():
    return build("tile_emu")


@pytest.mark.parametrize("warp", [True, False], ids=["syncwarp", "syncthreads"])
def test_emulator_aborts_on_a_barrier_some_threads_skip(tile_emu, warp):
    """A barrier that some threads never reach (undefined on a GPU, and a hang there for a warp):
    the emulator's scheduler (fibers on one OS thread) must say so and abort, not spin or let it
    pass. Run in a child process, which must die with the message."""
    code = ("import sys; sys.path[:0] = sys.argv[1:]; from test_cuda_emu import build; "
            f"build('tile_emu').divergent_barrier({warp})")
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", code, here, os.path.join(here, "support")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    assert ("warp barrier" if warp else "at __syncthreads") in r.stderr and "emu: deadlock" in r.stderr


def test_fp16_scaled_warp_products(tile_emu, gen):
    """tile_mma.cuh's fp16 tensor-core product (mma_f16 via warp_mma_f16, m16n8k16) on operands
    scaled by pow2_down_scale (benchmarks/NOTES.md c57): O(1) tiles give TF32's products (the
    same rounding of each operand, fp32 sums); tiles of any magnitude (1e-15 to 1e15 each) and with
    rows and columns 2^±40 apart, stay finite and within TF32's error bound of the float64
    product, plus 2^-24 of the largest terms for the entries fp16 holds below its normal range
    (unscaled fp16 would overflow or flush them); a zero tile gives zeros at scale 1."""
    K = 64

    def check(a, b, rel_to_tf32=None):
        tf32, f16, scales = tile_emu.products(a, b)
        exact = a.double() @ b.double()
        mag = a.double().abs() @ b.double().abs()
        bound = 2.0 ** -10 * mag + 2.0 ** -23 * K * a.abs().max().double() * b.abs().max().double()
        assert torch.isfinite(f16).all()
        assert ((f16.double() - exact).abs() <= bound).all()
        if rel_to_tf32 is not None:
            assert ((f16 - tf32).abs() <= rel_to_tf32 * mag.float()).all()
        return scales

    a = torch.randn(16, K, generator=gen)
    b = torch.randn(K, 8, generator=gen)
    check(a, b, rel_to_tf32=1e-6)
    for big in (1e15, 1e-15):  # products 1e30, 1e-30: beyond fp16's range, inside fp32's
        check(a * big, b * big, rel_to_tf32=1e-6)
    rows = torch.exp2(torch.randint(-40, 41, (16, 1), generator=gen).float())
    cols = torch.exp2(torch.randint(-40, 41, (1, 8), generator=gen).float())
    check(a * rows, b * cols)
    ks = torch.exp2(torch.randint(-40, 41, (1, K), generator=gen).float())
    check(a * ks, b)  # along the summed dimension: one scale cannot bring every entry near 1
    tf32, f16, scales = tile_emu.products(torch.zeros(16, K), b)
    assert (f16 == 0).all() and scales[0] == 1


def test_fp16_products_read_from_accumulators(tile_emu, gen):
    """tile_mma.cuh's packs of fp32 accumulators into fp16 operands (benchmarks/NOTES.md c67):
    P = x y held in a warp's two m16n8 accumulators, then read as the A operand of P z (packing
    alone), the B operand of w P (movmatrix transposes) and the A operand of P^T z (transposes).
    Integer inputs make every product exact, so each layout is checked element for element
    against float64; then real inputs of mixed magnitude against fp16's rounding bound."""
    def run(x, y, z, w):
        P, q1, q2, q3, q4 = tile_emu.chained(x, y, z, w)
        P64 = x.double() @ y.double()
        want = [P64 @ z.double(), w.double() @ P64[:, :8], w.double() @ P64[:, 8:], P64.T @ z.double()]
        return P, [q1, q2, q3, q4], P64, want

    ints = lambda *s: torch.randint(-2, 3, s, generator=gen).float()
    x, y, z, w = ints(16, 16), ints(16, 16), ints(16, 8), ints(16, 16)
    P, got, P64, want = run(x, y, z, w)
    assert torch.equal(P.double(), P64)
    for name, a, b in zip(("P z", "w P[:, :8]", "w P[:, 8:]", "P^T z"), got, want):
        assert torch.equal(a.double(), b), name

    mags = torch.exp2(torch.randint(-20, 21, (16, 1), generator=gen).float())
    x = torch.randn(16, 16, generator=gen) * mags  # rows of P 2^+-20 apart
    y, z, w = torch.randn(16, 16, generator=gen), torch.randn(16, 8, generator=gen), torch.randn(16, 16, generator=gen)
    P, got, P64, want = run(x, y, z, w)
    absP = x.double().abs() @ y.double().abs()
    mags_of = [absP @ z.double().abs(), w.double().abs() @ absP[:, :8], w.double().abs() @ absP[:, 8:],
               absP.T @ z.double().abs()]
    for name, a, b, m in zip(("P z", "w P[:, :8]", "w P[:, 8:]", "P^T z"), got, want, mags_of):
        # x, y rounded once for P, P and z (or w) once more for the product: 3 x 2^-11 relative,
        # and below fp16's normal range (2^-14 of P's largest) an absolute 2^-25 of it per term
        bound = 2.0 ** -9 * m + 2.0 ** -24 * 16 * absP.max() * max(z.abs().max(), w.abs().max())
        assert torch.isfinite(a).all() and ((a.double() - b).abs() <= bound).all(), name


def test_fp16_operands_from_shared_tiles(tile_emu, gen):
    """tile_mma.cuh's ldmatrix loads of mma_f16 operands from fp16 tiles (benchmarks/NOTES.md
    c67): A from a tile stored [m][k] and one stored transposed, B from tiles stored [k][n] and
    [n][k]; integer inputs, so x y, x^T y and x y^T must equal float64's element for element."""
    x = torch.randint(-4, 5, (16, 16), generator=gen).float()
    y = torch.randint(-4, 5, (16, 16), generator=gen).float()
    xy, xty, xyt = tile_emu.shared_products(x, y)
    x64, y64 = x.double(), y.double()
    assert torch.equal(xy.double(), x64 @ y64)
    assert torch.equal(xty.double(), x64.T @ y64)
    assert torch.equal(xyt.double(), x64 @ y64.T)


@pytest.mark.parametrize("shape,w_kind,cu,lr", [
    ((1, 40, 2, 16, 8), "rwkv", None, "rwkv"),
    ((2, 37, 1, 32, 40), "mixedinf", None, "rwkv"),
    ((1, 50, 1, 70, 33), "u30", None, "rwkv"),  # K > 64 and not a multiple of 4, V not a multiple of 32
    ((1, 90, 2, 24, 20), "mixedinf", [0, 7, 7, 40, 90], "rwkv"),  # varlen with an empty sequence
    # X's entries come out of cancelling binomial-size terms unless it is solved by substitution
    ((1, 48, 1, 16, 8), "zero", None, "repeated"),
    # K = 128: the constant-K build (launch_k<T, 128>)
    ((1, 20, 1, 128, 32), "rwkv", None, "rwkv"),
    # K <= 64 with V > 64: two 64-column grad tiles add into one zero-filled slab (the second
    # one partial), the sweeps' last 32-column tile partial
    ((1, 40, 1, 32, 80), "rwkv", None, "rwkv"),
    # K = 64: the kernels with K a compile-time constant (the launch's launch_k<T, 64>)
    ((1, 40, 1, 64, 48), "mixedinf", [0, 17, 40], "rwkv"),
    # K > 128: 8-column grad tiles (dplr_chunk_cols), their 3xTF32 products by warp_mma_ld
    ((1, 20, 1, 136, 20), "rwkv", None, "rwkv"),
    # chunk totals about fp32's factoring bound (-16): factored and exact pair matrices side by side
    ((1, 50, 2, 64, 64), "edge16", None, "rwkv"),
], ids=["rwkv7", "mixed", "K70V33", "varlen", "repeated_keys", "K128", "K32V80", "K64", "K136", "edge16"])
def test_chunk_rwkv7_kernels(emu, shape, w_kind, cu, lr, gen):
    check(emu, shape, w_kind, cu, gen, torch.float32, 1e-5, lr=lr)


@pytest.mark.parametrize("w_kind", ["u5", "rwkv7", "edge16"])
def test_chunk_rwkv7_fp32_stays_near_1e6(emu, w_kind):
    """fp32's factoring bound (kFactorBoundFp32): o and the gradients stay within 1.5e-6 of the
    float64 op (dw within 5x). Fixed inputs, so the check is deterministic; at -60, the bf16 bound,
    U(-5, 0) decays reach 2.7e-6 in o and 2.9e-6 in da (docs/algorithms.md §2.2)."""
    g = torch.Generator().manual_seed(1)
    *ins, h0 = make(1, 64, 2, 64, 64, torch.float32, "cpu", g, w_kind=w_kind, N=1)
    xs = [t.double().requires_grad_(True) for t in ins + [h0]]
    o, ht = chunk_rwkv7(*xs[:6], scale=0.7, initial_state=xs[6], output_final_state=True)
    do, dht = torch.randn(o.shape, generator=g), torch.randn(ht.shape, generator=g)
    grads = torch.autograd.grad((o * do.double()).sum() + (ht * dht.double()).sum(), xs)
    none, cu = torch.empty(0), torch.empty(0, dtype=torch.int64)
    eo, eht = emu.run(*ins, h0, none, none, 0.7, cu, 0)
    eg = emu.run(*ins, h0, do, dht, 0.7, cu, 0)
    rel = lambda x, y: ((x.double() - y).norm() / y.norm()).item()  # noqa: E731
    errs = {"o": rel(eo, o), "ht": rel(eht, ht)}
    errs.update({f"d{n}": rel(x, y) for n, x, y in zip(["r", "w", "k", "v", "a", "b", "h0"], eg, grads)})
    assert all(e <= (7.5e-6 if n == "dw" else 1.5e-6) for n, e in errs.items()), errs


@pytest.mark.parametrize("shape", [(1, 45, 2, 32, 24), (1, 30, 1, 20, 12), (1, 20, 1, 72, 80),
                                   (1, 40, 1, 64, 64), (1, 20, 1, 128, 80), (1, 20, 1, 136, 20)],
                         ids=["rows16", "K20", "K72V80", "K64", "K128V80", "K136"])
def test_chunk_rwkv7_kernels_bf16(emu, shape, gen):
    """The bf16 loads and stores (K, V multiples of 8: the asynchronous row copies; K = 20: the
    element-wise loads), TF32 sweeps and prep products (RWKV-7's own decays: the pair matrices
    on tensor cores); the reference gets the same bf16 values (fp32 math). K72V80: prep's warps
    take a second 8-channel / 8-column slab (64 + 8). K136: grad's 8-column tiles, whose
    column products keep the 4-byte fragment forms (warp_mma_nt needs 16 columns)."""
    check(emu, shape, "rwkv7", None, gen, torch.bfloat16, 1e-2)


@pytest.mark.parametrize("shape,w_kind,cu,strided", [
    ((1, 40, 2, 128, 128), "near0", None, False),           # two whole tiles
    ((1, 50, 1, 128, 200), "rwkv7", [0, 9, 9, 50], False),  # four, the last 8 columns; varlen, an empty sequence
    ((1, 20, 1, 128, 136), "near0", None, True),            # element loads (w's rows not 16-byte pieces)
], ids=["V128", "V200varlen", "V136strided"])
def test_chunk_rwkv7_kernels_bf16_walked_tiles(emu, shape, w_kind, cu, strided, gen):
    """bf16 at K = 128: one grad CTA per chunk walks V's column tiles (dplr_grad_walks_tiles),
    summing the pair-matrix gradients, the state parts and zeta over them, and stores the K-vector
    gradients straight into the poisoned outputs (no slab). near0: chunk decays near 1, so that
    zeta's state term (gamma rowsum(S * dS+), summed over the tiles) carries weight in dw."""
    check(emu, shape, w_kind, cu, gen, torch.bfloat16, 1e-2, strided=strided)


@pytest.mark.parametrize("w_kind", ["near0", "u30"])
def test_chunk_rwkv7_kernels_bf16_strided_walked_tiles(emu, w_kind, gen):
    """bf16 at K = V = 128 on the strided states from the forward sweep (sweep_strided_states):
    each grad CTA walks a stride of chunks (4 and 3 here) and both column tiles of each, making
    each tile's next state in a buffer of its own (S, S1). Against the reference at the bf16
    tolerance; the backward in windows of 4 chunks, and on the forward's kept workspace (no prep),
    bitwise equal to it. near0: chunk decays
    near 1, so that a wrong made state carries into the later chunks' gradients; u30: every chunk
    on the exact pair walks."""
    *ins, h0 = make(1, 100, 1, 128, 128, torch.bfloat16, "cpu", gen, w_kind=w_kind, N=1, lr="rwkv")
    xs = [t.clone().requires_grad_(True) for t in ins + [h0]]
    o, ht = chunk_rwkv7(*xs[:6], scale=0.7, initial_state=xs[6], output_final_state=True)
    do = torch.randn(o.shape, generator=gen).to(torch.bfloat16)
    dht = torch.randn(ht.shape, generator=gen)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), xs)
    cu_e = torch.empty(0, dtype=torch.int64)
    eg = emu.run(*ins, h0, do, dht, 0.7, cu_e, 8)
    for name, x, y in zip(["r", "w", "k", "v", "a", "b", "h0"], eg, grads):
        assert_close(f"d{name}", x, y, 5e-2 if name == "w" else 1e-2, 1e-6)
    for x, y in zip(emu.run(*ins, h0, do, dht, 0.7, cu_e, 9), eg):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    # The forward keeping prep's whole workspace beside those states (strided_ws_kept, every float
    # written), the backward reading it (no prep): the same gradients, bitwise; in windows too.
    for keep in (10, 11):
        for x, y in zip(emu.run(*ins, h0, do, dht, 0.7, cu_e, keep), eg):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_chunk_rwkv7_kernels_bf16_strided_walked_tiles_varlen(emu, gen):
    """The same strided states at K = V = 128 under cu_seqlens (sweep_strided takes them at K =
    128 whatever cu_seqlens): sequences of 6 chunks (a stride and 2), none, 4 (one whole
    stride) and 1 partial chunk, so that the kept-state slot map has gaps. The forward sweep
    stores each sequence's strided and final states and zeros in the gap slots (the emulator
    poisons hst and fails on a slot left unwritten), prep keeps its whole workspace, and grad
    walks each sequence's strides; against the reference at the bf16 tolerance."""
    cu = [0, 90, 90, 150, 160]
    *ins, h0 = make(1, 160, 1, 128, 128, torch.bfloat16, "cpu", gen, w_kind="near0", N=4, lr="rwkv")
    xs = [t.clone().requires_grad_(True) for t in ins + [h0]]
    cu_t = torch.tensor(cu)
    o, ht = chunk_rwkv7(*xs[:6], scale=0.7, initial_state=xs[6], output_final_state=True, cu_seqlens=cu_t)
    do = torch.randn(o.shape, generator=gen).to(torch.bfloat16)
    dht = torch.randn(ht.shape, generator=gen)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), xs)
    eg = emu.run(*ins, h0, do, dht, 0.7, cu_t, 10)
    for name, x, y in zip(["r", "w", "k", "v", "a", "b", "h0"], eg, grads):
        assert_close(f"d{name}", x, y, 5e-2 if name == "w" else 1e-2, 1e-6)


@pytest.mark.parametrize("w_kind,lr", [("u30", "rwkv"), ("u5", "rwkv"), ("rwkv", "rwkv"),
                                       ("edge60", "rwkv"), ("zero", "repeated")],
                         ids=["u30", "u5", "rwkv6", "edge60", "repeated"])
def test_chunk_rwkv7_kernels_bf16_decays(emu, w_kind, lr, gen):
    """Prep's two ways to the pair matrices in one call. A chunk with a channel's total decay
    below -60 takes the exact pair walks (u30: every chunk; u5, rwkv6's -exp(N(0, 4)): some),
    the others the factored tensor-core products (1 / exp(G) would be inf past the bound: NaN).
    edge60: chunk totals within 0.2 of the bound, so factors up to e^60 on the factored side.
    repeated: X's solve amplifies the products' errors (3xTF32 keeps them at fp32's)."""
    check(emu, (1, 40, 2, 64, 32), w_kind, None, gen, torch.bfloat16, 1e-2, lr=lr)


def test_chunk_rwkv7_kernels_strided_rows(emu, gen):
    """r, w, k, a, b with different strides (w a view of a wider tensor): the row copies take
    each array's own offsets, not r's (DplrChunkPaths::rows_share_offsets)."""
    check(emu, (2, 40, 2, 64, 64), "rwkv", None, gen, torch.bfloat16, 1e-2, strided=True)


@pytest.mark.parametrize("shape,w_kind,cu,lr", [
    ((1, 90, 2, 64, 64), "u5", [0, 7, 7, 40, 90], "rwkv"),  # varlen, an empty sequence: hst's gap slots
    ((1, 50, 1, 64, 64), "edge60", None, "rwkv"),  # factors up to e^60 in the fused pair matrices
    ((1, 40, 1, 64, 64), "u30", None, "rwkv"),     # every chunk unbounded: the exact pair walks
    ((1, 48, 1, 64, 64), "zero", None, "repeated"),  # X from cancelling terms
    # 11 chunks (the last partial): grad CTAs walking strides of 4, 4 and 3 chunks, each making
    # the states between the kept ones; windows of 4 chunks
    ((1, 170, 1, 64, 64), "rwkv7", None, "rwkv"),
    # varlen strides: 5 and 9 chunks, strided hst slots past an empty sequence
    ((1, 200, 1, 64, 64), "rwkv7", [0, 70, 70, 200], "rwkv"),
], ids=["varlen", "edge60", "u30", "repeated", "strides", "varlen_strides"])
def test_chunk_rwkv7_kernels_fused_kept(emu, shape, w_kind, cu, lr, gen):
    """bf16 at K = V = 64, where a training forward may take the fused kernel: check() runs the
    backward on its kept states too (check_fused_kept: the fused reverse pass, and grad on every
    kDplrStateStride-th chunk-start state, making the ones between)."""
    check(emu, shape, w_kind, cu, gen, torch.bfloat16, 1e-2, lr=lr)


@pytest.mark.parametrize("shape,dtype,tol", [((1, 40, 1, 64, 64), torch.bfloat16, 1e-2),
                                             ((1, 50, 1, 70, 33), torch.float32, 1e-5)],
                         ids=["bf16K64", "fp32K70V33"])
def test_chunk_rwkv7_kernels_cp_async_fetch(emu_cp_async, shape, dtype, tol, gen):
    check(emu_cp_async, shape, "mixedinf", None, gen, dtype, tol)


@pytest.fixture
def descending(request):
    """The emulator's warps, and each warp's lanes, in descending order between barriers for one
    test (the others run ascending: emu.h), so that an unsynchronised read of a later warp's or
    lane's write shows too."""
    mod = request.getfixturevalue(request.param)
    mod.set_warp_order(-1)
    yield mod
    mod.set_warp_order(1)


@pytest.mark.parametrize("descending", ["emu"], indirect=True)
@pytest.mark.parametrize("shape,dtype,tol", [((1, 40, 1, 64, 64), torch.bfloat16, 1e-2),
                                             ((1, 37, 2, 32, 40), torch.float32, 1e-5)],
                         ids=["bf16K64", "fp32"])
def test_chunk_rwkv7_kernels_descending_warps(descending, shape, dtype, tol, gen):
    check(descending, shape, "mixedinf", None, gen, dtype, tol)


def _every_other_element(t):
    """t's values as every other element of a tensor twice as wide: its strides are not its
    siblings', and its rows are not whole 16-byte pieces (the kernels' element loads)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


@pytest.mark.parametrize("descending", ["emu"], indirect=True)
@pytest.mark.parametrize("shape,w_kind,cu,lr", [
    ((2, 40, 2, 64, 64), "rwkv7", None, "rwkv"),       # RWKV-7's decays: factored pair matrices
    ((1, 45, 1, 64, 64), "mixedinf", None, "rwkv"),    # -inf and strong decays: the exact pairs
    ((1, 50, 1, 64, 64), "edge60", None, "rwkv"),      # chunk totals near the bound
    ((1, 90, 1, 64, 64), "u5", [0, 7, 7, 40, 90], "rwkv"),  # varlen, an empty sequence, both paths
    ((1, 48, 1, 64, 64), "zero", None, "repeated"),    # X from cancelling terms
    # w and o every other element of wider tensors: w's rows are not 16-byte pieces, so every
    # input takes the element loads; o's stores step by its column stride
    ((1, 37, 2, 64, 64), "rwkv7", None, "strided"),
], ids=["rwkv7", "mixedinf", "edge60", "varlen", "repeated", "strided"])
@pytest.mark.parametrize("ctas", [1, 2, 3, 4])
def test_chunk_rwkv7_fused_forward(descending, shape, w_kind, cu, lr, ctas, gen):
    """The fused inference forward (one CTA per sequence and head, no workspace; bf16, K = V =
    64) against the CPU op on the same bf16 inputs, warps in descending order between barriers;
    every build the launch picks from: the two-block kernel (two CTAs per SM) and the one-block
    kernel's two register budgets (three or four CTAs per SM). ctas = 1: the two-block kernel
    of a training forward at few pairs, which keeps what prep and the forward sweep keep (the
    chunk-start states and prep's workspace): those against the two kernels' on the same inputs,
    every float written (poisoned buffers)."""
    N = len(cu) - 1 if cu else shape[0]
    strided = lr == "strided"
    *ins, h0 = make(*shape, torch.bfloat16, "cpu", gen, w_kind=w_kind, N=N, lr="rwkv" if strided else lr)
    if strided:
        ins[1] = _every_other_element(ins[1])
    cu_t = torch.tensor(cu) if cu else None
    o, ht = chunk_rwkv7(*ins, scale=0.7, initial_state=h0, output_final_state=True, cu_seqlens=cu_t)
    cu_e = cu_t if cu else torch.empty(0, dtype=torch.int64)
    eo, eht, *kept = descending.run_fused(*ins, h0, 0.7, cu_e, ctas, strided)
    assert_close("o", eo, o, 1e-2, 1e-6)
    assert_close("ht", eht, ht, 1e-2, 1e-6)
    if ctas == 1:
        hst, ws, hst_ref, ws_ref = kept
        for name, x, ref in [("hst", hst, hst_ref), ("ws", ws, ws_ref)]:
            assert not torch.isnan(x).any(), f"{name}: a float not written"
            written = ~torch.isnan(ref)  # (prep leaves the matrices' padding columns as it found them)
            assert_close(name, x[written], ref[written], 1e-2, 1e-6)


def _rwkv7_backward_case(shape, w_kind, cu, lr, gen):
    """bf16 inputs, h0, dO, dht, the CPU op's seven gradients (r, w, k, v, a, b, h0) and the
    emulator's cu_seqlens argument for the backward kernel's tests."""
    N = len(cu) - 1 if cu else shape[0]
    *ins, h0 = make(*shape, torch.bfloat16, "cpu", gen, w_kind=w_kind, N=N, lr=lr)
    cu_t = torch.tensor(cu) if cu else None
    xs = [t.clone().requires_grad_(True) for t in ins + [h0]]
    o, ht = chunk_rwkv7(*xs[:6], scale=0.7, initial_state=xs[6], output_final_state=True, cu_seqlens=cu_t)
    do = torch.randn(o.shape, generator=gen).to(torch.bfloat16)
    dht = torch.randn(ht.shape, generator=gen)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), xs)
    return ins, h0, do, dht, grads, cu_t if cu else torch.empty(0, dtype=torch.int64)


def _check_all_grads(got, grads):
    """The kernel's [dv, dh0, dr, dw, dk, da, db] against the CPU op's, bf16 tolerance (dw 5x)."""
    edv, edh0, edr, edw, edk, eda, edb = got
    for name, x, y in zip(["r", "w", "k", "v", "a", "b", "h0"], [edr, edw, edk, edv, eda, edb, edh0], grads):
        assert_close(f"d{name}", x, y, 5e-2 if name == "w" else 1e-2, 1e-6)


@pytest.mark.parametrize("descending", ["emu"], indirect=True)
@pytest.mark.parametrize("shape,w_kind,cu,lr", [
    ((2, 40, 2, 64, 64), "rwkv7", None, "rwkv"),       # RWKV-7's decays: factored pair matrices
    ((1, 45, 1, 64, 64), "mixedinf", None, "rwkv"),    # -inf and strong decays: the exact pairs
    ((1, 90, 1, 64, 64), "u5", [0, 7, 7, 40, 90], "rwkv"),  # varlen, an empty sequence
    ((1, 48, 1, 64, 64), "zero", None, "repeated"),    # X from cancelling terms
], ids=["rwkv7", "mixedinf", "varlen", "repeated"])
def test_chunk_rwkv7_backward_chain(descending, shape, w_kind, cu, lr, gen):
    """The backward kernel under construction (benchmarks/NOTES.md c67; dplr_chunk_fused_backward.cuh),
    its first step: the reverse chain with D held transposed in registers and every product on
    scaled fp16 tensor cores gives dv and dh0 within the bf16 tolerance of the CPU op's, warps in
    descending order between barriers, outputs poisoned."""
    ins, h0, do, dht, grads, cu_e = _rwkv7_backward_case(shape, w_kind, cu, lr, gen)
    edv, edh0 = descending.run_single_pass_backward(*ins, h0, do, dht, torch.empty(0), 0.7, cu_e, False)
    assert_close("dv", edv, grads[3], 1e-2, 1e-6)
    assert_close("dh0", edh0, grads[6], 1e-2, 1e-6)


@pytest.mark.parametrize("descending", ["emu"], indirect=True)
@pytest.mark.parametrize("shape,w_kind,lr", [
    ((2, 40, 2, 64, 64), "rwkv7", "rwkv"),    # RWKV-7's decays
    ((1, 48, 1, 64, 64), "u5", "rwkv"),       # decays in U(-5, 0): chunk totals near -40
    ((1, 48, 1, 64, 64), "zero", "repeated"),  # X from cancelling terms
    ((1, 45, 1, 64, 64), "mixedinf", "rwkv"),  # -inf and strong decays: the exact pair walks
    ((1, 50, 1, 64, 64), "edge60", "rwkv"),    # chunk totals about the bound: both forms
], ids=["rwkv7", "u5", "repeated", "mixedinf", "edge60"])
def test_chunk_rwkv7_backward_kernel_gradients(descending, shape, w_kind, lr, gen):
    """The backward kernel under construction, its second step: given every chunk-start state
    (fp32, at chunk_slot's slots, from the CPU op run on each prefix), the state-side products,
    the sums over the value columns from each warp's partials and the K-vector gradients in the
    factored forms give every gradient within the bf16 tolerance of the CPU op's (dw at 5x, as
    every chunk_rwkv7 test), warps descending, outputs poisoned; chunks past the factoring bound
    (-inf decays, totals below -60) through the exact pair walks."""
    B, T, H, K, V = shape
    ins, h0, do, dht, grads, cu_e = _rwkv7_backward_case(shape, w_kind, None, lr, gen)
    nch = (T + 15) // 16
    hst = torch.full((B, nch + 1, H, K, V), float("nan"))  # chunk_slot: n (nch + 1) + c
    with torch.no_grad():
        for c in range(nch):
            hst[:, c] = h0 if c == 0 else chunk_rwkv7(*(t[:, :16 * c] for t in ins), scale=0.7, initial_state=h0,
                                                      output_final_state=True)[1]
    _check_all_grads(descending.run_single_pass_backward(*ins, h0, do, dht, hst.reshape(-1, H, K, V), 0.7, cu_e, False),
                     grads)


@pytest.mark.parametrize("descending", ["emu"], indirect=True)
@pytest.mark.parametrize("shape,w_kind,cu,lr", [
    ((2, 150, 2, 64, 64), "rwkv7", None, "rwkv"),      # 10 chunks
    ((1, 130, 1, 64, 64), "mixedinf", None, "rwkv"),   # the exact pair walks, 9 chunks
    ((1, 200, 1, 64, 64), "u5", [0, 7, 7, 90, 200], "rwkv"),  # varlen, an empty sequence
    # w every other element of a wider tensor: strides not r's, and the element loads
    ((1, 70, 2, 64, 64), "rwkv7", None, "strided"),
], ids=["rwkv7", "mixedinf", "varlen", "strided"])
def test_chunk_rwkv7_backward_kernel_on_kept_states(descending, shape, w_kind, cu, lr, gen):
    """The single-pass backward on the states the fused training forward keeps for it: every
    chunk's start state as scaled fp16 (DplrKept::f16_states; every float of them written), read
    as they are. Every gradient within the bf16 tolerance of the CPU op's (dw at 5x), warps
    descending, outputs poisoned."""
    strided = lr == "strided"
    ins, h0, do, dht, grads, cu_e = _rwkv7_backward_case(shape, w_kind, cu, "rwkv" if strided else lr, gen)
    if strided:
        ins[1] = _every_other_element(ins[1])
    _check_all_grads(descending.run_single_pass_backward(*ins, h0, do, dht, torch.empty(0), 0.7, cu_e, True), grads)


def test_f16_state_record_roundtrip(emu, gen):
    """The single pass's fp16 chunk-start states (dplr_f16_states.cuh): each 16-column block is
    stored as fp16 times the power of two that puts its largest magnitude in [2^14, 2^15) and
    loaded back exactly as those values: blocks of very different magnitudes (1e-30, 1, 1e30),
    an all-zero block, and one whose largest magnitude is an exact power of two (the scale's
    edge); elements down to 2^-24 of their block's largest keep fp16's 11 bits."""
    S = torch.randn(64, 64, generator=gen)
    S[:, 0:16] *= 1e-30
    S[:, 16:32] = 0.0
    S[:, 32:48] *= 1e30
    S[:, 48:64] /= S[:, 48:64].abs().max()
    S[5, 50] = -1.0  # the block's largest is exactly 2^0
    S[7, 51] = 2.0 ** -20  # 2^-20 of it: still a normal fp16 after the scale
    back, inv = emu.f16_state_roundtrip(S)
    for blk in range(4):
        cols = slice(16 * blk, 16 * blk + 16)
        amax = S[:, cols].abs().max().item()
        if amax == 0.0:
            assert inv[blk].item() == 1.0 and (back[:, cols] == 0).all()
            continue
        scale = 2.0 ** (14 - math.floor(math.log2(amax)))
        assert inv[blk].item() == 1.0 / scale, f"block {blk}: scale"
        expect = ((S[:, cols].double() * scale).half().double() / scale).float()
        assert torch.equal(back[:, cols], expect), f"block {blk}: values"
        small = S[:, cols].abs() >= amax * 2.0 ** -24
        rel = ((back[:, cols] - S[:, cols]).abs() / S[:, cols].abs())[small]
        assert rel.max().item() <= 2.0 ** -11, f"block {blk}: 11 bits"
    assert back[7, 51].item() == 2.0 ** -20 and back[5, 50].item() == -1.0


def check(emu, shape, w_kind, cu, gen, dtype, tol, lr="rwkv", strided=False):
    B = shape[0]
    N = len(cu) - 1 if cu else B
    *ins, h0 = make(*shape, dtype, "cpu", gen, w_kind=w_kind, N=N, lr=lr)
    if strided:  # w as a view with its own row stride: each K-row copy forms its own offsets
        wide = torch.zeros(*ins[1].shape[:-1], 2 * ins[1].shape[-1], dtype=dtype)
        wide[..., :ins[1].shape[-1]] = ins[1]
        ins[1] = wide[..., :ins[1].shape[-1]]
    cu_t = torch.tensor(cu) if cu else None
    xs = [t.clone().requires_grad_(True) for t in ins + [h0]]
    o, ht = chunk_rwkv7(*xs[:6], scale=0.7, initial_state=xs[6], output_final_state=True,
                        cu_seqlens=cu_t)
    do = torch.randn(o.shape, generator=gen).to(dtype)
    dht = torch.randn(ht.shape, generator=gen)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), xs)
    none, cu_e = torch.empty(0), cu_t if cu else torch.empty(0, dtype=torch.int64)
    eo, eht = emu.run(*ins, h0, none, none, 0.7, cu_e, 0)
    assert_close("o", eo, o.detach(), tol, 1e-6)
    assert_close("ht", eht, ht.detach(), tol, 1e-6)
    eg = emu.run(*ins, h0, do, dht, 0.7, cu_e, 0)
    for name, x, y in zip(["r", "w", "k", "v", "a", "b", "h0"], eg, grads):
        assert_close(f"d{name}", x, y, 5 * tol if name == "w" else tol, 1e-6)
    # The two-kernel training forward's kept states and workspace (chunk_rwkv7_train): the same
    # gradients, bitwise; so is its backward in windows of two chunks (dhst per window).
    for x, y in zip(emu.run(*ins, h0, do, dht, 0.7, cu_e, 1), eg):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    if cu is None:
        for x, y in zip(emu.run(*ins, h0, do, dht, 0.7, cu_e, 4), eg):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        # The pipelined windows (keep 7): the forward in windows of two chunks, the state carried
        # between them, and the backward's windows on two dhst buffers in turn: bitwise the same.
        for x, y in zip(emu.run(*ins, h0, none, none, 0.7, cu_e, 7), (eo, eht)):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        for x, y in zip(emu.run(*ins, h0, do, dht, 0.7, cu_e, 7), eg):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    if dtype == torch.bfloat16 and shape[3] == shape[4] == 64:
        check_fused_kept(emu, ins, h0, do, dht, cu_e, grads, tol)


def check_fused_kept(emu, ins, h0, do, dht, cu_e, grads, tol):
    """The fused training forward's kept states (DplrKept::states): the fused kernel stores every
    fourth chunk-start state and the final ones into a poisoned hst (every slot written), and the
    backward runs the fused reverse pass (dS+, the pair matrices and X into poisoned buffers),
    then grad, whose CTAs make the states between. Its states come
    from single-TF32 pair matrices and its chain's products are its own, so the gradients match
    the reference at the bf16 tolerance, not bitwise. Without cu_seqlens also the backward in
    windows of the chunk index (DplrChunkPass::window_chunks): bitwise equal to one pass."""
    def kept_run(keep, windowed, what):
        """The backward on what forward `keep` kept against the reference at the bf16
        tolerance; without cu_seqlens, in windows (`windowed`) bitwise equal to one pass."""
        eg = emu.run(*ins, h0, do, dht, 0.7, cu_e, keep)
        for name, x, y in zip(["r", "w", "k", "v", "a", "b", "h0"], eg, grads):
            assert_close(f"d{name} ({what})", x, y, 5 * tol if name == "w" else tol, 1e-6)
        if cu_e.numel() == 0:
            for x, y in zip(emu.run(*ins, h0, do, dht, 0.7, cu_e, windowed), eg):
                torch.testing.assert_close(x, y, rtol=0, atol=0)

    # The two-block forward keeping the states and prep's workspace (a training forward at about
    # one pair per SM): the two-kernel path's backward on them.
    kept_run(5, 6, "two-block forward's states and workspace")
    # the one-block kernels; the two-block reverse pass (two CTAs per SM); both two-block
    # kernels at one CTA per SM (the forward storing the strided states from its steps' warps)
    for ctas in (4, 2, 1):
        emu.set_fused_ctas(ctas)
        try:
            kept_run(2, 3, f"fused forward's states, {ctas} CTAs an SM")
        finally:
            emu.set_fused_ctas(4)
    if cu_e.numel() == 0:
        # The same strided states from the two-kernel forward in windows (its sweep stores them,
        # prep's workspace per window): the backward runs prep and the reverse sweep in place of
        # the fused reverse pass, grad reading prep's pair matrices (DplrChunkPass::
        # sweep_strided_states); in one pass, then in windows on two buffers in turn.
        kept_run(8, 9, "the forward sweep's strided states")

# The chunk engine: K <= 64 and K = 128 take the state kernel that forms o (one or two K tiles
# per CTA), K = 136 the state kernel per K tile plus the out kernel; partial chunks, V not a
# multiple of 32 (zeta partials), varlen with an empty sequence; keep: the forward writes hst
# for the backward, else the backward rebuilds it (and an inference forward keeps none). gla_gv
# (a value-side decay: the transposed pass; its forward forms o with grad_qk's dq-only form)
# keeps hst alone.
CHUNK_CASES = [((1, 70, 2, 32, 24), None, True), ((1, 65, 1, 128, 20), None, False),
               ((1, 40, 1, 136, 8), None, True), ((1, 150, 1, 16, 100), [0, 70, 70, 150], False)]


@pytest.mark.parametrize("fam", [GLA, RWKV6, GLA_GV], ids=["gla", "rwkv6", "gla_gv"])
@pytest.mark.parametrize("shape,cu,keep", CHUNK_CASES, ids=["K32", "K128", "K136", "varlen"])
def test_chunk_kernels(chunk_emu, fam, shape, cu, keep, gen):
    check_chunk(chunk_emu, fam, shape, cu, keep, gen, torch.float32, 1e-5)


@pytest.mark.parametrize("fam", [GLA, RWKV6], ids=["gla", "rwkv6"])
@pytest.mark.parametrize("shape,cu", [((1, 70, 2, 32, 24), None), ((1, 65, 1, 128, 20), None),
                                      ((1, 150, 1, 16, 100), [0, 70, 70, 150]),
                                      ((1, 70, 1, 32, 70), None)],
                         ids=["K32", "K128", "varlen", "V70"])
def test_chunk_kernels_split_out(chunk_emu, fam, shape, cu, gen):
    """A training forward at K <= 128 with o split off the state kernel (chunk_split_out: few
    CTAs on the GPU): the state kernel per K tile writes hst, the out kernel forms o. V = 70:
    two V tiles per out CTA, the second partial and odd (a ragged state row: 70 floats), in the
    forward's o and the backward's dv."""
    chunk_emu.set_split_out(True)
    try:
        check_chunk(chunk_emu, fam, shape, cu, True, gen, torch.float32, 1e-5)
    finally:
        chunk_emu.set_split_out(False)


@pytest.mark.parametrize("fam", [GLA, RWKV6, GLA_GV], ids=["gla", "rwkv6", "gla_gv"])
@pytest.mark.parametrize("shape,cu,split,keep", [
    ((2, 300, 1, 32, 24), None, False, True), ((1, 290, 1, 136, 70), None, False, True),
    ((1, 300, 2, 32, 24), None, True, True), ((2, 300, 1, 32, 24), None, False, False),
    ((1, 420, 1, 32, 24), [0, 0, 300, 301, 420], False, True),
    ((1, 420, 1, 32, 24), [0, 190, 190, 420], False, False),
    ((1, 290, 1, 128, 70), None, False, False), ((1, 290, 1, 128, 70), None, True, True)],
    ids=["with_o", "K136", "split", "recomputed", "varlen", "varlen_recomputed", "K128_with_o",
         "K128_split"])
def test_chunk_kernels_windows(chunk_emu, fam, shape, cu, split, keep, gen):
    """The state kernel's walks in windows of two chunks (ChunkPass::window_chunks; T = 290-300:
    three windows, the last partial): the first walk of each window from a zero state, the
    hand-over through window_states (poisoned) and the flags, the second walk
    from the true start state; with o formed in the walk (K = 32; K = 128 over both K tiles, as an
    inference forward runs it), per K tile (K = 136, two V tiles), o split off (K = 128 as a
    training forward runs it), and the backward's recomputed states (keep off); with cu_seqlens (windows
    for ceil(T / 64) chunks, those past a sequence's end idle; empty sequences, whose final state
    window 0 writes, and a sequence of one row). The value-side pass
    (gla_gv) walks its transposed states the same way. Weak decays (near0: e^-6 over a window), so that the state handed over
    matters: the stress regimes' decays leave nothing of it after 128 rows."""
    chunk_emu.set_window_chunks(2)
    chunk_emu.set_split_out(split)
    try:
        check_chunk(chunk_emu, fam, shape, cu, keep, gen, torch.float32, 1e-5, w_kind="near0")
    finally:
        chunk_emu.set_window_chunks(0)
        chunk_emu.set_split_out(False)


@pytest.mark.parametrize("fam", [GLA, RWKV6, GLA_GV], ids=["gla", "rwkv6", "gla_gv"])
@pytest.mark.parametrize("shape", [(1, 70, 2, 32, 24), (1, 50, 1, 20, 12)], ids=["pieces", "K20"])
def test_chunk_kernels_bf16(chunk_emu, fam, shape, gen):
    """bf16 tiles in 16-byte pieces (K, V multiples of 8) or element by element (K = 20) and the
    TF32 products; the reference gets the same bf16 values (fp32 math)."""
    check_chunk(chunk_emu, fam, shape, None, True, gen, torch.bfloat16, 1e-2)


@pytest.mark.parametrize("fam", [GLA, GLA_GV], ids=["gla", "gla_gv"])
@pytest.mark.parametrize("shape", [(1, 70, 2, 32, 24), (1, 40, 1, 136, 8)], ids=["K32", "K136"])
def test_chunk_kernels_acc_outputs(chunk_emu, fam, shape, gen):
    """o and dq written in float32 (ChunkPass o_acc / dq_acc: GSA's ok and dp) by every kernel
    that forms them (state kernel, out kernel at K > 128, grad_qk, the value-side transposed
    pass); the reference is the CPU backend with a wide (float32) q, same bf16 values."""
    check_chunk(chunk_emu, fam, shape, None, True, gen, torch.bfloat16, 1e-2, acc=True)


@pytest.mark.parametrize("descending", ["chunk_emu"], indirect=True)
@pytest.mark.parametrize("fam", [GLA, GLA_GV], ids=["gla", "gla_gv"])
def test_chunk_kernels_descending_warps(descending, fam, gen):
    check_chunk(descending, fam, (1, 70, 2, 32, 24), None, True, gen, torch.bfloat16, 1e-2)


def check_chunk(emu, fam, shape, cu, keep, gen, dtype, tol, acc=False, w_kind="mixedinf"):
    B, T, H, K, V = shape
    N = len(cu) - 1 if cu else B
    x = fam.make(B, T, H, K, V, dtype, "cpu", gen, N=N, w_kind=w_kind)
    names = list(fam.args)
    xs = [x[n].clone().requires_grad_(True) for n in names] + [x["h0"].clone().requires_grad_(True)]
    if acc:  # a wide q: o and dq in float32
        xs[0] = x[names[0]].float().requires_grad_(True)
    cu_t = torch.tensor(cu) if cu else None
    o, ht = fam.modes["chunk"](*xs[:-1], scale=0.7, initial_state=xs[-1], output_final_state=True,
                               cu_seqlens=cu_t)
    do = torch.randn(o.shape, generator=gen).to(dtype)
    dht = torch.randn(ht.shape, generator=gen)
    grads = dict(zip(names + ["h0"], torch.autograd.grad((o * do).sum() + (ht * dht).sum(), xs)))
    q, k, v, g = (x[n] for n in names[:4])
    u = x["u"] if "u" in x else torch.empty(0)
    none, cu_e = torch.empty(0), cu_t if cu else torch.empty(0, dtype=torch.int64)
    vside = fam is GLA_GV
    eo, eht = emu.run(q, k, v, g, u, x["h0"], none, none, 0.7, cu_e, keep, vside, acc, False, False)
    assert eo.dtype == (torch.float32 if acc else dtype)
    assert_close("o", eo, o.detach(), tol, 1e-6)
    assert_close("ht", eht, ht.detach(), tol, 1e-6)
    if vside and not acc and shape[4] <= 64:
        # o's rows through their softmax in the kernel (GSA's slot weights, ChunkPass::o_softmax):
        # the fp32 weights against torch's softmax of the plain o, o their rounding.
        so, sht, w = emu.run(q, k, v, g, u, x["h0"], none, none, 0.7, cu_e, keep, vside, acc, False,
                             True)
        torch.testing.assert_close(sht, eht, rtol=0, atol=0)
        assert_close("softmax(o)", w, torch.softmax(eo.float(), -1),
                     1e-6 if dtype == torch.float32 else tol, 1e-7)
        torch.testing.assert_close(so, w.to(dtype), rtol=0, atol=0)
    eg = emu.run(q, k, v, g, u, x["h0"], do, dht, 0.7, cu_e, keep, vside, acc, False, False)
    assert eg[0].dtype == (torch.float32 if acc else dtype)
    for name, e in zip(names[:4] + ["u", "h0"], eg):
        if name in grads:
            decay = name == fam.decay
            assert_close(f"d{name}", e, grads[name], 5 * tol if decay else tol, 1e-6)
    # dk, dv and dg added into tensors that hold values (ChunkPass *_adds; GSA's ds and dg):
    # the sum rounded once, so in fp32 bitwise the same gradients plus what was there.
    ea = emu.run(q, k, v, g, u, x["h0"], do, dht, 0.7, cu_e, keep, vside, acc, True, False)
    for i, (name, e, a) in enumerate(zip(names[:4] + ["u", "h0"], eg, ea)):
        if i not in (1, 2, 3):
            torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)
            continue
        before = torch.linspace(-1, 1, e.numel(), dtype=torch.double).reshape(e.shape).to(e.dtype)
        if dtype == torch.float32:
            torch.testing.assert_close(a, before + e, rtol=0, atol=0)
        else:  # a rounds x + before once, e rounds x: each by at most 2^-8 of its size
            want, a, size = before.float() + e.float(), a.float(), before.float().abs() + e.float().abs()
            assert ((a - want).abs() <= 2.0 ** -7 * size).all(), f"d{name} added"
    if fam is GLA and not acc and shape[3] <= 64:
        # dq's rows through a softmax's backward in the kernel (GSA's dok, ChunkPass::dq_softmax_w):
        # against the formula on the plain dq (in fp32, the plain dq's values; bf16: its rounding,
        # so at the bf16 tolerance); every other gradient bitwise the plain one.
        *es, w = emu.run(q, k, v, g, u, x["h0"], do, dht, 0.7, cu_e, keep, vside, acc, False, True)
        for e, a in zip(eg[1:], es[1:]):
            torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)
        dq = eg[0].float()
        want = w * (dq - (w * dq).sum(-1, keepdim=True))
        assert es[0].dtype == dtype
        assert_close("softmax backward of dq", es[0], want, 1e-6 if dtype == torch.float32 else tol, 1e-7)
