// The chunked RWKV7 engine's fused forward (dplr_chunk_launch.cuh): one CTA (128 threads, or 256 in
// the two-block builds) per (sequence, head) walks the sequence's 16-row chunks with the
// whole K x V state in shared memory and does each chunk's work (docs/algorithms.md §6.3)
// itself: decays, pair matrices, X (dplr_chunk_fused_steps.cuh), U, o and the state update. No
// workspace: nothing of a chunk leaves the CTA but o and, for a training forward, the
// chunk-start state (hst). The two-kernel
// forward (prep for every chunk, then the sweep) moves ~16x an input's bytes through memory;
// this one reads the inputs and writes o (and the states: 4x an input at K = V = 64). Taken for
// bf16 / fp16 with K = V = 64 (dplr_chunk.h dplr_fused_forward) where the op finds it the faster
// one. One build (kKeep, at about one pair per SM) is a training forward that also stores prep's
// workspace, in place of the two kernels.
//
// Unlike prep, whose factored pair matrices are 3xTF32 (the backward reads them), these are
// single TF32 products (kKeep: 3xTF32, as prep's): the inputs are 16-bit here, and the
// repeated-token case (X from cancelling terms) stays within the 16-bit tolerance
// (tests/test_cuda_emu.py, tests/ops/test_rwkv7_inference.py). So o is close to, not bitwise
// equal to, the two-kernel forward's.
#pragma once
#include "dplr_f16_states.cuh"  // (and the steps: dplr_chunk_fused_steps.cuh)

namespace fla {
namespace dplr_fused_detail {

// The chain's steps over a chunk's block (forward: the state S), each by a group of 128 threads
// (tid its index), warp w of it on the columns 16w .. 16w + 15 unless said otherwise.

// M + P = A_ak V + Â S into mp.
__device__ inline void forward_mp(const float* blk, const float* S, float* mp, int tid) {
  using B = ChunkBlock;
  const int warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
#pragma unroll
  for (int n0 = 16 * warp; n0 < 16 * warp + 16; n0 += 8) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    warp_mma_ld(acc, C, blk + B::mats + kMatAak * C * LM, LM, blk + B::crow + n0, LB);
    warp_mma_ld(acc, K, blk + B::ahat, LA, S + n0, LB);
#pragma unroll
    for (int e = 0; e < 4; ++e) mp[(g + 8 * (e / 2)) * LB + n0 + 2 * q + e % 2] = acc[e];
  }
}

// U = X (M + P) into u.
__device__ inline void forward_u(const float* blk, const float* mp, float* u, int tid) {
  const int warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
#pragma unroll
  for (int n0 = 16 * warp; n0 < 16 * warp + 16; n0 += 8) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    warp_mma_ld(acc, C, blk + ChunkBlock::mats + kMatX * C * LM, LM, mp + n0, LB);
#pragma unroll
    for (int e = 0; e < 4; ++e) u[(g + 8 * (e / 2)) * LB + n0 + 2 * q + e % 2] = acc[e];
  }
}

// S+ = gamma S + K^^T V + B^^T U into `next`: warp w the channels 16w .. 16w + 15, all columns.
__device__ inline void forward_next(const float* blk, const float* S, const float* u, float (&next)[V / 8][4],
                                    int tid) {
  using B = ChunkBlock;
  const int d0 = 16 * (tid / 32), g = tid % 32 / 4, q = tid % 4;
#pragma unroll
  for (int nt = 0; nt < V / 8; ++nt) {
    float* const acc = next[nt];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = d0 + g + 8 * (e / 2), x = 8 * nt + 2 * q + e % 2;
      acc[e] = blk[B::gam + d] * S[d * LB + x];
    }
    warp_mma_ld<true, false>(acc, C, blk + B::khat + d0, LB, blk + B::crow + 8 * nt, LB);
    warp_mma_ld<true, false>(acc, C, blk + B::bhat + d0, LB, u + 8 * nt, LB);
  }
}

// forward_next's S+ over S, after every warp's reads of S.
__device__ inline void write_state(float* S, const float (&next)[V / 8][4], int tid) {
  const int d0 = 16 * (tid / 32), g = tid % 32 / 4, q = tid % 4;
#pragma unroll
  for (int nt = 0; nt < V / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) S[(d0 + g + 8 * (e / 2)) * LB + 8 * nt + 2 * q + e % 2] = next[nt][e];
}

