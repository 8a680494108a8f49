// The chunked RWKV7 engine's products of K-rows and 16 x 16 matrices with state and column tiles
// (dplr_chunk_launch.cuh has the overview): the K-rows' products with a state (rows_state_mma)
// and tensor-core fragments of the 16 x 16 matrices (MatFrag), TF32 or 3xTF32 (X3).
#pragma once
#include "dplr_chunk_layout.cuh"

namespace fla {
namespace dplr_chunk_detail {

// acc[t] (this lane's m16n8 tiles, columns n0 + 8 t .. + 8 of a tile, t < NTL) += R St on TF32
// tensor cores: R a K-row array [C][KP] at offset `rows`, St a state array [K][BP] at offset `st`
// holding TF32 values (grad rounds its states once); each A fragment serves the NTL n-tiles.
// The k of lane q in a k-step are 2q, 2q + 1 (not q, q + 4): its A fragment is one 8-byte load
// per row, and its B rows are 2 apart, at banks 8 apart for BP = 4 mod 32 (q, q + 4 were 4
// apart: two-way conflicts). Lane g takes rows
// tile::kp_perm(g) and + 8 (accumulator rows at kp_row, columns at acc_col). With K % 8 != 0,
// channels past K are masked (the row padding may be unset). RB = false: St holds exact fp32
// values (a grad CTA on strided states keeps S exact for its next state), rounded per read.
// X3 (fp32 inputs): fp32-accurate 3xTF32 products of the whole values (RB is then ignored).
template <int NTL, bool RB = true, bool X3 = false>
__device__ __forceinline__ void rows_state_mma(const float* sm, const Smem& L, int rows, int st,
                                               int n0, float (&acc)[NTL][4]) {
  const int K = L.K, KP = L.KP, BP = L.BP;
  const int g = threadIdx.x % 32 / 4, q = threadIdx.x % 4, pg = tile::kp_perm(g);
  if (K % 8 == 0) {
    const float* pa = sm + rows + pg * KP + 2 * q;
    const float* pb = sm + st + 2 * q * BP + n0 + g;
    for (int k = 0; k < K; k += 8, pa += 8, pb += 8 * BP) {
      const float2 lo = *reinterpret_cast<const float2*>(pa), hi = *reinterpret_cast<const float2*>(pa + 8 * KP);
      // the A fragment's operands once for the NTL n-tiles: as TF32 lane bits (unless X3)
      auto ca = [](float x) { return X3 ? x : __uint_as_float(tile::to_tf32(x)); };
      const float a0 = ca(lo.x), a1 = ca(hi.x), a2 = ca(lo.y), a3 = ca(hi.y);
#pragma unroll
      for (int t = 0; t < NTL; ++t) tile::mma_lanes<X3, true, RB>(acc[t], a0, a1, a2, a3, pb[8 * t], pb[8 * t + BP]);
    }
    return;
  }
  for (int k = 0; k < K; k += 8) {
    auto af = [&](int r, int kk) { return kk < K ? sm[rows + r * KP + kk] : 0.f; };
    auto bf = [&](int kk, int t) { return kk < K ? sm[st + kk * BP + n0 + 8 * t + g] : 0.f; };
    const int k0 = k + 2 * q;
#pragma unroll
    for (int t = 0; t < NTL; ++t)
      tile::mma_lanes<X3, false, RB>(acc[t], af(pg, k0), af(pg + 8, k0), af(pg, k0 + 1), af(pg + 8, k0 + 1), bf(k0, t),
                                     bf(k0 + 1, t));
  }
}

// A fragments (tile_mma.cuh's mma_tf32 layout) of a 16 x 16 matrix M [C][CP] at offset m, or
// of its transpose (tr), both k-steps, with lane q's k in a k-step taken as 2q, 2q + 1 (as
// rows_state_mma: the B operand's rows 2 apart, conflict-free at strides 4 mod 32) and lane g's
// rows as tile::kp_perm(g) and + 8 (accumulator rows at kp_row): f[ks] = (A(p, k), A(p + 8, k),
// A(p, k + 1), A(p + 8, k + 1)), k = 8 ks + 2q, p = kp_perm(g), A = M or M^T. At CP = 20 both
// the 8-byte row reads and the transposed column reads are conflict-free. scale: the fragments
// of scale * A.
template <bool X3 = false>
struct MatFrag {
  uint32_t f[2][4];  // TF32 values, or with X3 the fp32 values whole (split at each product)
  __device__ __forceinline__ MatFrag(const float* sm, int m, bool tr = false, float scale = 1.f) {
    const int q = threadIdx.x % 4, g = tile::kp_perm(threadIdx.x % 32 / 4);
    const int r8 = tr ? 8 : 8 * CP, k1 = tr ? CP : 1, k8 = tr ? 8 * CP : 8;  // row + 8, k + 1, k + 8
    const float* a = sm + m + (tr ? 2 * q * CP + g : g * CP + 2 * q);
    auto cv = [&](float x) { return X3 ? __float_as_uint(scale * x) : tile::to_tf32(scale * x); };
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      if (tr) {
        f[ks][0] = cv(a[ks * k8]), f[ks][1] = cv(a[ks * k8 + r8]), f[ks][2] = cv(a[ks * k8 + k1]),
        f[ks][3] = cv(a[ks * k8 + r8 + k1]);
      } else {  // k, k + 1 adjacent: one 8-byte load per row (CP even)
        const float2 lo = *reinterpret_cast<const float2*>(a + ks * k8), hi = *reinterpret_cast<const float2*>(a + ks * k8 + r8);
        f[ks][0] = cv(lo.x), f[ks][1] = cv(hi.x), f[ks][2] = cv(lo.y), f[ks][3] = cv(hi.y);
      }
    }
  }
  // acc += this (16 x 16) B (16 x 8) with B(k, n) = b(k, n) (lane (g, q) asks for (2q, g),
  // (2q + 1, g), (2q + 8, g), (2q + 9, g)); RB: b gives TF32 values. X3: fp32-accurate
  // (mma_tf32x3; RB is then ignored).
  template <bool RB = false, class B>
  __device__ __forceinline__ void mma(float (&acc)[4], B b) const {
    const int g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
#pragma unroll
    for (int ks = 0; ks < 2; ++ks)
      tile::mma_lanes<X3, true, RB>(acc, __uint_as_float(f[ks][0]), __uint_as_float(f[ks][1]), __uint_as_float(f[ks][2]),
                                    __uint_as_float(f[ks][3]), b(8 * ks + 2 * q, g), b(8 * ks + 2 * q + 1, g));
  }
};

}  // namespace dplr_chunk_detail
}  // namespace fla
