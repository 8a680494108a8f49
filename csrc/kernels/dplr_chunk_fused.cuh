// The chunked RWKV7 engine's fused inference forward (dplr_chunk_launch.cuh): one CTA of 128
// threads per (sequence, head) walks the sequence's 16-row chunks with the whole K x V state in
// shared memory and does each chunk's work (docs/algorithms.md §6.3) itself: decays, pair
// matrices, X, U, o and the state update. No workspace: nothing of a chunk leaves the CTA but o.
// The two-kernel forward (prep for every chunk, then the sweep) moves ~16x an input's bytes
// through memory; this one reads the inputs and writes o. Taken for bf16 / fp16 with K = V = 64
// when no chunk-start state is stored (dplr_chunk.h dplr_fused_forward).
//
// Numerics are those of prep and the sweep: TF32 tensor-core products with fp32 accumulators
// and an fp32 state; every exponent from an added-up decay sum. The pair matrices are products
// of rows factored at the chunk start (r e^G, a e^E against k e^-G, b e^-G) when every channel's
// total decay over the chunk is >= -60 (checked per chunk, as prep does), else every pair's
// factor is taken from its own segment sum (SIMT, the exact walk; any w in [-inf, 0]).
#pragma once
#include <cstdint>
#include <cstring>

#include "dplr_chunk.h"
#include "elements.cuh"
#include "tile_mma.cuh"