// What a fused forward writes of its task: o, a training forward's chunk-start states (kKept)
// and the final state. DplrKept::states_and_workspace (the two-kernel forward's states, as the
// sweep stores them): slot chunk_slot(n, ci) of hst holds the state before chunk ci, the slot
// after the last chunk the final state. DplrKept::states: slot dplr_kept_state_slot(n, g) the
// state before chunk kStride g, the slot after them the final state (store_after).
// DplrKept::f16_states: every chunk's start state as DplrF16States' records at chunk_slot(n, ci)
// (store_before), no final state after them (that slot 0, finish).
template <typename T, DplrKept kKept>
struct ForwardOut {
  static constexpr bool kStates = kKept != DplrKept::nothing, kF16 = kKept == DplrKept::f16_states;
  static constexpr int kStride = kKept == DplrKept::states ? kDplrStateStride : 1;
  static constexpr int64_t kSlotFloats = kF16 ? DplrF16States::kFloats : K * V;
  int n, h;
  int64_t slot0, nch, slot_floats;
  float* hst;
  T* o0;
  __device__ ForwardOut(const DplrChunkPass& p, const FusedTask& t)
      : n(t.n), h(t.h), slot0(chunk_slot<C * kStride>(p.cu_seqlens, t.n, p.T, 0)), nch(t.nch),
        slot_floats(p.H * kSlotFloats),
        hst(kStates ? static_cast<float*>(p.hst) + (slot0 * p.H + t.h) * kSlotFloats : nullptr),
        o0(vptr<T>(p.o, t.s.b, t.s.bos, t.h, 0)) {}
  // The state before chunk kStride g's slot.
  __device__ float* slot(int64_t g) const { return hst + g * slot_floats; }
  // Before chunk ci's update (S the state before chunk ci), after the barrier that wrote S, by
  // the 128 threads of one group: its fp16 record (kF16). Not synchronised.
  __device__ void store_before(int64_t ci, const float* S, int tid) const {
    if constexpr (kF16) store_f16_state(slot(ci), S, tid);
  }
  // After chunk ci's update (S the state before chunk ci + 1): store it where it is kept (the
  // start of a stride, or the final state). After a barrier; not synchronised.
  __device__ void store_after(int64_t ci, const float* S, int tid, int threads) const {
    if (kStates && !kF16 && ((ci + 1) % kStride == 0 || ci + 1 == nch))
      store_state(slot((ci + kStride) / kStride), S, tid, threads);
  }
  // S from h0 (0 without it), and slot 0.
  __device__ void init(const DplrChunkPass& p, float* S, int tid, int threads) const {
    load_state(S, p.h0, n, h, tid, threads, kStates && !kF16 ? hst : nullptr);
  }
  // o = scale (R^ S + A_rk V + A_rb U) of chunk ci's rows, straight from the accumulators.
  __device__ void rows(const DplrChunkPass& p, int64_t ci, int64_t rem, const float* blk, const float* S, const float* u,
                       int tid) const {
    using B = ChunkBlock;
    const int warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
    const float rho = float(p.scale);
    T* const oc = o0 + ci * C * p.o.st;
#pragma unroll
    for (int n0 = 16 * warp; n0 < 16 * warp + 16; n0 += 8) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      warp_mma_ld(acc, K, blk + B::rhat, LA, S + n0, LB);
      warp_mma_ld(acc, C, blk + B::mats + kMatArk * C * LM, LM, blk + B::crow + n0, LB);
      warp_mma_ld(acc, C, blk + B::mats + kMatArb * C * LM, LM, u + n0, LB);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = g + 8 * (e / 2), x = n0 + 2 * q + e % 2;
        if (i < rem) oc[i * p.o.st + x * p.o.sd] = from_f<T>(rho * acc[e]);
      }
    }
  }
  // After the last chunk: the slots no pass reads, 0 (hst may be kept as an op output): a varlen
  // training forward's gaps, and the fp16 form's slot after the last chunk; then the final state.
  __device__ void finish(const DplrChunkPass& p, const float* S, int tid, int threads) const {
    if (kStates && (kF16 || p.cu_seqlens)) {
      const int64_t next = dplr_slots_after<C * kStride>(p, n);
      for (int64_t sl = slot0 + (nch + kStride - 1) / kStride + (kF16 ? 0 : 1); sl < next; ++sl)
        for (int e = tid; e < kSlotFloats / 4; e += threads)
          reinterpret_cast<float4*>(slot(sl - slot0))[e] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    save_state(p.hT, n, h, S, tid, threads);
  }
};

