// CUDA engine for the chunked RWKV7 algebra of kernels/dplr_chunk.h (the steps of
// cpu/dplr_chunk.cpp in fp32). In prep, the sweeps and grad every product with a state, a 16 x 16
// matrix or across the columns runs on tensor cores: TF32 for bf16 / fp16 inputs, fp32-accurate
// 3xTF32 for fp32 ones (fp32 accumulators and states; X, grad's pair walks and every exponent
// stay SIMT fp32, the pair matrices too unless a chunk's decays allow their 3xTF32 form:
// kFactorBound, kFactorBoundFp32). The launch compiles K = 64 and 128 as constants (launch_k).
//
// Fused kernels (bf16 / fp16, K = V = 64), one CTA per (sequence, head): the forward where the
// op sets DplrChunkPass::fused (fused_forward_kernel, dplr_chunk_fused.cuh; enough pairs), no
// workspace, a training forward's storing the chunk-start states (DplrKept::states); and on
// those states the backward's reverse pass (fused_reverse_kernel, dplr_chunk_fused_reverse.cuh:
// dS+ and the pair matrices with X, in place of prep and the reverse sweep), then grad. Where
// two CTAs per SM hold every pair, the two-block builds (the next chunk's steps on warps of
// their own beside this chunk's chain) run the reverse pass and the inference forward. Where
// nearly every SM holds one pair, a training forward on the two-kernel path runs as the
// two-block kernel that stores what prep and the sweep would keep (fused_keeps_workspace).
// Forward, two kernels:
//   prep   (chunk slot, H)  everything of a chunk that does not depend on the state: the pair
//          matrices (every thread pair (i, j) of the 16 x 16 grid adds its exponent
//          sum_{j < s < i} w_s elementwise: never a difference, never positive, so any w in
//          [-inf, 0] is exact; for bf16 / fp16, a chunk whose every channel's total decay is
//          >= -60 takes 3xTF32 products of factored rows instead, pair_matrices_tc), X =
//          (I - A_ab)^-1 by forward substitution, then W, Q~, K^, B^, gamma, U0, O0 into the
//          workspace (DplrWorkspaceLayout).
//   state  (N, H, V / 32)   the sequential pass over chunks with the K x 32 state slice in shared
//          memory: U = U0 + W S, o = O0 + scale Q~ S, S+ = gamma S + K^^T V + B^^T U. The next
//          chunk's workspace block is copied asynchronously while this one is used, so a step
//          costs its arithmetic, not a memory latency. Writes the chunk-start states (`hst`)
//          when asked: the training forward keeps them, and its workspace with the pair
//          matrices and X, for its backward (DplrChunkPass::kept).
// (prep in dplr_chunk_prep.cuh, the sweeps in dplr_chunk_sweep.cuh, the grad kernel in
// dplr_chunk_grad.cuh with its tensor-core column products in dplr_chunk_grad_columns.cuh; their
// parts: dplr_chunk_layout.cuh (shared-memory layout, glossary of the short names),
// dplr_chunk_loads.cuh, dplr_chunk_pairs.cuh, dplr_chunk_tiles.cuh.)
// Backward otherwise: prep for the workspace and the forward sweep for the states unless the
// two-kernel training forward kept them; the reverse sweep (dS+ at every chunk end); then one CTA of 256 threads per (chunk slot, head, tile of dplr_chunk_cols(K) columns)
// makes that chunk's gradients with the rows, pair matrices and the K x cols state and its
// gradient in shared memory. With V in one tile, or where one CTA walks all of a chunk's tiles
// (bf16 / fp16 at K = 128: dplr_grad_walks_tiles), its K-vector gradients go straight to the
// outputs; else they are per-tile partial sums, added into zero-filled slabs two tiles per slab
// (DplrArgs::kg_pair). On kept states the op may run the backward in windows of the chunk index
// (DplrChunkPass::window_chunks: one launch of each kernel per window, launch_windows), and the
// forward too where its sequential kernels are few; with a side stream the windows' sequential
// kernels run beside the parallel ones. No host synchronisation: CUDA-graph safe.
//
// The launches are kept apart from the kernels so that the kernels also compile as host code
// (tests/cuda_emu runs them on the CPU).
#pragma once
#include <memory>
#include <type_traits>
#include <vector>

