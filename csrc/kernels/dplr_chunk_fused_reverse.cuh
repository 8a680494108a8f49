// The chunked RWKV7 engine's fused reverse pass (dplr_chunk_launch.cuh), for a backward on the
// fused forward's chunk-start states (DplrKept::states): one CTA of 128 threads per (sequence,
// head) walks the sequence's chunks latest first with D, the gradient at the chunk's end, in
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

// kCtas: as fused_forward_kernel's.
template <typename T, int kCtas>
__global__ void __launch_bounds__(kDplrFusedThreads, kCtas) fused_reverse_kernel(const DplrChunkPass p) {
  using namespace dplr_fused_detail;
  using L = FusedSmem;
  float* const sm = fused_smem();
  const auto [h, n, s, nch] = FusedTask(p);
  const int tid = threadIdx.x, warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
  // The chunks walked, [c_lo, c_hi), as the reverse sweep walks them: all, or the backward
  // window's (DplrChunkPass::window_chunks; a sequence with none of its chunks there has nothing
  // to do, unless it has no chunk at all and this is the first window, which passes its dht on
  // to dh0).
  const bool windowed = p.window_chunks > 0;
  const int64_t c_lo = windowed ? p.window_begin : 0;
  const int64_t c_end = p.window_begin + p.window_chunks, c_hi = windowed && c_end < nch ? c_end : nch;
  if (windowed && c_lo >= nch && !(nch == 0 && c_lo == 0)) return;

  ChunkRows<T> rows(p, p.dout, s, h);
  float* const D = sm + L::state;
  const MatArg& init = c_hi < nch ? p.dcarry : p.dht;
  for (int e = tid; e < K * V; e += NTF) {
    const int d = e / V, x = e % V;
    D[d * LB + x] = init.on() ? *mptr(init, n, h, d, x) : 0.f;
  }
  if (c_hi > c_lo) rows.fetch(c_hi - 1);
  const float rho = float(p.scale);
  float* const mats = sm + L::mats;
  // This warp's 16 columns: every step of the chain below reads and writes only its own columns
  // of dU, dM and D, so the chain needs no barrier of its own.
  const int x0 = 16 * warp;

  for (int64_t ci = c_hi - 1; ci >= c_lo; --ci) {
    rows.stage(sm, rho);  // crow: scale dO
    __syncthreads();
    if (ci > c_lo) rows.fetch(ci - 1);  // in flight during this chunk's work
    // D = dS+ of chunk ci into its dhst slot
    store_state(static_cast<float*>(p.dhst) + (dplr_work_slot(p, n, ci) * p.H + h) * int64_t(K * V), D);
    const bool bounded = chunk_decays(sm);
    pair_matrices<T, true>(sm, bounded, p, s, h, ci);

    // X (warp 0), and dU = scale A_rb^T dO + B^ D (every warp, its columns) into scr0.
    if (warp == 0) solve_x(sm);
#pragma unroll
    for (int n0 = x0; n0 < x0 + 16; n0 += 8) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      warp_mma_ld<true, false>(acc, C, mats + kMatArb * C * LM, LM, sm + L::crow + n0, LB);
      warp_mma_ld(acc, K, sm + L::bhat, LB, D + n0, LB);
#pragma unroll
      for (int e = 0; e < 4; ++e) sm[L::scr0 + (g + 8 * (e / 2)) * LB + n0 + 2 * q + e % 2] = acc[e];
    }
    __syncthreads();  // X

    // The pair matrices and X to grad's block (16-byte stores).
    {
      float* const out = static_cast<float*>(p.ws) + dplr_mats_offset(p, dplr_ws_slot(p, n, ci), h);
      for (int e = tid; e < 5 * C * LM / 4; e += NTF)
        reinterpret_cast<float4*>(out)[e] = reinterpret_cast<const float4*>(mats)[e];
    }
    // dM = X^T dU into scr1.
#pragma unroll
    for (int n0 = x0; n0 < x0 + 16; n0 += 8) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      warp_mma_ld<true, false>(acc, C, mats + kMatX * C * LM, LM, sm + L::scr0 + n0, LB);
#pragma unroll
      for (int e = 0; e < 4; ++e) sm[L::scr1 + (g + 8 * (e / 2)) * LB + n0 + 2 * q + e % 2] = acc[e];
    }
    __syncwarp();

    // D <- gamma D + scale R^^T dO + Â^T dM: the warp's columns, every channel (16-channel tiles
    // mt, 8-column tiles nt), in registers, then over D.
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
          acc[e] = sm[L::gam + d] * D[d * LB + x];
        }
        warp_mma_ld<true, false>(acc, C, sm + L::rhat + 16 * mt, LA, sm + L::crow + n0, LB);
        warp_mma_ld<true, false>(acc, C, sm + L::ahat + 16 * mt, LA, sm + L::scr1 + n0, LB);
      }
    __syncwarp();  // the warp's reads of its columns of D, before they are overwritten
#pragma unroll
    for (int mt = 0; mt < K / 16; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          D[(16 * mt + g + 8 * (e / 2)) * LB + x0 + 8 * nt + 2 * q + e % 2] = next[mt][nt][e];
    __syncthreads();  // the rows, mats and D, before the next chunk's staging and stores
  }
  const MatArg& fin = c_lo > 0 ? p.dcarry : p.dh0;
  if (fin.on())
    for (int e = tid; e < K * V; e += NTF) {
      const int d = e / V, x = e % V;
      *mptr(fin, n, h, d, x) = D[d * LB + x];
    }
}

}  // namespace fla
