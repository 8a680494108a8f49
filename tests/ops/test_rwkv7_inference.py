"""chunk_rwkv7's inference forward (a forward that keeps nothing for a backward):
* on CUDA with bf16 / fp16 and K = V = 64, the fused kernel (kernels/dplr_chunk_fused.cuh: one CTA
  per sequence and head, no workspace), which a training forward takes too, storing the
  chunk-start states for its backward;
* on CUDA for few (sequence, head) pairs and long sequences, the two-kernel engine in windows of
  the chunk index on two streams, two windows' workspace in turn (within FLA_EXT_WORKSPACE_MIB
  when it is set);
* otherwise the engine in windows of the time axis (csrc/ops/chunk_rwkv7.cpp) whenever one pass
  would take more workspace than FLA_EXT_WORKSPACE_MIB (default: the larger of 64 MiB and 32
  states per sequence). Budget 0 gives the smallest windows (one chunk, or a few sequences), so
  every cut kind shows: sequences cut once and many times, windows of several sequences, empty
  sequences, a window of empty sequences only. CPU and CUDA (the same windows run on both)."""
import pytest
import torch

from conftest import DEVICES, HAS_CUDA, TOL, assert_close
from fla_ext import chunk_rwkv7, reference
from rwkv7_cases import CHUNK, make, run_and_check

CASES = {  # (B, T, H, K, V), cu_seqlens
    "dense": ((2, 100, 2, 32, 20), None),
    "dense_T16": ((1, 48, 1, 16, 8), None),
    "varlen": ((1, 150, 2, 24, 40), [0, 7, 7, 40, 41, 150]),
    "varlen_empty_tail": ((1, 90, 1, 16, 16), [0, 50, 90, 90, 90]),
    "varlen_many_short": ((1, 40, 1, 8, 8), [0, 1, 2, 3, 5, 8, 13, 21, 34, 40]),
}


@pytest.fixture
def windows(monkeypatch):
    monkeypatch.setenv("FLA_EXT_WORKSPACE_MIB", "0")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("head_first", [False, True], ids=["bthd", "head_first"])