// What the two-kernel training forward keeps for its backward besides the states (prep's
// workspace, DplrWorkspaceLayout; the backward then runs neither prep nor the forward sweep), made
// by a fused forward instead: each chunk's W = X Â, Q~ = R^ + A_rb W, K^, B^ (TF32 values, as the
// reverse sweep reads them), gamma, the pair matrices and X. By the steps' group of 128 threads;
// each function after the barrier that makes what it reads.
struct KeptWorkspace {
  float* base;  // chunk slot 0 of the (sequence, head)
  int64_t slot0, slot_floats;
  __device__ static DplrWorkspaceLayout ws() { return DplrWorkspaceLayout(K, V); }
  __device__ KeptWorkspace(const DplrChunkPass& p, const FusedTask& t)
      : slot0(chunk_slot<C>(p.cu_seqlens, t.n, p.T, 0)), slot_floats(int64_t(p.H) * ws().floats_per_chunk()) {
    base = static_cast<float*>(p.ws) + (slot0 * p.H + t.h) * ws().floats_per_chunk();
  }
  __device__ float* block(int64_t ci) const { return base + ci * slot_floats; }
  // The pair matrices and X (after X's solve).
  __device__ void store_mats(int64_t ci, const float* blk, int tid) const {
    dplr_fused_detail::store_mats(block(ci) + ws().mats_at(), blk, tid);
  }
  // W and Q~ (warp w: channels 16w .. 16w + 15; W through `scratch`, [C][LB], as Q~'s operand),
  // K^, B^ and gamma. The rows go to krow_at's swizzled places, a lane's two adjacent channels
  // as one 8-byte store.
  __device__ void store_rows(int64_t ci, const float* blk, float* scratch, int tid) const {
    using B = ChunkBlock;
    const DplrWorkspaceLayout L = ws();
    float* const out = block(ci);
    const int warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
    auto put = [&](int m, int n0, const float (&acc)[4]) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(out + L.krow_at(m * C + g + 8 * h, n0 + 2 * q)) =
            make_float2(tile::tf32_round(acc[2 * h]), tile::tf32_round(acc[2 * h + 1]));
    };
#pragma unroll
    for (int n0 = 16 * warp; n0 < 16 * warp + 16; n0 += 8) {
      float w[4] = {0.f, 0.f, 0.f, 0.f};
      warp_mma_ld(w, C, blk + B::mats + kMatX * C * LM, LM, blk + B::ahat + n0, LA);
      put(0, n0, w);
#pragma unroll
      for (int e = 0; e < 4; ++e) scratch[(g + 8 * (e / 2)) * LB + n0 + 2 * q + e % 2] = w[e];
    }
    __syncwarp();
#pragma unroll
    for (int n0 = 16 * warp; n0 < 16 * warp + 16; n0 += 8) {
      float qt[4], kh[4], bh[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = g + 8 * (e / 2), d = n0 + 2 * q + e % 2;
        qt[e] = blk[B::rhat + i * LA + d], kh[e] = blk[B::khat + i * LB + d], bh[e] = blk[B::bhat + i * LB + d];
      }
      warp_mma_ld(qt, C, blk + B::mats + kMatArb * C * LM, LM, scratch + n0, LB);
      put(1, n0, qt), put(2, n0, kh), put(3, n0, bh);
    }
    if (tid < K) out[L.gamma_at() + tid] = blk[B::gam + tid];
  }
  // The slots after the sequence's chunks (the final state's, a varlen batch's gaps): zeros, as
  // prep writes them (the workspace is kept as an op output).
  __device__ void finish(const DplrChunkPass& p, int n, int64_t nch, int tid, int threads) const {
    const int64_t next = dplr_slots_after(p, n);
    for (int64_t sl = slot0 + nch; sl < next; ++sl)
      for (int e = tid; e < ws().floats_per_chunk() / 4; e += threads)
        reinterpret_cast<float4*>(block(sl - slot0))[e] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
};

}  // namespace dplr_fused_detail