#include "device_sms.cuh"

#include "dplr_chunk_fused.cuh"
#include "dplr_chunk_fused_backward.cuh"
#include "dplr_chunk_fused_reverse.cuh"
#include "dplr_chunk_grad.cuh"
#include "dplr_chunk_prep.cuh"
#include "dplr_chunk_sweep.cuh"

namespace fla {
namespace dplr_chunk_detail {

template <typename K>
cudaError_t launch_with_smem(K kernel, dim3 grid, int threads, size_t bytes, const DplrChunkPass& p,
                             cudaStream_t stream) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  // All of the unified L1 as shared memory: the driver may otherwise pick a carveout that holds
  // fewer CTAs than registers and shared memory allow (these kernels stream; L1 hits are rare).
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             int(cudaSharedmemCarveoutMaxShared));
  if (e != cudaSuccess) return e;
  kernel<<<grid, threads, bytes, stream>>>(p);
  return cudaGetLastError();
}

// A fused kernel (one CTA per (sequence, head)): where one or two CTAs per SM hold every task,
// the two-block kernel (the next chunk's steps beside this one's chain), if there is one
// (`one_two`: its build for at most one CTA per SM, with the registers of a whole SM; `two`: for
// two per SM; either may be null); else the one-block kernel with kCtas = 3 or 4 CTAs per SM:
// three give each CTA the shorter chunk step, so four only where three per SM would leave CTAs
// for a second wave.
using FusedKernel = void (*)(DplrChunkPass);
template <typename T>
cudaError_t launch_fused(FusedKernel one_two, FusedKernel two, FusedKernel three, FusedKernel four,
                         const DplrChunkPass& p, const VecArg& cols, cudaStream_t stream) {
  using namespace dplr_fused_detail;
  const int64_t tasks = int64_t(p.N) * p.H, sms = device_sm_count();
  DplrChunkPass f = p;
  f.paths.rows_16byte = input_rows_in_pieces<T>(p, cols);
  const dim3 grid{unsigned(tasks)};
  FusedKernel pair_build = tasks <= sms && one_two ? one_two : tasks <= 2 * sms ? two : nullptr;
  if (pair_build) return launch_with_smem(pair_build, grid, 2 * NTF, FusedSmem<2>::bytes(), f, stream);
  return launch_with_smem(tasks > 3 * sms ? four : three, grid, NTF, FusedSmem<1>::bytes(), f, stream);
}

// The kernels of a pass, each on the stream given.
template <typename T, int KC>
cudaError_t run_prep(const DplrChunkPass& p, cudaStream_t stream) {
  const dim3 grid = p.window_chunks > 0 ? dim3(unsigned(p.window_chunks), p.H, p.N)  // (in windows)
                                        : dim3(unsigned(dplr_work_slots(p)), p.H);
  return launch_with_smem(prep_kernel<T, KC>, grid, NT, Smem(p.K, false).bytes(), p, stream);
}
template <typename T, int KC, bool REV, bool OUT>
cudaError_t run_sweep(const DplrChunkPass& p, cudaStream_t stream) {
  const size_t bytes = StateSmem(DplrWorkspaceLayout(p.K, p.V), p.K).bytes();
  const dim3 grid(unsigned(int64_t(p.N) * p.H * state_tiles(p.V)));
  if constexpr (!std::is_same<T, float>::value && (KC == 64 || KC == 128) && !REV && OUT) {
    if (p.sweep_strided_states) return launch_with_smem(sweep_kernel<T, false, true, KC, true>, grid, NTS, bytes, p, stream);
  }
  return launch_with_smem(sweep_kernel<T, REV, OUT, KC>, grid, NTS, bytes, p, stream);
}
// The backward's reverse pass: the fused one on the fused forward's states (DplrKept::states,
// bf16 / fp16 at K = V = 64 only: launch_k checks), else the reverse sweep.
template <typename T, int KC>
cudaError_t run_reverse(const DplrChunkPass& p, cudaStream_t stream) {
  if constexpr (!std::is_same<T, float>::value && KC == 64) {
    if (p.kept == DplrKept::states && !p.sweep_strided_states)
      return launch_fused<T>(fused_reverse_two_block_kernel<T, 1>, fused_reverse_two_block_kernel<T, 2>,
                             fused_reverse_kernel<T, 3>, fused_reverse_kernel<T, 4>, p, p.dout, stream);
  }
  return run_sweep<T, KC, true, false>(p, stream);
}
// grad: a CTA per chunk, or on strided states per kept state's stride of chunks (at K = 128 with
// the second column tile's state in shared memory too).
template <typename T, int KC>
cudaError_t run_grad(const DplrChunkPass& p, cudaStream_t stream) {
  const dim3 grid(unsigned(dplr_grad_ctas(p)), p.H, dplr_grad_grid_tiles(p.dtype, p.K, p.V));
  if constexpr (!std::is_same<T, float>::value && (KC == 64 || KC == 128)) {
    if (p.kept == DplrKept::states)
      return launch_with_smem(grad_kernel<T, KC, true>, grid, NT, Smem(p.K, true, KC == 128).bytes(), p, stream);
  }
  return launch_with_smem(grad_kernel<T, KC>, grid, NT, Smem(p.K, true).bytes(), p, stream);
}

