// The chunked RWKV7 engine's fused reverse pass (dplr_chunk_launch.cuh), for a backward on the
// fused forward's chunk-start states (DplrKept::states): one CTA (128 threads, or 256 in the
// two-block build) per (sequence, head) walks the sequence's chunks latest first with D, the gradient at the chunk's end, in
// shared memory, and does each chunk's work itself: the decays, pair matrices and X
// (dplr_chunk_fused_steps.cuh), then (docs/algorithms.md §6.4)
//   dU = scale A_rb^T dO + B^ D,  dM = X^T dU,  D <- gamma D + scale R^^T dO + Â^T dM.
// It stores what grad reads: D at every chunk's end (dhst) and the chunk's pair matrices and X
// (ws, in blocks of their own: dplr_mats_offset). In place of prep for every chunk and the
// reverse sweep, which moved the K-part of the workspace (W, Q~, K^, B^: 16 KB a chunk and head)
// through memory twice; this one reads the inputs and writes 22 KB a chunk and head. None of its
// chain needs the state itself.
//
// Numerics: the pair matrices 3xTF32 where factored (as prep's: grad reads them, and X amplifies
// their errors), the chain's products TF32 with fp32 accumulators and an fp32 D (as the reverse
// sweep's).
#pragma once
#include "dplr_chunk_fused_steps.cuh"

namespace fla {
namespace dplr_fused_detail {

// The reverse chain's steps over a chunk's block (crow: scale dO), each by a group of 128
// threads (tid its index), warp w of it on the columns 16w .. 16w + 15 of dU, dM and D: no step
// reads another warp's columns, so the chain needs no barrier of its own.

// dU = scale A_rb^T dO + B^ D into du.
__device__ inline void reverse_du(const float* blk, const float* D, float* du, int tid) {
  using B = ChunkBlock;
  const int x0 = 16 * (tid / 32), g = tid % 32 / 4, q = tid % 4;
#pragma unroll
  for (int n0 = x0; n0 < x0 + 16; n0 += 8) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    warp_mma_ld<true, false>(acc, C, blk + B::mats + kMatArb * C * LM, LM, blk + B::crow + n0, LB);
    warp_mma_ld(acc, K, blk + B::bhat, LB, D + n0, LB);
#pragma unroll
    for (int e = 0; e < 4; ++e) du[(g + 8 * (e / 2)) * LB + n0 + 2 * q + e % 2] = acc[e];
  }
}

// dM = X^T dU into dm, then D <- gamma D + scale R^^T dO + Â^T dM (every channel: 16-channel
// tiles mt, 8-column tiles nt, in registers, then over D).
__device__ inline void reverse_update(const float* blk, float* D, const float* du, float* dm, int tid) {
  using B = ChunkBlock;
  const int x0 = 16 * (tid / 32), g = tid % 32 / 4, q = tid % 4;
#pragma unroll
  for (int n0 = x0; n0 < x0 + 16; n0 += 8) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    warp_mma_ld<true, false>(acc, C, blk + B::mats + kMatX * C * LM, LM, du + n0, LB);
#pragma unroll
    for (int e = 0; e < 4; ++e) dm[(g + 8 * (e / 2)) * LB + n0 + 2 * q + e % 2] = acc[e];
  }
  __syncwarp();
  float next[K / 16][2][4];
#pragma unroll
  for (int mt = 0; mt < K / 16; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float* const acc = next[mt][nt];
      const int n0 = x0 + 8 * nt;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = 16 * mt + g + 8 * (e / 2), x = n0 + 2 * q + e % 2;
        acc[e] = blk[B::gam + d] * D[d * LB + x];
      }
      warp_mma_ld<true, false>(acc, C, blk + B::rhat + 16 * mt, LA, blk + B::crow + n0, LB);
      warp_mma_ld<true, false>(acc, C, blk + B::ahat + 16 * mt, LA, dm + n0, LB);
    }
  __syncwarp();  // the warp's reads of its columns of D, before they are overwritten
#pragma unroll
  for (int mt = 0; mt < K / 16; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) D[(16 * mt + g + 8 * (e / 2)) * LB + x0 + 8 * nt + 2 * q + e % 2] = next[mt][nt][e];
}

// The chunks a reverse pass walks, [lo, hi), as the reverse sweep walks them: all, or the
// backward window's (DplrChunkPass::window_chunks; a sequence with none of its chunks there has
// nothing to do, unless it has no chunk at all and this is the first window, which passes its
// dht on to dh0). What it reads and writes of its task besides the chunks' rows.
struct ReverseWalk {
  int64_t lo, hi;
  bool idle, carried;  // carried: D at the walk's end comes from a later window
  __device__ ReverseWalk(const DplrChunkPass& p, int64_t nch) {
    const bool windowed = p.window_chunks > 0;
    const int64_t end = p.window_begin + p.window_chunks;
    lo = windowed ? p.window_begin : 0;
    hi = windowed && end < nch ? end : nch;
    idle = windowed && lo >= nch && !(nch == 0 && lo == 0);
    carried = hi < nch;
  }
  // D at the walk's end: the next window's carry, or dht.
  __device__ void init(const DplrChunkPass& p, int n, int h, float* D, int tid, int threads) const {
    load_state(D, carried ? p.carry : p.dht, n, h, tid, threads);
  }
  // D = dS+ of chunk ci into its dhst slot.
  __device__ static void store_d(const DplrChunkPass& p, int n, int h, int64_t ci, const float* D, int tid) {
    store_state(static_cast<float*>(p.dhst) + (dplr_work_slot(p, n, ci) * p.H + h) * int64_t(K * V), D, tid, NTF);
  }
  // The chunk's pair matrices and X to grad's block.
  __device__ static void store_mats(const DplrChunkPass& p, int n, int h, int64_t ci, const float* blk, int tid) {
    dplr_fused_detail::store_mats(static_cast<float*>(p.ws) + dplr_mats_offset(p, dplr_ws_slot(p, n, ci), h), blk, tid);
  }
  // D at the walk's start: the previous window's carry, or dh0.
  __device__ void finish(const DplrChunkPass& p, int n, int h, const float* D, int tid, int threads) const {
    save_state(lo > 0 ? p.carry : p.dh0, n, h, D, tid, threads);
  }
};

}  // namespace dplr_fused_detail

