// The chunked RWKV7 engine's fused forward (dplr_chunk_launch.cuh): one CTA of 128 threads per
// (sequence, head) walks the sequence's 16-row chunks with the whole K x V state in shared
// memory and does each chunk's work (docs/algorithms.md §6.3) itself: decays, pair matrices, X
// (dplr_chunk_fused_steps.cuh), U, o and the state update. No workspace: nothing of a chunk
// leaves the CTA but o and, for a training forward, the chunk-start state (hst). The two-kernel
// forward (prep for every chunk, then the sweep) moves ~16x an input's bytes through memory;
// this one reads the inputs and writes o (and the states: 4x an input at K = V = 64). Taken for
// bf16 / fp16 with K = V = 64 (dplr_chunk.h dplr_fused_forward) where the op finds it the faster
// one.
//
// Unlike prep, whose factored pair matrices are 3xTF32 (the backward reads them), these are
// single TF32 products: the inputs are 16-bit here, and the repeated-token case (X from
// cancelling terms) stays within the 16-bit tolerance (tests/test_cuda_emu.py,
// tests/ops/test_rwkv7_inference.py). So o is close to, not bitwise equal to, the two-kernel
// forward's.
#pragma once
#include "dplr_chunk_fused_steps.cuh"

namespace fla {

// kCtas: the CTAs per SM the register budget is cut for (3: up to 168 registers, 4: 128).
// Shared memory holds four. Three give each CTA the shorter chunk step, so the launch takes four
// only where three per SM would leave CTAs for a second wave.
// kStates: a training forward, which stores the chunk-start states in p.hst (an instantiation of
// its own: the stores' addresses cost the four-CTA budget spills that the inference forward
// need not pay).
template <typename T, int kCtas, bool kStates>
__global__ void __launch_bounds__(kDplrFusedThreads, kCtas) fused_forward_kernel(const DplrChunkPass p) {
  using namespace dplr_fused_detail;
  using L = FusedSmem;
  float* const sm = fused_smem();
  const auto [h, n, s, nch] = FusedTask(p);
  const int tid = threadIdx.x, warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
  const float rho = float(p.scale);

  ChunkRows<T> rows(p, p.v, s, h);

  // A training forward's chunk-start states: slot chunk_slot(n, ci) holds the state before chunk
  // ci, the slot after the last chunk the final state (as the sweep stores them).
  const int64_t slot0 = chunk_slot<C>(p.cu_seqlens, n, p.T, 0), slot_floats = int64_t(p.H) * K * V;
  float* const hst = kStates ? static_cast<float*>(p.hst) + (slot0 * p.H + h) * int64_t(K * V) : nullptr;
  float* const S = sm + L::state;
  for (int e = tid; e < K * V; e += NTF) {
    const int d = e / V, x = e % V;
    const float v = p.h0.on() ? *mptr(p.h0, n, h, d, x) : 0.f;
    S[d * LB + x] = v;
    if (kStates) hst[e] = v;
  }
  if (nch > 0) rows.fetch(0);
  const int64_t o_row = p.o.st;
  T* const o0 = vptr<T>(p.o, s.b, s.bos, h, 0);

  for (int64_t ci = 0; ci < nch; ++ci) {
    const int64_t rem = s.len - ci * C;
    rows.stage(sm, 1.f);
    __syncthreads();
    if (ci + 1 < nch) rows.fetch(ci + 1);  // in flight during this chunk's work
    const bool bounded = chunk_decays(sm);
    pair_matrices<T, false>(sm, bounded, p, s, h, ci);
    float* const mats = sm + L::mats;

    // X (warp 0), and M + P = A_ak V + Â S (a warp per 16 columns).
    if (warp == 0) solve_x(sm);
#pragma unroll
    for (int n0 = 16 * warp; n0 < 16 * warp + 16; n0 += 8) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      warp_mma_ld(acc, C, mats + kMatAak * C * LM, LM, sm + L::crow + n0, LB);
      warp_mma_ld(acc, K, sm + L::ahat, LA, S + n0, LB);
#pragma unroll
      for (int e = 0; e < 4; ++e) sm[L::scr0 + (g + 8 * (e / 2)) * LB + n0 + 2 * q + e % 2] = acc[e];
    }
    __syncthreads();

    // U = X (M + P).
#pragma unroll
    for (int n0 = 16 * warp; n0 < 16 * warp + 16; n0 += 8) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      warp_mma_ld(acc, C, mats + kMatX * C * LM, LM, sm + L::scr0 + n0, LB);
#pragma unroll
      for (int e = 0; e < 4; ++e) sm[L::scr1 + (g + 8 * (e / 2)) * LB + n0 + 2 * q + e % 2] = acc[e];
    }
    __syncthreads();

    // o = scale (R^ S + A_rk V + A_rb U), straight from the accumulators.
    T* const oc = o0 + ci * C * o_row;
#pragma unroll
    for (int n0 = 16 * warp; n0 < 16 * warp + 16; n0 += 8) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      warp_mma_ld(acc, K, sm + L::rhat, LA, S + n0, LB);
      warp_mma_ld(acc, C, mats + kMatArk * C * LM, LM, sm + L::crow + n0, LB);
      warp_mma_ld(acc, C, mats + kMatArb * C * LM, LM, sm + L::scr1 + n0, LB);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = g + 8 * (e / 2), x = n0 + 2 * q + e % 2;
        if (i < rem) oc[i * o_row + x * p.o.sd] = from_f<T>(rho * acc[e]);
      }
    }
    // S+ = gamma S + K^^T V + B^^T U: warp w the channels 16w .. 16w + 15, all columns; written
    // after every warp's reads of S above.
    float next[V / 8][4];
    const int d0 = 16 * warp;
#pragma unroll
    for (int nt = 0; nt < V / 8; ++nt) {
      float* const acc = next[nt];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = d0 + g + 8 * (e / 2), x = 8 * nt + 2 * q + e % 2;
        acc[e] = sm[L::gam + d] * S[d * LB + x];
      }
      warp_mma_ld<true, false>(acc, C, sm + L::khat + d0, LB, sm + L::crow + 8 * nt, LB);
      warp_mma_ld<true, false>(acc, C, sm + L::bhat + d0, LB, sm + L::scr1 + 8 * nt, LB);
    }
    __syncthreads();
#pragma unroll
    for (int nt = 0; nt < V / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        S[(d0 + g + 8 * (e / 2)) * LB + 8 * nt + 2 * q + e % 2] = next[nt][e];
    __syncthreads();
    if (kStates) store_state(hst + (ci + 1) * slot_floats, S);  // chunk ci + 1's start
  }
  if (kStates && p.cu_seqlens) {  // hst may be kept as an op output: its varlen gap slots read 0
    const int64_t next =
        n + 1 < p.N ? chunk_slot<C>(p.cu_seqlens, n + 1, p.T, 0) : chunk_slots<C>(p.N, p.T, true);
    for (int64_t slot = slot0 + nch + 1; slot < next; ++slot)
      for (int e = tid; e < K * V; e += NTF) hst[(slot - slot0) * slot_floats + e] = 0.f;
  }
  if (p.hT.on())
    for (int e = tid; e < K * V; e += NTF) {
      const int d = e / V, x = e % V;
      *mptr(p.hT, n, h, d, x) = S[d * LB + x];
    }
}


}  // namespace fla