// Events of a windowed pass's two streams, made once per host thread and device: a wait takes
// the record issued before it, so the same events serve call after call (per thread: another
// thread's record between this one's record and its wait would be waited on instead).
struct WindowEvents {
  cudaEvent_t fork, step, join, done[2];  // done: the last use of a window's buffers
};
inline cudaError_t window_events(WindowEvents*& out) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  thread_local std::vector<std::unique_ptr<WindowEvents>> per_device;
  if (int(per_device.size()) <= device) per_device.resize(device + 1);
  if (!per_device[device]) {
    auto ev = std::make_unique<WindowEvents>();
    for (cudaEvent_t* x : {&ev->fork, &ev->step, &ev->join, &ev->done[0], &ev->done[1]})
      if ((e = cudaEventCreateWithFlags(x, cudaEventDisableTiming)) != cudaSuccess) return e;
    per_device[device] = std::move(ev);
  }
  out = per_device[device].get();
  return cudaSuccess;
}

// A pass in windows of the chunk index (DplrChunkPass::window_chunks): the parallel kernels
// (prep, grad) on the caller's stream, the sequential ones (the forward sweep, the reverse pass)
// on side_stream, ordered by events. The sequential kernels have a CTA per (sequence, head[,
// tile]) walking the window's chunks, latency-bound where those CTAs are few, and the parallel
// ones fill the SMs they leave idle: the forward sweep of window w runs beside prep of window
// w + 1, the reverse pass of window k + 1 beside grad of window k, with two windows' buffers
// taken in turn (window_buffers = 2).
template <typename T, int KC>
cudaError_t launch_windows(const DplrChunkPass& p, cudaStream_t stream) {
  const cudaStream_t side = p.side_stream ? static_cast<cudaStream_t>(p.side_stream) : stream;
  const bool two = side != stream;
  if (p.window_buffers < 1 || p.window_buffers > 2) return cudaErrorInvalidValue;  // (WindowEvents::done)
  WindowEvents* ev = nullptr;
  cudaError_t e = two ? window_events(ev) : cudaSuccess;
  if (e != cudaSuccess) return e;
  // `to` waits for what `from` has queued so far
  auto order = [&](cudaStream_t from, cudaStream_t to, cudaEvent_t x) {
    if (!two) return cudaSuccess;
    const cudaError_t r = cudaEventRecord(x, from);
    return r == cudaSuccess ? cudaStreamWaitEvent(to, x, 0) : r;
  };
  e = order(stream, side, two ? ev->fork : nullptr);  // the side stream waits for the caller's
  const int64_t nch = (int64_t(p.T) + C - 1) / C, wc = p.window_chunks;
  DplrChunkPass q = p;
  const int bufs = p.window_buffers;
  if (!p.backward()) {
    int64_t w = 0;
    for (int64_t begin = 0; begin < nch && e == cudaSuccess; begin += wc, ++w) {
      const int buf = int(w % bufs);
      dplr_prep_window(q, p, begin, buf);
      // this window's buffers were the sweep's of window w - bufs
      if (two && w >= bufs) e = cudaStreamWaitEvent(stream, ev->done[buf], 0);
      if (e == cudaSuccess) e = run_prep<T, KC>(q, stream);
      if (e == cudaSuccess) e = order(stream, side, ev ? ev->step : nullptr);
      if (e == cudaSuccess) e = run_sweep<T, KC, false, true>(q, side);
      if (e == cudaSuccess && two) e = cudaEventRecord(ev->done[buf], side);
    }
  } else {
    const int64_t buf_states = int64_t(p.N) * wc * p.H * p.K * p.V,
                  buf_mats = int64_t(p.N) * wc * p.H * DplrWorkspaceLayout::kMatsFloats;
    const int64_t first = (nch - 1) / wc * wc;
    // On strided states made by the sweep, prep makes each window's workspace on the caller's
    // stream: with two buffers one window ahead, before grad of the window before it, so that
    // the reverse sweep of window k + 1 can run beside grad of window k (the buffer it writes
    // was last read by grad of window k - 1, before it on the stream); with one, just before
    // the reverse sweep.
    const bool remade = p.sweep_strided_states && !p.strided_ws_kept;  // (prep runs again)
    const bool ahead = remade && bufs == 2;
    auto run_prep_of = [&](int64_t begin, int64_t k) {
      DplrChunkPass x = q;
      dplr_prep_window(x, p, begin, int(k % bufs));
      const cudaError_t r = run_prep<T, KC>(x, stream);
      return r == cudaSuccess ? order(stream, side, ev ? ev->step : nullptr) : r;
    };
    if (ahead) e = run_prep_of(first, 0);
    int64_t k = 0;
    for (int64_t begin = first; begin >= 0 && e == cudaSuccess; begin -= wc, ++k) {
      const int buf = int(k % bufs);
      q.window_begin = begin;
      q.dhst = static_cast<float*>(p.dhst) + buf * buf_states;
      if (remade) {
        dplr_prep_window(q, p, begin, buf);  // (where prep made it: ahead, or now)
        if (!ahead) e = run_prep_of(begin, k);
      } else if (p.kept == DplrKept::states && !p.sweep_strided_states) {
        q.ws = static_cast<float*>(p.ws) + buf * buf_mats;  // (else kept whole)
      }
      // this window's buffers were grad's of window k - bufs
      if (e == cudaSuccess && two && k >= bufs) e = cudaStreamWaitEvent(side, ev->done[buf], 0);
      if (e == cudaSuccess) e = run_reverse<T, KC>(q, side);
      if (e == cudaSuccess && ahead && begin > 0) e = run_prep_of(begin - wc, k + 1);
      if (e == cudaSuccess) e = order(side, stream, ev ? ev->step : nullptr);
      if (e == cudaSuccess) e = run_grad<T, KC>(q, stream);
      if (e == cudaSuccess && two) e = cudaEventRecord(ev->done[buf], stream);
    }
  }
  // The caller's stream waits for the side stream, a failed launch or not: every buffer here is
  // the caller stream's.
  const cudaError_t joined = order(side, stream, two ? ev->join : nullptr);
  return e != cudaSuccess ? e : joined;
}