// One block (128 threads): each chunk's steps, then its chain. kCtas: the CTAs per SM the
// register budget is cut for (3: up to 168 registers, 4: 128). Shared memory holds four. Three
// give each CTA the shorter chunk step, so the launch takes four only where three per SM would
// leave CTAs for a second wave. kKept: nothing (inference), or a training forward's states
// (ForwardOut: DplrKept::states, every kDplrStateStride-th chunk-start state and the final one;
// DplrKept::f16_states, every chunk's as fp16) in p.hst; each an instantiation of its own (the
// stores' addresses cost the four-CTA budget spills that the inference forward need not pay).
template <typename T, int kCtas, DplrKept kKept>
__global__ void __launch_bounds__(kDplrFusedThreads, kCtas) fused_forward_kernel(const DplrChunkPass p) {
  using namespace dplr_fused_detail;
  using L = FusedSmem<1>;
  float* const sm = fused_smem();
  const FusedTask task(p);
  const auto [h, n, s, nch] = task;
  const int tid = threadIdx.x;
  const ChunkSteps at = ChunkSteps::at<L>(sm, 0);
  static_assert(kKept != DplrKept::states_and_workspace, "the two-block build keeps the workspace");
  const ForwardOut<T, kKept> out(p, task);
  ChunkRows<T> rows(p, p.v, s, h, tid);
  float* const S = sm + L::state;
  out.init(p, S, tid, NTF);
  if (nch > 0) rows.fetch(0);
  for (int64_t ci = 0; ci < nch; ++ci) {
    rows.stage(at, 1.f);
    __syncthreads();
    if (ci + 1 < nch) rows.fetch(ci + 1);  // in flight during this chunk's work
    out.store_before(ci, S, tid);
    chunk_steps<T, false>(at, p, s, h, ci);
    if (tid < 32) solve_x(at.blk, tid);
    forward_mp(at.blk, S, sm + L::scr0, tid);
    __syncthreads();
    forward_u(at.blk, sm + L::scr0, sm + L::scr1, tid);
    __syncthreads();
    out.rows(p, ci, s.len - ci * C, at.blk, S, sm + L::scr1, tid);
    float next[V / 8][4];
    forward_next(at.blk, S, sm + L::scr1, next, tid);
    __syncthreads();
    write_state(S, next, tid);
    __syncthreads();
    out.store_after(ci, S, tid, NTF);
  }
  out.finish(p, S, tid, NTF);
}