namespace fla {

// Threads of a fused-forward CTA (at namespace scope: nvcc takes no qualified name in a
// template's __launch_bounds__).
constexpr int kDplrFusedThreads = 128;

namespace dplr_fused_detail {

using elements::from_f;
using elements::mptr;
using elements::to_f;
using elements::vptr;
using tile::warp_mma_ld;

constexpr int C = kDplrChunk, K = 64, V = 64, NTF = kDplrFusedThreads;
// Row strides (floats): rows read as an mma's A operand [row][k], or as a transposed B operand
// ([n][k]), at LA = 4 mod 32 (lanes g, q at banks 4g + q); rows read as a B operand [k][n] or a
// transposed A operand ([k][m]) at LB = 8 mod 32 (banks 8q + g). LM: the 16 x 16 matrices (as
// kDplrMatStride).
constexpr int LA = K + 4, LB = V + 8, LM = kDplrMatStride;

// Shared memory (floats), sized so that four CTAs fit an SM (the kernel is latency-bound: at
// 512 (sequence, head) pairs on 132 SMs, three CTAs per SM leave a second, mostly empty wave).
// Two scratch blocks hold in turn what a chunk needs only for a phase, barriers between:
//   scr0: w [C][K] (the decay scan; the exact pair walks) -> k e^-G [C][LA] (the factored pair
//         products) -> M + P [C][LB];
//   scr1: b e^-G [C][LA] (the factored pair products) -> U [C][LB].
// X is solved over A_ab's block (A_ab is not read after it).
struct FusedSmem {
  static constexpr int rhat = 0;                  // R^ = r e^G                       [C][LA]
  static constexpr int ahat = rhat + C * LA;      // Â = a e^E                        [C][LA]
  static constexpr int khat = ahat + C * LA;      // K^ = k e^Omega (raw k first)      [C][LB]
  static constexpr int bhat = khat + C * LB;      // B^ = b e^Omega (raw b first)      [C][LB]
  static constexpr int vrow = bhat + C * LB;      // v                                 [C][LB]
  static constexpr int scr0 = vrow + C * LB;      // w, then k e^-G, then M + P         [C][LB]
  static constexpr int scr1 = scr0 + C * LB;      // b e^-G, then U                     [C][LB]
  static constexpr int wrow = scr0, ktil = scr0, mp = scr0;
  static constexpr int btil = scr1, urow = scr1;
  static constexpr int state = scr1 + C * LB;     // S                                 [K][LB]
  static constexpr int gam = state + K * LB;      // gamma = e^(chunk total)           [K]
  static constexpr int mats = gam + K;            // A_rk, A_rb, A_ak, A_ab then X     [4][C][LM]
  static constexpr int total = mats + 4 * C * LM;
  static constexpr size_t bytes() { return size_t(total) * sizeof(float); }
  static_assert(C * K <= C * LB && C * LA <= C * LB, "scratch blocks hold w, k e^-G, b e^-G");
};
constexpr int kMatX = 3;  // X's block in `mats` (over A_ab)

// Elements of the six input row blocks of a chunk a thread holds between its load and its store
// to shared memory: element e = threadIdx.x + NTF * it of each block, row e / K, channel e % K
// (under the four-CTA budget, it = 2j and 2j + 1 in one register).
constexpr int kPer = C * K / NTF;
static_assert(kPer % 2 == 0, "rows held in pairs");

template <typename T>
__device__ __forceinline__ uint32_t pack_pair(T lo, T hi) {
  static_assert(sizeof(T) == 2, "the fused kernel takes 16-bit inputs");
  uint16_t a, b;
  memcpy(&a, &lo, 2);
  memcpy(&b, &hi, 2);
  return uint32_t(a) | uint32_t(b) << 16;
}
template <typename T>
__device__ __forceinline__ float unpack_half(uint32_t pair, int which) {
  const uint16_t bits = uint16_t(which ? pair >> 16 : pair & 0xffffu);
  T x;
  memcpy(&x, &bits, 2);
  return to_f(x);
}

}  // namespace dplr_fused_detail

// kCtas: the CTAs per SM the register budget is cut for (3: 168 registers; 4: 128, a few bytes
// spilled). Shared memory holds four. Three give each CTA the shorter chunk step, so the launch
// takes four only where three per SM would leave CTAs for a second wave.
template <typename T, int kCtas>
__global__ void __launch_bounds__(kDplrFusedThreads, kCtas) fused_forward_kernel(const DplrChunkPass p) {
  using namespace dplr_fused_detail;
  using L = FusedSmem;
  extern __shared__ float4 fused_sm4[];
  float* const sm = reinterpret_cast<float*>(fused_sm4);
  const int h = int(blockIdx.x) % p.H, n = int(blockIdx.x) / p.H;
  const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
  const int64_t nch = (s.len + C - 1) / C;
  const int tid = threadIdx.x, warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
  const float rho = float(p.scale);

  // Raw rows of chunk ci into registers (0 past the sequence: w = 0 keeps the state, k = v = b =
  // 0 add nothing). The addresses start from this thread's element of each input in the
  // sequence's first row block (row tid / K, channel tid % K) and step by rows: the batch, head
  // and channel terms leave the chunk loop. Under the four-CTA register budget two 16-bit
  // elements share a register.
  constexpr bool kPack = kCtas >= 4;
  uint32_t packed[6][kPer / 2];
  T pre[6][kPer];
  const T* first[6];
  int64_t row_step[6];
  {
    const VecArg* const src[6] = {&p.r, &p.w, &p.k, &p.v, &p.a, &p.b};
#pragma unroll
    for (int m = 0; m < 6; ++m)
      first[m] = vptr<T>(*src[m], s.b, s.bos + tid / K, h, tid % K), row_step[m] = src[m]->st;
  }
  auto fetch = [&](int64_t ci) {
    const int64_t rem = ci < nch ? s.len - ci * C : 0;
    auto row = [&](int m, int it) {
      const int i = (tid + NTF * it) / K;
      return i < rem ? first[m][(ci * C + i - tid / K) * row_step[m]] : from_f<T>(0.f);
    };
#pragma unroll
    for (int m = 0; m < 6; ++m)
#pragma unroll
      for (int j = 0; j < kPer / 2; ++j) {
        if constexpr (kPack) {
          packed[m][j] = pack_pair(row(m, 2 * j), row(m, 2 * j + 1));
        } else {
          pre[m][2 * j] = row(m, 2 * j);
          pre[m][2 * j + 1] = row(m, 2 * j + 1);
        }
      }
  };
  // The raw rows to their arrays: r, a into R^, Â (scaled in place by the scan), k, b into K^, B^,
  // w and v to theirs.
  auto stage = [&]() {
    const int dst[6] = {L::rhat, L::wrow, L::khat, L::vrow, L::ahat, L::bhat};
    const int ld[6] = {LA, K, LB, LB, LA, LB};
#pragma unroll
    for (int m = 0; m < 6; ++m)
#pragma unroll
      for (int it = 0; it < kPer; ++it) {
        const int e = tid + NTF * it, i = e / K, d = e % K;
        sm[dst[m] + i * ld[m] + d] = kPack ? unpack_half<T>(packed[m][it / 2], it % 2) : to_f(pre[m][it]);
      }
  };

  float* const S = sm + L::state;
  for (int e = tid; e < K * V; e += NTF) {
    const int d = e / V, x = e % V;
    S[d * LB + x] = p.h0.on() ? *mptr(p.h0, n, h, d, x) : 0.f;
  }
  if (nch > 0) fetch(0);
  const int64_t o_row = p.o.st;
  T* const o0 = vptr<T>(p.o, s.b, s.bos, h, 0);

  for (int64_t ci = 0; ci < nch; ++ci) {
    const int64_t rem = s.len - ci * C;
    stage();
    __syncthreads();
    if (ci + 1 < nch) fetch(ci + 1);  // in flight during this chunk's work

    // Decays, a thread per channel and direction, the channel's w in registers: Omega_i (rows
    // after i) from a backward sum (threads 0..K-1: K^, B^), E_i (exclusive) and G_i = E_{i+1}
    // from a forward one (threads K..2K-1: R^, Â, gamma and the bound). Every exponent an added-up
    // sum of w <= 0, except the factored key rows' -G, bounded by the check.
    bool bounded = true;
    {
      const int d = tid % K;
      float wv[C];
#pragma unroll
      for (int i = 0; i < C; ++i) wv[i] = sm[L::wrow + i * K + d];
      float e = 0.f;
      if (tid < K) {
#pragma unroll
        for (int i = C - 1; i >= 0; --i) {  // K^, B^ = (k, b) e^Omega
          const float f = expf(e);
          sm[L::khat + i * LB + d] *= f;
          sm[L::bhat + i * LB + d] *= f;
          e += wv[i];
        }
      } else {
#pragma unroll
        for (int i = 0; i < C; ++i) {
          const float gi = e + wv[i];
          sm[L::rhat + i * LA + d] *= expf(gi);
          sm[L::ahat + i * LA + d] *= expf(e);
          e = gi;
        }
        sm[L::gam + d] = expf(e);
        bounded = e >= -60.f;
      }
    }
    bounded = __syncthreads_and(bounded);
    if (bounded)  // k e^-G = K^ / gamma, b e^-G = B^ / gamma (gamma >= e^-60 here)
      for (int e = tid; e < C * K; e += NTF) {
        const int i = e / K, d = e % K;
        const float inv = 1.f / sm[L::gam + d];
        sm[L::ktil + i * LA + d] = sm[L::khat + i * LB + d] * inv;
        sm[L::btil + i * LA + d] = sm[L::bhat + i * LB + d] * inv;
      }
    __syncthreads();

    // The pair matrices: A_rk, A_rb (j <= i), A_ak, A_ab (j < i).
    float* const mats = sm + L::mats;
    if (bounded) {  // warp m: matrix m, as 16 x 16 tensor-core products over K
      const int rows = warp < 2 ? L::rhat : L::ahat, cols = warp % 2 ? L::btil : L::ktil;
      const bool incl = warp < 2;
#pragma unroll
      for (int n0 = 0; n0 < C; n0 += 8) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        warp_mma_ld<false, true>(acc, K, sm + rows, LA, sm + cols + n0 * LA, LA);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = g + 8 * (e / 2), j = n0 + 2 * q + e % 2;
          mats[warp * C * LM + i * LM + j] = (incl ? j <= i : j < i) ? acc[e] : 0.f;
        }
      }
    } else {  // every pair's factor from its own segment sum (raw rows re-read: a rare path)
      for (int e = tid; e < C * C; e += NTF) {
        const int i = e / C, j = e % C;
        float rk = 0.f, rb = 0.f, ak = 0.f, ab = 0.f;
        if (j <= i && i < rem) {
          const int64_t ti = s.bos + ci * C + i, tj = s.bos + ci * C + j;
          for (int d = 0; d < K; ++d) {
            float seg = 0.f;  // sum of w over rows j < s < i
            for (int r = j + 1; r < i; ++r) seg += sm[L::wrow + r * K + d];
            const float kj = to_f(*vptr<T>(p.k, s.b, tj, h, d)), bj = to_f(*vptr<T>(p.b, s.b, tj, h, d));
            const float fi = expf(seg + (i > j ? sm[L::wrow + i * K + d] : 0.f));
            const float ri = to_f(*vptr<T>(p.r, s.b, ti, h, d)) * fi;
            rk += ri * kj, rb += ri * bj;
            if (j < i) {
              const float ai = to_f(*vptr<T>(p.a, s.b, ti, h, d)) * expf(seg);
              ak += ai * kj, ab += ai * bj;
            }
          }
        }
        mats[0 * C * LM + i * LM + j] = rk, mats[1 * C * LM + i * LM + j] = rb;
        mats[2 * C * LM + i * LM + j] = ak, mats[3 * C * LM + i * LM + j] = ab;
      }
    }
    __syncthreads();