template <typename T, int KC>
cudaError_t launch_k(const DplrChunkPass& p_in, cudaStream_t stream) {
  DplrChunkPass p = p_in;
  pick_paths<T>(p);
  if ((p.backward() && p.kept == DplrKept::states) || p.sweep_strided_states) {
    // (strided states: bf16 / fp16 at K = V = 64 or 128, whose grad walks them; at 128 the
    // two-kernel path's alone)
    if (std::is_same<T, float>::value || KC != p.K || !dplr_strided_states(p.dtype, p.K, p.V) ||
        (KC == 128 && !p.sweep_strided_states))
      return cudaErrorInvalidValue;
  }
  if (p.window_chunks > 0) return launch_windows<T, KC>(p, stream);
  cudaError_t e = cudaSuccess;
  if (!p.backward()) {
    e = run_prep<T, KC>(p, stream);
    return e == cudaSuccess ? run_sweep<T, KC, false, true>(p, stream) : e;
  }
  if (p.kept == DplrKept::nothing || (p.sweep_strided_states && !p.strided_ws_kept)) e = run_prep<T, KC>(p, stream);
  // the forward sweep, writing hst alone (o, hT off)
  if (e == cudaSuccess && p.kept == DplrKept::nothing) e = run_sweep<T, KC, false, false>(p, stream);
  if (e == cudaSuccess) e = run_reverse<T, KC>(p, stream);
  return e == cudaSuccess ? run_grad<T, KC>(p, stream) : e;
}

