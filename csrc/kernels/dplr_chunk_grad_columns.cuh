// The chunked RWKV7 engine's gradient kernel (dplr_chunk_grad.cuh), step 4 on tensor cores (bf16
// / fp16): the column chain that makes dv, and the products over a tile's columns that the
// K-vector gradients start from (the pair-matrix gradients, the state parts), summed onto a
// warp's accumulators so that a CTA walking several column tiles carries them from tile to tile.
#pragma once
#include "dplr_chunk_layout.cuh"
#include "dplr_chunk_tiles.cuh"

namespace fla {
namespace dplr_chunk_detail {

// grad_kernel, step 4: dv of the tile's columns to its output, and M + P, U, dU, dM into
// shared memory. A warp per slab of NTL 8-column n-tiles chains every 16-row product of its
// columns on tensor cores, with __syncwarp between them:
//   M + P = A_ak V + Â S,  U = X (M + P),  dU = scale A_rb^T dO + B^ dS+,  dM = X^T dU,
//   dV = scale A_rk^T dO + A_ak^T dM + K^ dS+.
// bf16 / fp16: every operand a TF32 value as stored (v, dO widened from 16 bits; S, dS rounded
// by state_rowsum; the chain's own rows rounded by put), so that no product rounds per read, but
// S where kExactS (strided states: S stays exact fp32, rounded per read). fp32 (X3): every
// operand stored whole and split at each 3xTF32 product. The scale goes into the A_rb, A_rk
// fragments. Rows at kp_row (rows_state_mma).
template <typename T, int NTL, bool kExactS>
__device__ __forceinline__ void column_slab_tc(float* sm, const Smem& L, const DplrChunkPass& p, const Cta& c,
                                               int64_t t0, int nrow, float rho, int x0) {
  constexpr bool X3 = std::is_same<T, float>::value;  // fp32: 3xTF32, every operand whole
  const int BP = L.BP;
  auto col = [&](int arr, int t) {
    const int xb = x0 + 8 * t;
    return [=](int k, int n) { return sm[arr + k * BP + xb + n]; };
  };
  auto put = [&](int arr, const float (&acc)[NTL][4]) {  // 8-byte stores, conflict-free (kp_row)
#pragma unroll
    for (int t = 0; t < NTL; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(sm + arr + kp_row(0, 2 * h) * BP + acc_col(x0 + 8 * t, 0)) =
            make_float2(tf32_if<!X3>(acc[t][2 * h]), tf32_if<!X3>(acc[t][2 * h + 1]));
  };
  float mp[NTL][4] = {}, u[NTL][4] = {};
  rows_state_mma<NTL, !kExactS, X3>(sm, L, L.da_rows, L.S, x0, mp);
  {
    const MatFrag<X3> Aak(sm, L.Aak);
#pragma unroll
    for (int t = 0; t < NTL; ++t) Aak.template mma<true>(mp[t], col(L.v, t));
  }
  put(L.M, mp);
  __syncwarp();
  {
    const MatFrag<X3> X(sm, L.X);
#pragma unroll
    for (int t = 0; t < NTL; ++t) X.template mma<true>(u[t], col(L.M, t));
  }
  put(L.U, u);
  float du[NTL][4] = {}, dm[NTL][4] = {}, dv[NTL][4] = {};
  rows_state_mma<NTL, true, X3>(sm, L, L.db_rows, L.dS, x0, du);
  {
    const MatFrag<X3> Arb(sm, L.Arb, true, rho);
#pragma unroll
    for (int t = 0; t < NTL; ++t) Arb.template mma<true>(du[t], col(L.dO, t));
  }
  put(L.dU, du);
  __syncwarp();
  {
    const MatFrag<X3> Xt(sm, L.X, true);
#pragma unroll
    for (int t = 0; t < NTL; ++t) Xt.template mma<true>(dm[t], col(L.dU, t));
  }
  put(L.dM, dm);
  __syncwarp();
  rows_state_mma<NTL, true, X3>(sm, L, L.dk_rows, L.dS, x0, dv);
  {
    const MatFrag<X3> Ark(sm, L.Ark, true, rho), Aak(sm, L.Aak, true);
#pragma unroll
    for (int t = 0; t < NTL; ++t) Ark.template mma<true>(dv[t], col(L.dO, t)), Aak.template mma<true>(dv[t], col(L.dM, t));
  }
#pragma unroll
  for (int t = 0; t < NTL; ++t) {
    const int xx = acc_col(x0 + 8 * t, 0), j = kp_row(0, 0);  // this lane's columns xx, xx + 1; rows j, j + 8
    if (xx >= c.nc) continue;
    T* const row = vptr<T>(p.dv, c.s.b, c.s.bos + t0 + j, c.h, c.x0 + xx);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (j + 8 * h >= nrow) continue;
      T* const at = row + 8 * h * p.dv.st;
      if (p.paths.dv_pairs) {  // (V even: xx + 1 < c.nc too)
        const T pair[2] = {from_f<T>(dv[t][2 * h]), from_f<T>(dv[t][2 * h + 1])};
        uint32_t raw;
        memcpy(&raw, pair, sizeof(raw));
        *reinterpret_cast<uint32_t*>(at) = raw;
      } else {
        at[0] = from_f<T>(dv[t][2 * h]);
        if (xx + 1 < c.nc) at[p.dv.sd] = from_f<T>(dv[t][2 * h + 1]);
      }
    }
  }
}
// The column chain over the tile: 16-column slabs where the tile has them (at 64 columns warps
// 0-3 make it, 4-7 wait at the barrier after it), so that each A fragment (the K-rows, the 16 x
// 16 matrices) is read once for two n-tiles: the A reads were half of the chain's shared-memory
// wavefronts with a warp per 8 columns. After a barrier that follows decay_factor_rows; not
// synchronised.
template <typename T, bool kExactS = false>
__device__ __forceinline__ void column_chain_tc(float* sm, const Smem& L, const DplrChunkPass& p, const Cta& c,
                                                int64_t t0, int nrow, float rho) {
  const int cols = L.cols, warp = threadIdx.x / 32;
  if (cols % 16 == 0)
    for (int x0 = 16 * warp; x0 < cols; x0 += 16 * (NT / 32))
      column_slab_tc<T, 2, kExactS>(sm, L, p, c, t0, nrow, rho, x0);
  else
    for (int x0 = 8 * warp; x0 < cols; x0 += 8 * (NT / 32))
      column_slab_tc<T, 1, kExactS>(sm, L, p, c, t0, nrow, rho, x0);
}

// The TC column products after the chain (after its barrier): sums over the tile's columns, each
// added onto a warp's accumulators (so that a CTA walking several tiles carries them from tile to
// tile) and put into shared memory by the put_ functions once complete. They take warp_mma_nt's
// 16-byte fragments on rows 4 apart (conflict-free, one load per fragment instead of four 4-byte
// loads, each with its own index arithmetic); the 8-column tiles of K > 128 keep the 4-byte forms.
__device__ __forceinline__ bool nt_fragments(const Smem& L) { return L.cols % 16 == 0; }

// The pair-matrix gradients as 16 x 16 products over the columns, warp w making product w / 2
// (rk, rb, ak, dX) for 8 of j; X3: fp32-accurate.
static_assert(NT / 32 == 8, "4 products x 2 column tiles");
template <bool X3 = false>
__device__ __forceinline__ void pair_grad_product(const float* sm, const Smem& L, float (&acc)[4]) {
  const int warp = threadIdx.x / 32, m = warp / 2, j0 = 8 * (warp % 2);
  const int A = m < 2 ? L.dO : m == 2 ? L.dM : L.dU, B = m == 1 ? L.U : m == 3 ? L.M : L.v;
  if (nt_fragments(L)) warp_mma_nt<true, true, X3>(acc, L.cols, sm + A, L.BP, sm + B + j0 * L.BP, L.BP);
  else warp_mma_ld<false, true, false, false, X3>(acc, L.cols, sm + A, L.BP, sm + B + j0 * L.BP, L.BP);
}
// pair_grad_product's sums into dA (scaled, within their triangles) and dX (below the diagonal:
// the rest cannot reach dA_ab).
__device__ __forceinline__ void put_pair_grads(float* sm, const Smem& L, const float (&acc)[4], float rho) {
  const int warp = threadIdx.x / 32, m = warp / 2, j0 = 8 * (warp % 2);
  const bool nt = nt_fragments(L);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int i = nt ? nt_row(0, e) : acc_row(0, e), j = nt ? nt_col(j0, e) : acc_col(j0, e);
    const bool on = m < 2 ? j <= i : j < i;
    if (m == 3) sm[L.dX + i * CP + j] = on ? acc[e] : 0.f;
    else sm[L.dA + 4 * (i * C + j) + m] = on ? (m < 2 ? rho : 1.f) * acc[e] : 0.f;
  }
}

// The state parts of the K-vector gradients, dO S^T, dM S^T, v dS^T, U dS^T ([C][K] over the
// columns), as tasks of 4 n-tiles (32 channels) of one product: a task's A fragments serve all
// four. Tasks 0 .. state_part_tasks(L) - 1. kExactS: S exact fp32 (strided states), rounded
// per read.
__device__ __forceinline__ int state_part_groups(const Smem& L) { return ((L.K + 7) / 8 + 3) / 4; }
__device__ __forceinline__ int state_part_tasks(const Smem& L) { return 4 * state_part_groups(L); }
template <bool kExactS = false, bool X3 = false>
__device__ __forceinline__ void state_part_product(const float* sm, const Smem& L, int task, float (&acc)[4][4]) {
  const int K = L.K, BP = L.BP, cols = L.cols, ntile = (K + 7) / 8, ngrp = state_part_groups(L);
  const int m = task / ngrp, n00 = 32 * (task % ngrp), nb = min(4, ntile - n00 / 8);
  const int A = m == 0 ? L.dO : m == 1 ? L.dM : m == 2 ? L.v : L.U, B = m < 2 ? L.S : L.dS;
  if (nt_fragments(L)) {  // state rows past K: the next array's (their columns are not stored)
    if (X3) tile::warp_mma_nt_tiles<true, true, 4, X3>(acc, nb, cols, sm + A, BP, sm + B + n00 * BP, BP);
    else if (kExactS && m < 2) tile::warp_mma_nt_tiles<true, false, 4>(acc, nb, cols, sm + A, BP, sm + B + n00 * BP, BP);
    else tile::warp_mma_nt_tiles<true, true, 4>(acc, nb, cols, sm + A, BP, sm + B + n00 * BP, BP);
  } else {
    for (int t = 0; t < nb; ++t)
      warp_mma<X3>(acc[t], cols, [&](int r, int k) { return sm[A + r * BP + k]; },
               [&](int k, int n) { return n00 + 8 * t + n < K ? sm[B + (n00 + 8 * t + n) * BP + k] : 0.f; });
  }
}
// A task's sums into its gradient rows (dr, da, dk, db; Â, K^, B^ there are spent once put) and,
// for v dS^T and U dS^T, zeta's parts sum_j K^_j (v_j dS+^T), sum_j B^_j (U_j dS+^T) into zparts.
__device__ __forceinline__ void put_state_part(float* sm, const Smem& L, int task, const float (&acc)[4][4]) {
  const int K = L.K, KP = L.KP, ntile = (K + 7) / 8, ngrp = state_part_groups(L);
  const int m = task / ngrp, n00 = 32 * (task % ngrp), nb = min(4, ntile - n00 / 8);
  const int D = m == 0 ? L.dr_rows : m == 1 ? L.da_rows : m == 2 ? L.dk_rows : L.db_rows;
  const bool nt = nt_fragments(L);
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    if (t >= nb) break;  // warp-uniform
    const int n0 = n00 + 8 * t;
    float z[2] = {0.f, 0.f};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = nt ? nt_col(n0, e) : acc_col(n0, e), at = (nt ? nt_row(0, e) : acc_row(0, e)) * KP + d;
      if (d >= K) continue;
      if (m >= 2) z[e % 2] += sm[D + at] * acc[t][e];  // K^, B^ there until this write
      sm[D + at] = acc[t][e];
    }
    if (m >= 2) {  // warp-uniform: summed over the 16 rows (lanes g)
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        for (int lanes = 4; lanes < 32; lanes *= 2) z[h2] += __shfl_xor_sync(0xffffffffu, z[h2], lanes);
        const int d = nt ? nt_col(n0, h2) : acc_col(n0, h2);
        if (threadIdx.x % 32 < 4 && d < K) sm[L.zparts + (m - 2) * K + d] = z[h2];
      }
    }
  }
}