// One block (128 threads): each chunk's steps, then its chain. kCtas: as fused_forward_kernel's.
template <typename T, int kCtas>
__global__ void __launch_bounds__(kDplrFusedThreads, kCtas) fused_reverse_kernel(const DplrChunkPass p) {
  using namespace dplr_fused_detail;
  using L = FusedSmem<1>;
  float* const sm = fused_smem();
  const auto [h, n, s, nch] = FusedTask(p);
  const ReverseWalk walk(p, nch);
  if (walk.idle) return;
  const int tid = threadIdx.x;
  const ChunkSteps at = ChunkSteps::at<L>(sm, 0);
  ChunkRows<T, false> rows(p, p.dout, s, h, tid);
  float* const D = sm + L::state;
  walk.init(p, n, h, D, tid, NTF);
  if (walk.hi > walk.lo) rows.fetch(walk.hi - 1);
  for (int64_t ci = walk.hi - 1; ci >= walk.lo; --ci) {
    rows.stage(at, float(p.scale));
    __syncthreads();
    if (ci > walk.lo) rows.fetch(ci - 1);  // in flight during this chunk's work
    ReverseWalk::store_d(p, n, h, ci, D, tid);
    chunk_steps<T, true>(at, p, s, h, ci);
    if (tid < 32) solve_x(at.blk, tid);
    reverse_du(at.blk, D, sm + L::scr0, tid);
    __syncthreads();  // X
    ReverseWalk::store_mats(p, n, h, ci, at.blk, tid);
    reverse_update(at.blk, D, sm + L::scr0, sm + L::scr1, tid);
    __syncthreads();  // the rows, mats and D, before the next chunk's staging and stores
  }
  walk.finish(p, n, h, D, tid, NTF);
}

// Two blocks (256 threads, two CTAs an SM; for few (sequence, head) pairs): warps 0-3 run chunk
// ci's chain on one block while warps 4-7 make chunk ci - 1's in the other; the factored keys
// and the pair matrices, after the chain's part of the chunk, on all eight warps. kCtas: as
// fused_forward_two_block_kernel's.
template <typename T, int kCtas>
__global__ void __launch_bounds__(2 * kDplrFusedThreads, kCtas) fused_reverse_two_block_kernel(const DplrChunkPass p) {
  using namespace dplr_fused_detail;
  using L = FusedSmem<2>;
  float* const sm = fused_smem();
  const auto [h, n, s, nch] = FusedTask(p);
  const ReverseWalk walk(p, nch);
  if (walk.idle) return;
  const bool chain = threadIdx.x < NTF;  // else the chunk steps
  const int tid = int(threadIdx.x) % NTF, all = threadIdx.x;
  ChunkRows<T, false> rows(p, p.dout, s, h, tid);
  float* const D = sm + L::state;
  const float rho = float(p.scale);
  if (chain) {
    walk.init(p, n, h, D, tid, NTF);
  } else if (walk.hi > walk.lo) {
    rows.fetch(walk.hi - 1);
    rows.stage(ChunkSteps::at<L>(sm, 0), rho);
    if (walk.hi - 1 > walk.lo) rows.fetch(walk.hi - 2);
  }
  __syncthreads();
  if (walk.hi > walk.lo) {  // the last chunk's steps
    const ChunkSteps at = ChunkSteps::at<L>(sm, 0);
    const bool bounded = __syncthreads_and(chain || decay_scan(at, tid));
    if (bounded) factor_keys(at, all, 2 * NTF);
    __syncthreads();
    pair_matrices<T, true, 8>(at, bounded, p, s, h, walk.hi - 1, all);
    __syncthreads();
  }
  for (int64_t ci = walk.hi - 1, j = 0; ci >= walk.lo; --ci, ++j) {
    const ChunkSteps cur = ChunkSteps::at<L>(sm, int(j & 1)), nxt = ChunkSteps::at<L>(sm, int(~j & 1));
    const bool more = ci > walk.lo;
    if (chain) {
      ReverseWalk::store_d(p, n, h, ci, D, tid);
      reverse_du(cur.blk, D, sm + L::scr0, tid);
    } else {
      if (tid < 32) solve_x(cur.blk, tid);
      if (more) rows.stage(nxt, rho);
      if (ci - 1 > walk.lo) rows.fetch(ci - 2);
    }
    __syncthreads();  // X
    if (chain) {
      ReverseWalk::store_mats(p, n, h, ci, cur.blk, tid);
      reverse_update(cur.blk, D, sm + L::scr0, sm + L::scr1, tid);
    }
    if (!more) break;
    const bool bounded = __syncthreads_and(chain || decay_scan(nxt, tid));
    if (bounded) factor_keys(nxt, all, 2 * NTF);
    __syncthreads();
    pair_matrices<T, true, 8>(nxt, bounded, p, s, h, ci - 1, all);
    __syncthreads();
  }
  __syncthreads();  // D's last update
  walk.finish(p, n, h, D, all, 2 * NTF);
}

}  // namespace fla