// Whether a two-kernel training forward (DplrChunkPass::fused_may_keep) runs as the two-block
// fused kernel that keeps the same states and workspace (its one-CTA-per-SM build): where every
// pair has an SM of its own and nearly every SM a pair. The fused walk's time per pair is its
// sequence's chunks one after another, whatever the pairs; prep and the sweep's grows with them:
// on an H100 the fused kernel is the faster at 128 pairs and the slower at 96 (benchmarks/
// NOTES.md c33), so it takes at least 7/8 of the SMs. (Its two-CTA build spilled 216 bytes and
// lost at 192 pairs; there is none.)
inline bool fused_keeps_workspace(const DplrChunkPass& p) {
  const int64_t tasks = int64_t(p.N) * p.H, sms = device_sm_count();
  return p.fused_may_keep && !p.fused && !p.backward() && p.hst && p.ws &&
         dplr_fused_forward(p.dtype, p.K, p.V) && 8 * tasks >= 7 * sms && tasks <= sms;
}

// K = 64 (RWKV-7's head size) and 128 with every index derived from K a compile-time constant:
// with a runtime K, the integer multiply-adds of the shared-memory and workspace indices are a
// large share of the sweep's and prep's instructions.
template <typename T>
cudaError_t launch(const DplrChunkPass& p, cudaStream_t stream) {
  if (int64_t(p.N) * p.H == 0) return cudaSuccess;
  if constexpr (!std::is_same<T, float>::value) {
    if (p.single_pass_backward) {  // (the op's checks: the fp16 states, K = V = 64, no windows)
      if (!p.backward() || p.kept != DplrKept::f16_states || p.K != 64 || p.V != 64 || p.window_chunks > 0)
        return cudaErrorInvalidValue;
      DplrChunkPass f = p;
      pick_paths<T>(f);  // (the stores' paths; its rows come as ChunkRows' pieces:)
      f.paths.rows_16byte = input_rows_in_pieces<T>(p, p.dout);
      return launch_with_smem(single_pass_backward_kernel<T>, dim3(unsigned(int64_t(p.N) * p.H)), kDplrFusedThreads,
                              dplr_fused_detail::GradSmem::bytes(), f, stream);
    }
    if (p.fused && !p.backward() && dplr_fused_forward(p.dtype, p.K, p.V))
      return !p.hst ? launch_fused<T>(fused_forward_two_block_kernel<T, 1, DplrKept::nothing>,
                                      fused_forward_two_block_kernel<T, 2, DplrKept::nothing>,
                                      fused_forward_kernel<T, 3, DplrKept::nothing>,
                                      fused_forward_kernel<T, 4, DplrKept::nothing>, p, p.v, stream)
             : p.kept == DplrKept::f16_states
                 ? launch_fused<T>(fused_forward_two_block_kernel<T, 1, DplrKept::f16_states>, nullptr,
                                   fused_forward_kernel<T, 3, DplrKept::f16_states>,
                                   fused_forward_kernel<T, 4, DplrKept::f16_states>, p, p.v, stream)
                 : launch_fused<T>(fused_forward_two_block_kernel<T, 1, DplrKept::states>, nullptr,
                                   fused_forward_kernel<T, 3, DplrKept::states>,
                                   fused_forward_kernel<T, 4, DplrKept::states>, p, p.v, stream);
    if (fused_keeps_workspace(p)) {
      DplrChunkPass f = p;
      f.paths.rows_16byte = input_rows_in_pieces<T>(p, p.v);
      return launch_with_smem(fused_forward_two_block_kernel<T, 1, DplrKept::states_and_workspace>,
                              dim3(unsigned(int64_t(p.N) * p.H)),
                              2 * kDplrFusedThreads, dplr_fused_detail::FusedSmem<2>::bytes(), f, stream);
    }
  }
  return p.K == 64 ? launch_k<T, 64>(p, stream) : p.K == 128 ? launch_k<T, 128>(p, stream) : launch_k<T, 0>(p, stream);
}

}  // namespace dplr_chunk_detail

template <typename T>
cudaError_t launch_dplr_chunk(const DplrChunkPass& p, cudaStream_t stream) {
  return dplr_chunk_detail::launch<T>(p, stream);
}

}  // namespace fla