// The next chunk-start state, for a grad CTA walking a stride of chunks on strided states
// (DplrKept::states: bf16 / fp16, K = V = 64 or 128, 64-column tiles): S+ = gamma S + K^^T V +
// B^^T U on the CTA's tile, the forward's update (dplr_chunk_fused.cuh forward_next) from
// operands the CTA holds anyway. S stays exact fp32 in shared memory through such a CTA's chunk
// (its products round it per read), so gamma S is exact, and the products are TF32 as the
// forward's. Warp w makes channels 16 (w % (KK / 16)) .. + 16 of the tile's columns: at K = 64
// columns 32 (w / 4) .. + 32, at K = 128 all 64, in passes of four m16n8 tiles (lane (g, q):
// channels + g, + g + 8, columns + 8 t + 2 q, + 1). The k of lane q in a k-step are 2q, 2q + 1
// (as rows_state_mma): the K-rows and tile rows it reads are 2 apart, on banks 8 apart at
// strides of 4 mod 32 floats (no conflicts).
template <int KK>
struct NextState {
  static constexpr int kK = KK, kCols = 64, kBlocks = KK / 16;
  static_assert(KK == 64 || KK == 128, "a warp per 16 channels and 32 or 64 columns");
  static constexpr int kPasses = kCols / (NT / 32 / kBlocks) / 32;  // of four n-tiles
  uint32_t kt[2][4], bt[2][4];  // A fragments of K^^T and B^^T, both k-steps
  float acc[4][4];
  __device__ __forceinline__ static int d0() { return 16 * (threadIdx.x / 32 % kBlocks) + threadIdx.x % 32 / 4; }
  __device__ __forceinline__ static int x0(int pass) {
    return 32 * (kPasses * (threadIdx.x / 32 / kBlocks) + pass) + 2 * (threadIdx.x % 4);
  }
  // K^^T and B^^T into registers (dk_rows, db_rows, complete since decay_factor_rows), before
  // a barrier after which put_state_part writes over them.
  __device__ __forceinline__ void load_keys(const float* sm, const Smem& L) {
    const int q = threadIdx.x % 4;
    const float *k = sm + L.dk_rows + 2 * q * L.KP + d0(), *b = sm + L.db_rows + 2 * q * L.KP + d0();
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      const int r = 8 * ks * L.KP;
      kt[ks][0] = tile::to_tf32(k[r]), kt[ks][1] = tile::to_tf32(k[r + 8]), kt[ks][2] = tile::to_tf32(k[r + L.KP]),
      kt[ks][3] = tile::to_tf32(k[r + L.KP + 8]);
      bt[ks][0] = tile::to_tf32(b[r]), bt[ks][1] = tile::to_tf32(b[r + 8]), bt[ks][2] = tile::to_tf32(b[r + L.KP]),
      bt[ks][3] = tile::to_tf32(b[r + L.KP + 8]);
    }
  }
  // gamma S + K^^T V + B^^T U of a pass's columns, after load_keys (V, U, S and gamma are read
  // here: nothing writes them before the next chunk), then put: after a barrier where other
  // warps may still read S, else straight away (a thread writes the elements it read alone).
  __device__ __forceinline__ void update(const float* sm, const Smem& L, int pass = 0) {
    const int g = threadIdx.x % 32 / 4, q = threadIdx.x % 4, x = x0(pass), xb = x - 2 * q + g;  // lane's B column
#pragma unroll
    for (int t = 0; t < 4; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float2 v = *reinterpret_cast<const float2*>(sm + L.S + (d0() + 8 * h) * L.BP + x + 8 * t);
        const float gam = sm[L.zgam + d0() + 8 * h];
        acc[t][2 * h] = gam * v.x, acc[t][2 * h + 1] = gam * v.y;
      }
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {  // V and U rows hold TF32 values (widened; put's rounding)
        const float *v = sm + L.v + (8 * ks + 2 * q) * L.BP + xb + 8 * t, *u = sm + L.U + (8 * ks + 2 * q) * L.BP + xb + 8 * t;
        mma_tf32(acc[t], kt[ks][0], kt[ks][1], kt[ks][2], kt[ks][3], __float_as_uint(v[0]), __float_as_uint(v[L.BP]));
        mma_tf32(acc[t], bt[ks][0], bt[ks][1], bt[ks][2], bt[ks][3], __float_as_uint(u[0]), __float_as_uint(u[L.BP]));
      }
    }
  }
  // S+ over S, once no step of this chunk reads S.
  __device__ __forceinline__ void put(float* sm, const Smem& L, int pass = 0) const {
#pragma unroll
    for (int t = 0; t < 4; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(sm + L.S + (d0() + 8 * h) * L.BP + x0(pass) + 8 * t) =
            make_float2(acc[t][2 * h], acc[t][2 * h + 1]);
  }
  // Every pass in place (update, then put), after the barrier that ends this chunk's reads of S
  // (a CTA walking the tiles: each tile's state after its products).
  __device__ __forceinline__ void update_in_place(float* sm, const Smem& L) {
    load_keys(sm, L);
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) update(sm, L, pass), put(sm, L, pass);
  }
};

}  // namespace dplr_chunk_detail
}  // namespace fla
