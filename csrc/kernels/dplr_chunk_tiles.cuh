// The chunked RWKV7 engine's products of K-rows and 16 x 16 matrices with state and column tiles
// (dplr_chunk_launch.cuh has the overview): SIMT dot products, TF32 tensor-core fragments of
// the 16 x 16 matrices (MatFrag), and the backward's pseudo-values U = X (M + P).
#pragma once
#include "dplr_chunk_layout.cuh"

namespace fla {
namespace dplr_chunk_detail {

// s0 += sum_d R[i][d] St[d][x] and s1 the same for row i + C / 2: two K-rows (arrays [C][KP]
// at offset R, 4 channels per read; nothing at or past K is read, where the padding may be
// unset) against column x of a [K][BP] state array at offset St.
__device__ __forceinline__ void rows_dot_state(const float* sm, const Smem& L, int R, int St,
                                               int i, int x, float& s0, float& s1) {
  const int BP = L.BP;
  const float *r0 = sm + R + i * L.KP, *r1 = r0 + (C / 2) * L.KP, *st = sm + St + x;
  int d = 0;
  for (; d + 4 <= L.K; d += 4) {
    const float4 s4 = make_float4(st[d * BP], st[(d + 1) * BP], st[(d + 2) * BP], st[(d + 3) * BP]);
    s0 = dot4(ld4(r0 + d), s4, s0), s1 = dot4(ld4(r1 + d), s4, s1);
  }
  for (; d < L.K; ++d) s0 += r0[d] * st[d * BP], s1 += r1[d] * st[d * BP];
}

// acc[t] (this lane's m16n8 tiles, columns n0 + 8 t .. + 8 of a tile, t < NTL) += R St on TF32
// tensor cores: R a K-row array [C][KP] at offset `rows`, St a state array [K][BP] at offset `st`
// holding TF32 values (grad rounds its states once); each A fragment serves the NTL n-tiles.
// bf16 / fp16 inputs only, as warp_mma. The k of lane q in a k-step are 2q, 2q + 1 (not q,
// q + 4): its A fragment is one 8-byte load per row, and its B rows are 2 apart, at banks 8
// apart for BP = 4 mod 32 (q, q + 4 were 4 apart: two-way conflicts). Lane g takes rows
// tile::kp_perm(g) and + 8 (accumulator rows at kp_row, columns at acc_col). With K % 8 != 0,
// channels past K are masked (the row padding may be unset). RB = false: St holds exact fp32
// values (a grad CTA on strided states keeps S exact for its next state), rounded per read.
template <int NTL, bool RB = true>
__device__ __forceinline__ void rows_state_mma(const float* sm, const Smem& L, int rows, int st,
                                               int n0, float (&acc)[NTL][4]) {
  const int K = L.K, KP = L.KP, BP = L.BP;
  const int g = threadIdx.x % 32 / 4, q = threadIdx.x % 4, pg = tile::kp_perm(g);
  using tile::to_tf32;
  if (K % 8 == 0) {
    const float* pa = sm + rows + pg * KP + 2 * q;
    const float* pb = sm + st + 2 * q * BP + n0 + g;
    for (int k = 0; k < K; k += 8, pa += 8, pb += 8 * BP) {
      const float2 lo = *reinterpret_cast<const float2*>(pa), hi = *reinterpret_cast<const float2*>(pa + 8 * KP);
      const uint32_t a0 = to_tf32(lo.x), a1 = to_tf32(hi.x), a2 = to_tf32(lo.y), a3 = to_tf32(hi.y);
#pragma unroll
      for (int t = 0; t < NTL; ++t)
        mma_tf32(acc[t], a0, a1, a2, a3, RB ? __float_as_uint(pb[8 * t]) : to_tf32(pb[8 * t]),
                 RB ? __float_as_uint(pb[8 * t + BP]) : to_tf32(pb[8 * t + BP]));
    }
    return;
  }
  for (int k = 0; k < K; k += 8) {
    auto a = [&](int r, int kk) { return kk < K ? to_tf32(sm[rows + r * KP + kk]) : 0u; };
    auto b = [&](int kk, int t) {
      const float x = kk < K ? sm[st + kk * BP + n0 + 8 * t + g] : 0.f;
      return RB ? __float_as_uint(x) : to_tf32(x);
    };
    const int k0 = k + 2 * q;
#pragma unroll
    for (int t = 0; t < NTL; ++t)
      mma_tf32(acc[t], a(pg, k0), a(pg + 8, k0), a(pg, k0 + 1), a(pg + 8, k0 + 1), b(k0, t), b(k0 + 1, t));
  }
}

// M + P into M (M = A_ak V, P = Â S: the backward needs only their sum), then U = X (M + P) (Â at
// `ah`, the 16 x 16 matrices zero-filled: fixed 16-term sums), exact SIMT (fp32 inputs; the
// tensor-core path is grad's column chain): thread (column x, rows i and i + 8), so that each
// state or tile element read serves two rows. Ends synchronised.
__device__ inline void pseudo_values(float* sm, const Smem& L, int ah) {
  const int BP = L.BP;
  for (int e = threadIdx.x; e < (C / 2) * L.cols; e += NT) {
    const int i = e >> L.lc, x = e & (L.cols - 1);
    const float *k0 = sm + L.Aak + i * CP, *k1 = k0 + (C / 2) * CP;
    float p0 = 0.f, p1 = 0.f, m0 = 0.f, m1 = 0.f;
    rows_dot_state(sm, L, ah, L.S, i, x, p0, p1);
#pragma unroll
    for (int jj = 0; jj < C; ++jj) {
      const float v = sm[L.v + jj * BP + x];
      m0 += k0[jj] * v, m1 += k1[jj] * v;
    }
    sm[L.M + i * BP + x] = m0 + p0, sm[L.M + (i + C / 2) * BP + x] = m1 + p1;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < (C / 2) * L.cols; e += NT) {
    const int i = e >> L.lc, x = e & (L.cols - 1);
    const float *x0 = sm + L.X + i * CP, *x1 = x0 + (C / 2) * CP;
    float u0 = 0.f, u1 = 0.f;
#pragma unroll
    for (int l = 0; l < C; ++l) {
      const float mp = sm[L.M + l * BP + x];
      u0 += x0[l] * mp, u1 += x1[l] * mp;
    }
    sm[L.U + i * BP + x] = u0, sm[L.U + (i + C / 2) * BP + x] = u1;
  }
  __syncthreads();
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
    auto cb = [](float x) { return RB ? __float_as_uint(x) : tile::to_tf32(x); };
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      if constexpr (X3) {
        tile::mma_tf32x3(acc,
                         {__uint_as_float(f[ks][0]), __uint_as_float(f[ks][1]), __uint_as_float(f[ks][2]),
                          __uint_as_float(f[ks][3])},
                         {b(8 * ks + 2 * q, g), b(8 * ks + 2 * q + 1, g)});
      } else {
        tile::mma_tf32(acc, f[ks][0], f[ks][1], f[ks][2], f[ks][3], cb(b(8 * ks + 2 * q, g)),
                       cb(b(8 * ks + 2 * q + 1, g)));
      }
    }
  }
};

}  // namespace dplr_chunk_detail
}  // namespace fla