@pytest.mark.parametrize("h0_on", [True, False], ids=["h0", "no_h0"])
def test_windows_match_oracle(device, case, head_first, h0_on, windows, monkeypatch, gen):
    """o and the final states of a windowed no-grad forward equal the float64 oracle (fp32, 1e-5)
    and the one-pass forward."""
    shape, cu = CASES[case]
    if cu is not None and head_first:
        pytest.skip("varlen takes [1, T, H, D]")
    N = len(cu) - 1 if cu else shape[0]
    r, w, k, v, a, b, h0 = make(*shape, torch.float32, device, gen, w_kind="mixedinf", N=N,
                                head_first=head_first, h0=h0_on)
    cu_t = torch.tensor(cu, device=device) if cu else None
    with torch.no_grad():
        o, ht = chunk_rwkv7(r, w, k, v, a, b, initial_state=h0, output_final_state=True,
                            cu_seqlens=cu_t, head_first=head_first)
    o_ref, ht_ref = reference.rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=h0, cu_seqlens=cu_t,
                                    head_first=head_first)
    tol, _, atol = TOL[torch.float32]
    assert_close("o", o, o_ref, tol, atol)
    assert_close("ht", ht, ht_ref, tol, atol)
    # the one-pass forward: the windows restart the chunks at the same rows
    monkeypatch.delenv("FLA_EXT_WORKSPACE_MIB")
    with torch.no_grad():
        o1, ht1 = chunk_rwkv7(r, w, k, v, a, b, initial_state=h0, output_final_state=True,
                              cu_seqlens=cu_t, head_first=head_first)
    assert_close("o vs one pass", o, o1, 1e-6, 1e-7)
    assert_close("ht vs one pass", ht, ht1, 1e-6, 1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_windows_bf16_without_final_state(device, windows, gen):
    r, w, k, v, a, b, h0 = make(2, 70, 2, 64, 64, torch.bfloat16, device, gen, N=2)
    with torch.no_grad():
        o, ht = chunk_rwkv7(r, w, k, v, a, b, initial_state=h0)
    assert ht is None
    tol, _, atol = TOL[torch.bfloat16]
    assert_close("o", o, reference.rwkv7(r, w, k, v, a, b, initial_state=h0)[0], tol, atol)


@pytest.mark.parametrize("device", DEVICES)
def test_training_under_windows(device, windows, gen):
    """A call that records a backward is unchanged by the budget: forward and every gradient."""
    r, w, k, v, a, b, h0 = make(1, 90, 2, 16, 24, torch.float32, device, gen, N=3)
    cu = torch.tensor([0, 33, 33, 90], device=device)
    run_and_check(CHUNK, r, w, k, v, a, b, h0, scale=1.0, cu=cu, gen=gen)


def test_budget_variable_is_checked(monkeypatch, gen):
    r, w, k, v, a, b, _ = make(1, 20, 1, 8, 8, torch.float32, "cpu", gen, h0=False)
    for bad in ("abc", "-1", "1.5"):
        monkeypatch.setenv("FLA_EXT_WORKSPACE_MIB", bad)
        with pytest.raises(ValueError, match="FLA_EXT_WORKSPACE_MIB"):
            chunk_rwkv7(r, w, k, v, a, b)


def _no_grad_peak(r, w, k, v, a, b, h0):
    """o, the final state and the peak memory a CUDA no-grad forward allocates beyond what was
    allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        o, ht = chunk_rwkv7(r, w, k, v, a, b, initial_state=h0, output_final_state=True)
    torch.cuda.synchronize()
    return o, ht, torch.cuda.max_memory_allocated() - base


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_inference_memory_does_not_grow_with_T(monkeypatch, gen):
    """The no-grad forward's peak extra memory is the output plus the budget and a few states
    (one pass would take ~16x the output in workspaces here)."""
    monkeypatch.setenv("FLA_EXT_WORKSPACE_MIB", "4")
    B, T, H, K, V = 1, 16384, 4, 64, 64
    r, w, k, v, a, b, h0 = make(B, T, H, K, V, torch.bfloat16, "cuda", gen, N=B)
    o, ht, extra = _no_grad_peak(r, w, k, v, a, b, h0)
    state = B * H * K * V * 4
    assert extra <= o.numel() * o.element_size() + (4 << 20) + 8 * state + (1 << 20), extra
    # the windows' values are checked against the oracle above; here against one pass
    monkeypatch.delenv("FLA_EXT_WORKSPACE_MIB")
    with torch.no_grad():
        o1, ht1 = chunk_rwkv7(r, w, k, v, a, b, initial_state=h0, output_final_state=True)
    assert_close("o vs one pass", o, o1, 1e-2, 1e-2)
    assert_close("ht vs one pass", ht, ht1, 1e-5, 1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_pipelined_inference_memory_does_not_grow_with_T(monkeypatch, gen):
    """Few pairs and long sequences (B = 1, H = 4, K = V = 64, the default settings): the no-grad
    forward runs in windows of 64 chunks on two streams, two windows' workspace in turn. Its
    peak extra memory beyond o is the same at T = 8192 and 16384, and at most those two windows'
    workspace (W, Q~, K^, B^, gamma, the pair matrices and X, U0 / O0: 8320 floats per chunk and
    head) and a few states; o and the final state bitwise equal to the windows of the time
    axis (FLA_EXT_RWKV7_PIPELINE=0)."""
    B, H, K = 1, 4, 64
    state = B * H * K * K * 4
    ring = 2 * 64 * B * H * 8320 * 4
    extras = []
    for T in (8192, 16384):
        r, w, k, v, a, b, h0 = make(B, T, H, K, K, torch.bfloat16, "cuda", gen, N=B)
        runs = []
        for mode in ("", "0"):
            monkeypatch.setenv("FLA_EXT_RWKV7_PIPELINE", mode)
            o, ht, extra = _no_grad_peak(r, w, k, v, a, b, h0)
            if mode == "":
                extras.append(extra - o.numel() * o.element_size())
            runs.append((o, ht))
        for x, y in zip(*runs):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert abs(extras[1] - extras[0]) <= 1 << 20, extras
    assert extras[1] <= ring + 8 * state + (1 << 20), (extras, ring)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("B,H", [(0, 2), (1, 0)], ids=["B0", "H0"])
@pytest.mark.parametrize("budget", ["", "4"], ids=["default_budget", "budget_4mib"])
def test_long_sequences_without_pairs(B, H, budget, monkeypatch):
    """No (sequence, head) pair but sequences long enough for the pipelined windows (T = 8192):
    the windows' budget check once divided by their zero workspace size (a crash with
    FLA_EXT_WORKSPACE_MIB set). The inference and training forwards and the backward return
    empty outputs of the right shapes."""
    if budget:
        monkeypatch.setenv("FLA_EXT_WORKSPACE_MIB", budget)
    T, K = 8192, 64
    x = [torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    x[1] = -torch.rand(B, T, H, K, device="cuda").to(torch.bfloat16)
    h0 = torch.randn(B, H, K, K, device="cuda")
    with torch.no_grad():
        o, ht = chunk_rwkv7(*x, initial_state=h0, output_final_state=True)
    assert o.shape == (B, T, H, K) and ht.shape == (B, H, K, K)
    ins = [t.clone().requires_grad_(True) for t in x + [h0]]
    o, ht = chunk_rwkv7(*ins[:6], initial_state=ins[6], output_final_state=True)
    grads = torch.autograd.grad((o.float().sum() + ht.sum()), ins, allow_unused=True)
    torch.cuda.synchronize()
    for g, t in zip(grads, ins):
        assert g is None or g.shape == t.shape


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_windows_check_device_cu_seqlens(windows, gen):
    """Windows read cu_seqlens on the host, so a malformed GPU one is an error there."""
    r, w, k, v, a, b, _ = make(1, 40, 1, 8, 8, torch.float32, "cuda", gen, h0=False)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_rwkv7(r, w, k, v, a, b, cu_seqlens=torch.tensor([0, 30, 20, 40], device="cuda"))


def _big_gpu():
    return HAS_CUDA and torch.cuda.get_device_properties(0).total_memory > 60 * 2**30


@pytest.mark.cuda
@pytest.mark.skipif(not _big_gpu(), reason="needs a CUDA device with > 60 GiB")
def test_inputs_over_2_31_elements():
    """Inputs of more than 2^31 elements (bf16, B = 1, T ~ 2^20, H = 32, K = V = 64): the no-grad
    forward runs in windows (one pass would ask for ~70 GB of workspace) and equals the same
    forward run as two halves chained through the state."""
    B, H, K = 1, 32, 64
    T = 2**31 // (H * K) + 16
    dt = torch.bfloat16

    def randn():
        return torch.randn(B, T, H, K, device="cuda", dtype=dt)
    r, k, v = randn(), randn(), randn()
    w = randn().sigmoid_().mul_(-0.6065)
    a = torch.nn.functional.normalize(randn(), dim=-1).neg_()
    b = (-a) * torch.rand(B, T, H, K, device="cuda", dtype=dt)
    assert r.numel() > 2**31
    with torch.no_grad():
        o, ht = chunk_rwkv7(r, w, k, v, a, b, output_final_state=True)
        half = T // 2 // 16 * 16
        parts = [x[:, :half] for x in (r, w, k, v, a, b)]
        o1, h1 = chunk_rwkv7(*parts, output_final_state=True)
        parts = [x[:, half:] for x in (r, w, k, v, a, b)]
        o2, h2 = chunk_rwkv7(*parts, initial_state=h1, output_final_state=True)
    for name, x, y in [("o head", o[:, :64], o1[:, :64]), ("o cut", o[:, half:half + 64], o2[:, :64]),
                       ("o tail", o[:, -64:], o2[:, -64:]), ("ht", ht, h2)]:
        assert_close(name, x, y, 1e-3, 1e-3)
    assert torch.isfinite(o[:, ::4096]).all()


FUSED_CASES = {  # (B, T, H, K, V), cu_seqlens, w_kind, lr
    "rwkv7": ((2, 100, 3, 64, 64), None, "rwkv7", "rwkv"),
    "mixedinf": ((1, 90, 2, 64, 64), None, "mixedinf", "rwkv"),
    "varlen": ((1, 150, 2, 64, 64), [0, 7, 7, 40, 41, 150], "u5", "rwkv"),
    # X from cancelling binomial-size terms, and the fused kernel's pair matrices single TF32
    "repeated": ((1, 64, 2, 64, 64), None, "zero", "repeated"),
    # 32 chunks: grad makes three states of every four from the kept one before them
    "long": ((2, 512, 2, 64, 64), None, "rwkv7", "rwkv"),
    # the launch's builds by (sequence, head) pairs on 132 SMs: the cases above take the two-block
    # kernels' one-CTA-per-SM build; 200 pairs their two-per-SM build; 300 and 420 the one-block
    # kernels at three and at four CTAs per SM
    "wide2": ((1, 40, 200, 64, 64), None, "rwkv7", "rwkv"),
    "wide3": ((1, 40, 300, 64, 64), None, "rwkv7", "rwkv"),
    "wide4": ((2, 40, 210, 64, 64), None, "rwkv7", "rwkv"),
}


def fused_case(case, head_first, dtype, gen):
    """The inputs (r, w, k, v, a, b, h0) of a FUSED_CASES entry on CUDA, and its cu_seqlens."""
    shape, cu, w_kind, lr = FUSED_CASES[case]
    if cu is not None and head_first:
        pytest.skip("varlen takes [1, T, H, D]")
    N = len(cu) - 1 if cu else shape[0]
    ins = make(*shape, dtype, "cuda", gen, w_kind=w_kind, N=N, head_first=head_first, lr=lr)
    return ins, torch.tensor(cu, device="cuda") if cu else None


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", list(FUSED_CASES))
@pytest.mark.parametrize("head_first", [False, True], ids=["bthd", "head_first"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_forward_matches_oracle(case, head_first, dtype, monkeypatch, gen):
    """The fused no-grad forward (forced: these shapes have fewer (sequence, head) pairs than the
    op's threshold) equals the float64 oracle (bf16 / fp16 tolerance) and the training forward
    (prep and the sweep) on the same inputs."""
    monkeypatch.setenv("FLA_EXT_RWKV7_FUSED", "1")
    (r, w, k, v, a, b, h0), cu_t = fused_case(case, head_first, dtype, gen)
    kw = dict(scale=0.7, initial_state=h0, output_final_state=True, cu_seqlens=cu_t,
              head_first=head_first)
    with torch.no_grad():
        o, ht = chunk_rwkv7(r, w, k, v, a, b, **kw)
    o_ref, ht_ref = reference.rwkv7(r, w, k, v, a, b, scale=0.7, initial_state=h0, cu_seqlens=cu_t,
                                    head_first=head_first)
    tol, _, atol = TOL[dtype]
    assert_close("o", o, o_ref, tol, atol)
    assert_close("ht", ht, ht_ref, tol, atol)
    monkeypatch.setenv("FLA_EXT_RWKV7_FUSED", "0")
    ins = [x.clone().requires_grad_(True) for x in (r, w, k, v, a, b)]
    o2, ht2 = chunk_rwkv7(*ins, **kw)  # the two-kernel training forward (prep and the sweep)
    assert_close("o vs training forward", o, o2.detach(), tol, atol)
    assert_close("ht vs training forward", ht, ht2.detach(), tol, atol)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", list(FUSED_CASES))
@pytest.mark.parametrize("head_first", [False, True], ids=["bthd", "head_first"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_training_forward_matches_oracle(case, head_first, dtype, monkeypatch, gen):
    """The fused training forward (forced; at most one pair per SM its two-block build, whose
    steps' warps store the states) stores the state before every fourth chunk and the final one
    (kDplrStateStride), and the backward runs the fused reverse pass and grad on them
    (DplrKept::states: grad makes the states between): o, the final state and every gradient
    against the float64 oracle (bf16 / fp16 tolerances), `saved` holding those states alone,
    every float written. (The single pass off: from 256 pairs it would take the backward, on
    fp16 states.)"""
    monkeypatch.setenv("FLA_EXT_RWKV7_FUSED", "1")
    monkeypatch.setenv("FLA_EXT_RWKV7_SINGLE_PASS", "0")
    (r, w, k, v, a, b, h0), cu_t = fused_case(case, head_first, dtype, gen)
    _, _, saved = torch.ops.fla.chunk_rwkv7_train(r, w, k, v, a, b, 0.7, h0, True, cu_t, head_first)
    N, T = h0.shape[0], r.shape[-2 if head_first else -3]
    H, K, V = (r.shape[1] if head_first else r.shape[2]), r.shape[-1], v.shape[-1]
    slots = (T // 64 + 2 * N + 1) if cu_t is not None else N * ((T + 63) // 64 + 1)  # 64-row map
    assert saved.numel() == (slots * H * K * V + 3) // 4 * 4  # the kept states alone
    assert torch.isfinite(saved).all()
    run_and_check(CHUNK, r, w, k, v, a, b, h0, scale=0.7, cu=cu_t, head_first=head_first, gen=gen)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", ["rwkv7", "mixedinf", "varlen", "repeated", "long"])
@pytest.mark.parametrize("head_first", [False, True], ids=["bthd", "head_first"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_single_pass_backward_matches_oracle(case, head_first, dtype, monkeypatch, gen):
    """The single-pass backward (the default from 256 pairs; forced here with
    FLA_EXT_RWKV7_SINGLE_PASS=1 on every shape; benchmarks/NOTES.md c67, c70) on the fused training
    forward's fp16 states: o, the final state and every gradient against the float64 oracle at
    the 16-bit tolerances."""
    monkeypatch.setenv("FLA_EXT_RWKV7_FUSED", "1")
    monkeypatch.setenv("FLA_EXT_RWKV7_SINGLE_PASS", "1")
    (r, w, k, v, a, b, h0), cu_t = fused_case(case, head_first, dtype, gen)
    run_and_check(CHUNK, r, w, k, v, a, b, h0, scale=0.7, cu=cu_t, head_first=head_first, gen=gen)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_single_pass_is_the_default_from_256_pairs(monkeypatch, gen):
    """With no setting, a 16-bit K = V = 64 training forward at 256 or more (sequence, head) pairs
    keeps every chunk's start state as fp16 (DplrF16States: 2052 floats a slot and head) for the
    single-pass backward; FLA_EXT_RWKV7_SINGLE_PASS=0 gives the fp32 state of every fourth chunk
    (the two-kernel backward). Both backwards against the float64 oracle."""
    monkeypatch.delenv("FLA_EXT_RWKV7_FUSED", raising=False)
    (r, w, k, v, a, b, h0), _ = fused_case("wide3", False, torch.bfloat16, gen)  # 300 pairs
    N, T, H = h0.shape[0], r.shape[1], r.shape[2]
    for setting, floats in [(None, N * ((T + 15) // 16 + 1) * H * 2052),
                            ("0", (N * ((T + 63) // 64 + 1) * H * 64 * 64 + 3) // 4 * 4)]:
        if setting is None:
            monkeypatch.delenv("FLA_EXT_RWKV7_SINGLE_PASS", raising=False)
        else:
            monkeypatch.setenv("FLA_EXT_RWKV7_SINGLE_PASS", setting)
        _, _, saved = torch.ops.fla.chunk_rwkv7_train(r, w, k, v, a, b, 0.7, h0, True, None, False)
        assert saved.numel() == floats
        run_and_check(CHUNK, r, w, k, v, a, b, h0, scale=0.7, gen=gen)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("shape,cu,w_kind", [
    ((2, 100, 60, 64, 64), None, "rwkv7"),                      # 120 pairs
    ((1, 150, 32, 64, 64), [0, 7, 7, 40, 150], "mixedinf"),     # 128 pairs, an empty sequence
], ids=["pairs120", "varlen128"])
@pytest.mark.parametrize("head_first", [False, True], ids=["bthd", "head_first"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_two_block_training_forward_matches_oracle(shape, cu, w_kind, head_first, dtype, gen):
    """A training forward with 7/8 of the SMs' count to the SMs' count of (sequence, head) pairs
    runs as the two-block fused kernel that keeps the two-kernel forward's states and workspace
    (dplr_chunk_launch.cuh fused_keeps_workspace): `saved` holds both, every float written (the
    slots after each sequence's chunks 0, as prep's), and the backward on them (the reverse
    sweep, grad) gives o, the final state and every gradient within the oracle's 16-bit
    tolerances."""
    if cu is not None and head_first:
        pytest.skip("varlen takes [1, T, H, D]")
    B, T, H, K, V = shape
    N = len(cu) - 1 if cu else B
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if not 7 * sms <= 8 * N * H <= 8 * sms:
        pytest.skip(f"{N * H} pairs do not take the kernel on {sms} SMs")
    cu_t = torch.tensor(cu, device="cuda") if cu else None
    r, w, k, v, a, b, h0 = make(*shape, dtype, "cuda", gen, w_kind=w_kind, N=N, head_first=head_first)
    _, _, saved = torch.ops.fla.chunk_rwkv7_train(r, w, k, v, a, b, 0.7, h0, True, cu_t, head_first)
    slots = (T // 16 + 2 * N + 1) if cu else N * ((T + 15) // 16 + 1)
    per = 4 * 16 * K + K + 5 * 16 * 20  # DplrWorkspaceLayout::floats_per_chunk()
    assert saved.numel() == (slots * H * K * V + 3) // 4 * 4 + slots * H * per  # states and workspace
    assert torch.isfinite(saved).all()
    run_and_check(CHUNK, r, w, k, v, a, b, h0, scale=0.7, cu=cu_t, head_first=head_first, gen=gen)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("head_first", [False, True], ids=["bthd", "head_first"])
@pytest.mark.parametrize("fused,K,dtype,saves", [("1", 64, torch.bfloat16, 10 << 20), ("0", 64, torch.bfloat16, 6 << 20),
                                                 ("0", 128, torch.bfloat16, 24 << 20), ("0", 128, torch.float32, 24 << 20)],
                         ids=["fused_states", "kept_workspace", "strided_K128", "kept_workspace_K128"])
def test_backward_windows_match_one_pass(head_first, fused, K, dtype, saves, monkeypatch, gen):
    """The backward on kept states runs in windows of the chunk index when its workspaces exceed
    the budget (FLA_EXT_WORKSPACE_MIB=0: a chunk per window, 65 windows here; on strided states a
    stride of four chunks, 17 windows): the gradients equal the one-pass backward's bitwise, and
    its peak holds one window's dS+ (and, on the fused forward's states, the pair matrices and X
    from the fused reverse pass) instead of every chunk's (K = V = 64: ~8 MB of dS+, ~3 MB of
    matrices; K = 128: ~34 MB of dS+; bf16 there on the sweep's strided states and the kept
    workspace, fp32 on every state and the workspace)."""
    monkeypatch.setenv("FLA_EXT_RWKV7_FUSED", fused)
    r, w, k, v, a, b, h0 = make(2, 1030, 4, K, K, dtype, "cuda", gen, w_kind="rwkv7",
                                head_first=head_first)
    do, dht = torch.randn_like(v), torch.randn_like(h0)

    def grads():
        ins = [x.clone().requires_grad_(True) for x in (r, w, k, v, a, b, h0)]
        o, ht = chunk_rwkv7(*ins[:6], scale=0.7, initial_state=ins[6], output_final_state=True,
                            head_first=head_first)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.autograd.backward([o, ht], [do, dht])
        torch.cuda.synchronize()
        return [x.grad for x in ins], torch.cuda.max_memory_allocated() - base

    monkeypatch.setenv("FLA_EXT_RWKV7_PIPELINE", "0")  # windows for memory alone
    monkeypatch.setenv("FLA_EXT_WORKSPACE_MIB", "4096")
    one, one_peak = grads()
    monkeypatch.setenv("FLA_EXT_WORKSPACE_MIB", "0")
    windowed, windowed_peak = grads()
    for name, x, y in zip(["r", "w", "k", "v", "a", "b", "h0"], windowed, one):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=f"d{name}")
    assert windowed_peak < one_peak - saves, (windowed_peak, one_peak)
    # The same budget with the pipelined windows (two windows' buffers, the reverse pass on a
    # second stream beside grad): half the windows' size, the same peak, bitwise the same.
    monkeypatch.delenv("FLA_EXT_RWKV7_PIPELINE")
    piped, piped_peak = grads()
    for name, x, y in zip(["r", "w", "k", "v", "a", "b", "h0"], piped, one):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=f"d{name}")
    assert piped_peak <= windowed_peak + (1 << 20), (piped_peak, windowed_peak)


def _fwd_bwd(ins, head_first, do, dht, train=True):
    """o, the final state, and (train) every gradient of chunk_rwkv7 on clones of `ins`."""
    xs = [x.clone().requires_grad_(train) for x in ins]
    with torch.set_grad_enabled(train):
        o, ht = chunk_rwkv7(*xs[:6], scale=0.7, initial_state=xs[6], output_final_state=True,
                            head_first=head_first)
    if not train:
        return [o, ht]
    torch.autograd.backward([o, ht], [do, dht])
    return [o.detach(), ht.detach()] + [x.grad for x in xs]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("head_first", [False, True], ids=["bthd", "head_first"])
@pytest.mark.parametrize("dtype,K,fused", [(torch.bfloat16, 64, "1"), (torch.bfloat16, 128, ""),
                                           (torch.float32, 64, ""), (torch.float16, 40, "")],
                         ids=["bf16_fused", "bf16_K128", "fp32", "fp16_K40"])
def test_pipelined_windows_match_one_pass(head_first, dtype, K, fused, monkeypatch, gen):
    """The pipelined windows of the chunk index (FLA_EXT_RWKV7_PIPELINE=1 takes them at any
    length: windows of 12 chunks here, the last partial): the two-kernel forward's prep of one
    window beside the sweep of the one before, the state carried between them, and the
    backward's reverse pass beside grad on two windows' buffers. Every output, gradient and kept
    float bitwise equal to one pass (FLA_EXT_RWKV7_PIPELINE=0): training and inference forwards,
    both layouts, the fused path's backward (fused 1), the two-kernel path on its sweep's strided
    states (bf16 at K = V = 128: windows of whole strides; one pass keeps prep's workspace after
    them, the windows do not: the states compared), and where it keeps every state and prep's
    workspace (fp32, fp16 at K = 40)."""
    if fused:
        monkeypatch.setenv("FLA_EXT_RWKV7_FUSED", fused)
    ins = make(2, 1030, 4, K, K, dtype, "cuda", gen, w_kind="rwkv7", head_first=head_first)
    do, dht = torch.randn_like(ins[3]), torch.randn_like(ins[6])
    cu = None
    runs = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("FLA_EXT_RWKV7_PIPELINE", mode)
        saved = torch.ops.fla.chunk_rwkv7_train(*ins[:6], 0.7, ins[6], True, cu, head_first)
        runs[mode] = (_fwd_bwd(ins, head_first, do, dht), _fwd_bwd(ins, head_first, do, dht, False),
                      list(saved))
    torch.cuda.synchronize()
    names = ["o", "ht", "dr", "dw", "dk", "dv", "da", "db", "dh0"]
    for part, what in enumerate(["training", "inference", "chunk_rwkv7_train"]):
        for name, x, y in zip(names if part < 2 else ["o", "ht", "saved"], runs["1"][part], runs["0"][part]):
            if name == "saved" and K == 128:  # the windows keep the states alone, one pass the workspace after them
                assert x.numel() < y.numel(), (x.numel(), y.numel())
                y = y[:x.numel()]
            assert torch.isfinite(x).all(), f"{what} {name}"
            torch.testing.assert_close(x, y, rtol=0, atol=0, msg=f"{what} {name}")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_sweep_strided_states_varlen(gen):
    """At K = V = 128 under cu_seqlens too, the training forward keeps the strided states (the
    slot map of 64-row chunks, whose gap slots its sweep zeroes: `saved` is an op output, every
    float written and finite under FLA_EXT_POISON) and prep's workspace after them; sequences of
    6 chunks (a stride and 2), none, 20 (five strides) and one partial chunk. o, the final
    states and every gradient against the float64 oracle."""
    cu, H, K = [0, 90, 90, 410, 420], 2, 128
    T, N = cu[-1], len(cu) - 1
    ins = make(1, T, H, K, K, torch.bfloat16, "cuda", gen, w_kind="rwkv7", N=N)
    cu_t = torch.tensor(cu, device="cuda")
    _, _, saved = torch.ops.fla.chunk_rwkv7_train(*ins[:6], 0.7, ins[6], True, cu_t, False)
    kept = T // 64 + 2 * N + 1  # chunk_slots of 64-row chunks under cu_seqlens
    ws = (T // 16 + 2 * N + 1) * H * (4 * 16 * K + K + 5 * 16 * 20)
    assert saved.numel() == (kept * H * K * K + 3) // 4 * 4 + ws
    assert torch.isfinite(saved).all()
    run_and_check(CHUNK, *ins, scale=0.7, cu=cu_t, gen=gen)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("head_first", [False, True], ids=["bthd", "head_first"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("K", [64, 128])
def test_sweep_strided_states(head_first, dtype, K, monkeypatch, gen):
    """The two-kernel training forward keeping strided states made by its sweep, and no
    workspace (`saved` of the strided states' size, every float written and finite): at K = V =
    64 for few pairs and long sequences (FLA_EXT_RWKV7_PIPELINE=1 takes the windows at any
    length), at K = V = 128 always: there outside the windows (checked first, without the setting)
    with prep's workspace kept after the states, its backward running no prep. In the windows the
    backward makes prep's workspace again (beside the reverse sweep), and grad the states between
    (at K = 128 walking both column tiles of each chunk, a state buffer each). o, the final state
    and every gradient against the float64 oracle; the backward in one pass (the pipeline off when
    it runs) bitwise equal to the windows'."""
    N, T, H = 2, 1030, 4
    ins = make(N, T, H, K, K, dtype, "cuda", gen, w_kind="rwkv7", head_first=head_first)
    slots = N * ((T + 63) // 64 + 1)  # every fourth 16-row chunk's state and the final one
    if K == 128:
        monkeypatch.delenv("FLA_EXT_RWKV7_PIPELINE", raising=False)
        _, _, saved = torch.ops.fla.chunk_rwkv7_train(*ins[:6], 0.7, ins[6], True, None, head_first)
        ws = N * ((T + 15) // 16 + 1) * H * (4 * 16 * K + K + 5 * 16 * 20)  # prep's, as kept after them
        assert saved.numel() == (slots * H * K * K + 3) // 4 * 4 + ws
        assert torch.isfinite(saved).all()
        run_and_check(CHUNK, *ins, scale=0.7, head_first=head_first, gen=gen)
    monkeypatch.setenv("FLA_EXT_RWKV7_PIPELINE", "1")
    _, _, saved = torch.ops.fla.chunk_rwkv7_train(*ins[:6], 0.7, ins[6], True, None, head_first)
    assert saved.numel() == (slots * H * K * K + 3) // 4 * 4
    assert torch.isfinite(saved).all()
    run_and_check(CHUNK, *ins, scale=0.7, head_first=head_first, gen=gen)

    do, dht = torch.randn_like(ins[3]), torch.randn_like(ins[6])
    windowed = _fwd_bwd(ins, head_first, do, dht)
    xs = [x.clone().requires_grad_(True) for x in ins]
    o, ht = chunk_rwkv7(*xs[:6], scale=0.7, initial_state=xs[6], output_final_state=True,
                        head_first=head_first)
    monkeypatch.setenv("FLA_EXT_RWKV7_PIPELINE", "0")
    torch.autograd.backward([o, ht], [do, dht])
    one_pass = [o.detach(), ht.detach()] + [x.grad for x in xs]
    for name, x, y in zip(["o", "ht", "dr", "dw", "dk", "dv", "da", "db", "dh0"], windowed, one_pass):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)