    // X = (I - A_ab)^-1 by forward substitution (warp 0, a lane per column), and M + P =
    // A_ak V + Â S (a warp per 16 columns).
    if (warp == 0) {  // column j in registers; A's rows read as broadcasts
      const int j = tid;
      const float* const A = mats + 3 * C * LM;
      float x[C];
      if (j < C)
#pragma unroll
        for (int i = 0; i < C; ++i) {
          float acc = i == j ? 1.f : 0.f;  // x[m] = 0 for m < j: exact zeros
#pragma unroll
          for (int m = 0; m < i; ++m) acc += A[i * LM + m] * x[m];
          x[i] = acc;
        }
      __syncwarp();  // every lane's reads of A_ab before X overwrites it
      if (j < C)
#pragma unroll
        for (int i = 0; i < C; ++i) mats[kMatX * C * LM + i * LM + j] = x[i];
    }
#pragma unroll
    for (int n0 = 16 * warp; n0 < 16 * warp + 16; n0 += 8) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      warp_mma_ld(acc, C, mats + 2 * C * LM, LM, sm + L::vrow + n0, LB);
      warp_mma_ld(acc, K, sm + L::ahat, LA, S + n0, LB);
#pragma unroll
      for (int e = 0; e < 4; ++e) sm[L::mp + (g + 8 * (e / 2)) * LB + n0 + 2 * q + e % 2] = acc[e];
    }
    __syncthreads();

    // U = X (M + P).