// Two blocks (256 threads): warps 0-3 run chunk ci's chain on one block while warps 4-7 make
// chunk ci + 1's (staging, decays, pair matrices, X) in the other: four barriers a chunk in place
// of eight, each phase holding work of both halves. For few (sequence, head) pairs, where one
// 128-thread CTA an SM leaves the chunk walk's latency exposed. kCtas: the CTAs per SM the
// register budget is cut for (2: 128 registers, 1: up to 255, for at most one pair per SM).
// kKept: what a training forward keeps for its backward (nothing: inference).
// DplrKept::states_and_workspace (kKeep): what the two-kernel forward keeps (the chunk-start
// states and, KeptWorkspace, prep's workspace), so that its backward runs the reverse sweep and
// grad alone; the steps' warps store them, and make the pair matrices 3xTF32 (grad reads them,
// as prep's). DplrKept::states (kStrided, kCtas = 1 only): every kDplrStateStride-th chunk-start
// state and the final one, as the one-block training forward stores them, by the steps' warps
// (the fused reverse pass then makes the pair matrices and X again); its two-CTA build was the
// slower one (benchmarks/NOTES.md c32). DplrKept::f16_states (kF16, kCtas = 1 only): every
// chunk-start state as fp16 records (DplrF16States), by the steps' warps.
//   phase  chain (warps 0-3)          steps (warps 4-7)
//   1      M + P                      X of ci; stage ci + 1; fetch ci + 2; kKeep, kStrided, kF16:
//                                     the state before ci (kStrided: at a stride's start)
//   2      U                          decays of ci + 1; kKeep: ci's pair matrices and X
//   3      o, S+ into registers       factored keys of ci + 1; kKeep: ci's W, Q~, K^, B^, gamma
//   4      S+ over S                  pair matrices of ci + 1 (kKeep: with the chain's warps)
template <typename T, int kCtas, DplrKept kKept>
__global__ void __launch_bounds__(2 * kDplrFusedThreads, kCtas) fused_forward_two_block_kernel(const DplrChunkPass p) {
  using namespace dplr_fused_detail;
  using L = FusedSmem<2>;
  constexpr bool kKeep = kKept == DplrKept::states_and_workspace, kStrided = kKept == DplrKept::states,
                 kF16 = kKept == DplrKept::f16_states;
  static_assert(!(kStrided || kF16) || kCtas == 1, "the kept states: the one-CTA-per-SM build");
  float* const sm = fused_smem();
  const FusedTask task(p);
  const auto [h, n, s, nch] = task;
  const bool chain = threadIdx.x < NTF;  // else the chunk steps
  const int tid = int(threadIdx.x) % NTF;
  const ForwardOut<T, kKept> out(p, task);
  const KeptWorkspace kept(p, task);  // (kKeep)
  ChunkRows<T> rows(p, p.v, s, h, tid);
  float* const S = sm + L::state;
  if (chain) {
    out.init(p, S, tid, NTF);
  } else if (nch > 0) {
    rows.fetch(0);
    rows.stage(ChunkSteps::at<L>(sm, 0), 1.f);
    if (nch > 1) rows.fetch(1);
  }
  __syncthreads();
  if (nch > 0) {  // chunk 0's steps
    const ChunkSteps at = ChunkSteps::at<L>(sm, 0);
    const bool bounded = __syncthreads_and(chain || decay_scan(at, tid));
    if (!chain && bounded) factor_keys(at, tid);
    __syncthreads();
    if (kKeep) pair_matrices<T, true, 8>(at, bounded, p, s, h, 0, int(threadIdx.x));
    else if (!chain) pair_matrices<T, false, 4>(at, bounded, p, s, h, 0, tid);
    __syncthreads();
  }
  for (int64_t ci = 0; ci < nch; ++ci) {
    const ChunkSteps cur = ChunkSteps::at<L>(sm, int(ci & 1)), nxt = ChunkSteps::at<L>(sm, int(~ci & 1));
    const bool more = ci + 1 < nch;
    if (chain) {
      forward_mp(cur.blk, S, sm + L::scr0, tid);
    } else {
      if (tid < 32) solve_x(cur.blk, tid);
      if (more) rows.stage(nxt, 1.f);
      if (ci + 2 < nch) rows.fetch(ci + 2);
      if (kKeep && ci > 0) store_state(out.slot(ci), S, tid, NTF);  // (slot 0: init)
      if (kStrided && ci > 0) out.store_after(ci - 1, S, tid, NTF);
      out.store_before(ci, S, tid);  // (kF16)
    }
    __syncthreads();
    if (chain) forward_u(cur.blk, sm + L::scr0, sm + L::scr1, tid);
    else if (kKeep) kept.store_mats(ci, cur.blk, tid);
    const bool bounded = __syncthreads_and(chain || !more || decay_scan(nxt, tid));
    float next[V / 8][4];
    if (chain) {
      out.rows(p, ci, s.len - ci * C, cur.blk, S, sm + L::scr1, tid);
      forward_next(cur.blk, S, sm + L::scr1, next, tid);
    } else {
      if (more && bounded) factor_keys(nxt, tid);
      // W through M + P's rows, which the chain read last in phase 2
      if (kKeep) kept.store_rows(ci, cur.blk, sm + L::scr0, tid);
    }
    __syncthreads();
    if (chain) write_state(S, next, tid);
    // kKeep: the 3xTF32 pair matrices on all eight warps (the chain's part of this phase is short)
    if (kKeep && more) pair_matrices<T, true, 8>(nxt, bounded, p, s, h, ci + 1, int(threadIdx.x));
    else if (!kKeep && !chain && more) pair_matrices<T, false, 4>(nxt, bounded, p, s, h, ci + 1, tid);
    __syncthreads();
  }
  if (kKeep) {
    if (!chain) store_state(out.slot(nch), S, tid, NTF);
    else kept.finish(p, n, nch, tid, NTF);
  }
  if (kStrided && !chain && nch > 0) out.store_after(nch - 1, S, tid, NTF);  // (the final state)
  if (chain) out.finish(p, S, tid, NTF);
}

}  // namespace fla