#pragma unroll
    for (int n0 = 16 * warp; n0 < 16 * warp + 16; n0 += 8) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      warp_mma_ld(acc, C, mats + kMatX * C * LM, LM, sm + L::mp + n0, LB);
#pragma unroll
      for (int e = 0; e < 4; ++e) sm[L::urow + (g + 8 * (e / 2)) * LB + n0 + 2 * q + e % 2] = acc[e];
    }
    __syncthreads();

    // o = scale (R^ S + A_rk V + A_rb U), straight from the accumulators.
    T* const oc = o0 + ci * C * o_row;
#pragma unroll
    for (int n0 = 16 * warp; n0 < 16 * warp + 16; n0 += 8) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      warp_mma_ld(acc, K, sm + L::rhat, LA, S + n0, LB);
      warp_mma_ld(acc, C, mats, LM, sm + L::vrow + n0, LB);
      warp_mma_ld(acc, C, mats + C * LM, LM, sm + L::urow + n0, LB);
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
      warp_mma_ld<true, false>(acc, C, sm + L::khat + d0, LB, sm + L::vrow + 8 * nt, LB);
      warp_mma_ld<true, false>(acc, C, sm + L::bhat + d0, LB, sm + L::urow + 8 * nt, LB);
    }
    __syncthreads();
#pragma unroll
    for (int nt = 0; nt < V / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        S[(d0 + g + 8 * (e / 2)) * LB + 8 * nt + 2 * q + e % 2] = next[nt][e];
    __syncthreads();
  }
  if (p.hT.on())
    for (int e = tid; e < K * V; e += NTF) {
      const int d = e / V, x = e % V;
      *mptr(p.hT, n, h, d, x) = S[d * LB + x];
    }
}


}  // namespace fla
