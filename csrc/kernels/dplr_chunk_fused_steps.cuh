// What the chunked RWKV7 engine's fused kernels (one CTA of 128 threads per (sequence, head)
// walking the sequence's 16-row chunks: the forward, dplr_chunk_fused.cuh, and the reverse pass,
// dplr_chunk_fused_reverse.cuh) do alike for every chunk: fetch its rows, the decays, the pair
// matrices and X (docs/algorithms.md §6.3). Taken for bf16 / fp16 with K = V = 64
// (dplr_chunk.h dplr_fused_forward).
//
// Numerics: TF32 tensor-core products with fp32 accumulators; every exponent from an added-up
// decay sum. The pair matrices are products of rows factored at the chunk start (r e^G, a e^E
// against k e^-G, b e^-G) when every channel's total decay over the chunk is >= -60 (checked per
// chunk, as prep does), else every pair's factor is taken from its own segment sum (SIMT, the
// exact walk; any w in [-inf, 0]).
#pragma once
#include <cstdint>
#include <cstring>

#include "dplr_chunk.h"
#include "elements.cuh"
#include "tile_mma.cuh"

namespace fla {

// Threads of a fused CTA (at namespace scope: nvcc takes no qualified name in a template's
// __launch_bounds__).
constexpr int kDplrFusedThreads = 128;

// A fused kernel's dynamic shared memory (FusedSmem's floats; 16-byte aligned).
__device__ __forceinline__ float* fused_smem() {
  extern __shared__ float4 fused_sm4[];
  return reinterpret_cast<float*>(fused_sm4);
}

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

// Shared memory (floats), sized so that four CTAs fit an SM (the kernels are latency-bound: at
// 512 (sequence, head) pairs on 132 SMs, three CTAs per SM leave a second, mostly empty wave).
// `crow`, the column-side rows, holds v in the forward and scale dO in the reverse pass; `state`
// S in the forward and D (the gradient at the chunk's end) in the reverse pass. Two scratch
// blocks hold in turn what a chunk needs only for a phase, barriers between:
//   scr0: w [C][K] (the decay scan; the exact pair walks) -> k e^-G [C][LA] (the factored pair
//         products) -> M + P (forward) or dU (reverse) [C][LB];
//   scr1: b e^-G [C][LA] (the factored pair products) -> U (forward) or dM (reverse) [C][LB].
struct FusedSmem {
  static constexpr int rhat = 0;                  // R^ = r e^G                       [C][LA]
  static constexpr int ahat = rhat + C * LA;      // Â = a e^E                        [C][LA]
  static constexpr int khat = ahat + C * LA;      // K^ = k e^Omega (raw k first)      [C][LB]
  static constexpr int bhat = khat + C * LB;      // B^ = b e^Omega (raw b first)      [C][LB]
  static constexpr int crow = bhat + C * LB;      // v, or scale dO                    [C][LB]
  static constexpr int scr0 = crow + C * LB;      // w, then k e^-G, then M + P or dU   [C][LB]
  static constexpr int scr1 = scr0 + C * LB;      // b e^-G, then U or dM               [C][LB]
  static constexpr int wrow = scr0, ktil = scr0;
  static constexpr int btil = scr1;
  static constexpr int state = scr1 + C * LB;     // S, or D                           [K][LB]
  static constexpr int gam = state + K * LB;      // gamma = e^(chunk total)           [K]
  // A_rk, A_rb, A_ak, A_ab, then X: [5][C][LM], laid out as DplrWorkspaceLayout::mats_at() holds
  // them (the reverse pass stores them for grad as one block)
  static constexpr int mats = gam + K;
  static constexpr int total = mats + 5 * C * LM;
  static constexpr size_t bytes() { return size_t(total) * sizeof(float); }
  static_assert(C * K <= C * LB && C * LA <= C * LB, "scratch blocks hold w, k e^-G, b e^-G");
  static_assert(mats % 4 == 0 && (C * LM) % 4 == 0, "the matrices move as 16-byte pieces");
};
constexpr int kMatArk = 0, kMatArb = 1, kMatAak = 2, kMatAab = 3, kMatX = 4;  // blocks of `mats`

// A chunk's six input row blocks move as 16-byte pieces, one of each block per thread.
constexpr int kPieceElems = 8, kPiecesPerRow = K / kPieceElems;
static_assert(NTF == C * kPiecesPerRow, "a piece of each block per thread");
static_assert(LA % 4 == 0 && LB % 4 == 0, "rows of 16-byte aligned floats");

// A fused CTA's task: head h of sequence n (blockIdx.x = n H + h), the sequence's rows and chunks.
struct FusedTask {
  int h, n;
  SeqSpan s;
  int64_t nch;
  __device__ explicit FusedTask(const DplrChunkPass& p)
      : h(int(blockIdx.x) % p.H), n(int(blockIdx.x) / p.H), s(seq_span(p.cu_seqlens, n, p.T)),
        nch((s.len + C - 1) / C) {}
};

// A K x V state held in shared memory at row stride LB (`state`) to a contiguous fp32 slot of
// hst or dhst, 16-byte stores. After the barrier that ends its update; not synchronised.
__device__ __forceinline__ void store_state(float* at, const float* state) {
#pragma unroll
  for (int e = 4 * int(threadIdx.x); e < K * V; e += 4 * NTF)
    *reinterpret_cast<float4*>(at + e) = *reinterpret_cast<const float4*>(state + e / V * LB + e % V);
}

// The six row blocks of a sequence's chunks (r, w, k, the column side `cols`: v or dO, a, b), a
// 16-byte piece of each per thread: row tid / kPiecesPerRow, channels kPieceElems (tid %
// kPiecesPerRow) on. fetch() takes chunk ci's into registers (0 past the sequence: w = 0 keeps
// the state, k = v = b = 0 add nothing, dO = 0 sends nothing back), stage() puts them into their
// arrays. With `vec` (the launch's input_rows_in_pieces: rows in whole aligned pieces) a piece is
// one load, else one per element. Addresses step from this thread's piece of the sequence's
// first rows: the batch, head and channel terms stay out of the chunk loop.
template <typename T>
struct ChunkRows {
  const VecArg* src[6];
  const T* first[6];
  uint4 piece[6];
  int prow, pcol;
  int64_t len;
  bool vec;
  __device__ ChunkRows(const DplrChunkPass& p, const VecArg& cols, const SeqSpan& s, int h)
      : prow(int(threadIdx.x) / kPiecesPerRow), pcol(kPieceElems * (int(threadIdx.x) % kPiecesPerRow)),
        len(s.len), vec(p.paths.rows_16byte) {
    src[0] = &p.r, src[1] = &p.w, src[2] = &p.k, src[3] = &cols, src[4] = &p.a, src[5] = &p.b;
#pragma unroll
    for (int m = 0; m < 6; ++m) first[m] = vptr<T>(*src[m], s.b, s.bos + prow, h, pcol);
  }
  __device__ void fetch(int64_t ci) {
    const bool on = prow < len - ci * C;
#pragma unroll
    for (int m = 0; m < 6; ++m) {
      const T* const at = first[m] + ci * C * src[m]->st;
      if (vec) {
        piece[m] = on ? *reinterpret_cast<const uint4*>(at) : make_uint4(0, 0, 0, 0);
      } else {
        T e[kPieceElems];
#pragma unroll
        for (int i = 0; i < kPieceElems; ++i) e[i] = on ? at[i * src[m]->sd] : from_f<T>(0.f);
        memcpy(&piece[m], e, sizeof e);
      }
    }
  }
  // r, a into R^, Â (scaled in place by chunk_decays), k, b into K^, B^, w to its scratch and the
  // column side times col_scale to crow.
  __device__ void stage(float* sm, float col_scale) const {
    using L = FusedSmem;
    const int dst[6] = {L::rhat, L::wrow, L::khat, L::crow, L::ahat, L::bhat};
    const int ld[6] = {LA, K, LB, LB, LA, LB};
#pragma unroll
    for (int m = 0; m < 6; ++m) {
      T e[kPieceElems];
      memcpy(e, &piece[m], sizeof e);
      const float f = m == 3 ? col_scale : 1.f;
      float4* const d = reinterpret_cast<float4*>(sm + dst[m] + prow * ld[m] + pcol);
      d[0] = make_float4(f * to_f(e[0]), f * to_f(e[1]), f * to_f(e[2]), f * to_f(e[3]));
      d[1] = make_float4(f * to_f(e[4]), f * to_f(e[5]), f * to_f(e[6]), f * to_f(e[7]));
    }
  }
};

// The decays of a staged chunk, a thread per channel and direction, the channel's w in
// registers: Omega_i (rows after i) from a backward sum (threads 0..K-1: K^, B^), E_i (exclusive)
// and G_i = E_{i+1} from a forward one (threads K..2K-1: R^, Â, gamma and the bound). Every
// exponent an added-up sum of w <= 0, except the factored key rows' -G, bounded by the check.
// Then, where bounded, k e^-G = K^ / gamma and b e^-G = B^ / gamma (gamma >= e^-60 there).
// After the staging barrier; ends synchronised. Returns whether the chunk is bounded
// (CTA-uniform).
__device__ inline bool chunk_decays(float* sm) {
  using L = FusedSmem;
  const int tid = threadIdx.x;
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
  if (bounded)
    for (int e = tid; e < C * K; e += NTF) {
      const int i = e / K, d = e % K;
      const float inv = 1.f / sm[L::gam + d];
      sm[L::ktil + i * LA + d] = sm[L::khat + i * LB + d] * inv;
      sm[L::btil + i * LA + d] = sm[L::bhat + i * LB + d] * inv;
    }
  __syncthreads();
  return bounded;
}

// The pair matrices A_rk, A_rb (j <= i), A_ak, A_ab (j < i) into `mats`. Bounded: warp m makes
// matrix m as 16 x 16 tensor-core products over K of the factored rows, single TF32 (kX3 =
// false: the forward, whose inputs are 16-bit and whose o stays within their tolerance) or
// fp32-accurate 3xTF32 (kX3: the reverse pass, whose matrices grad reads, as prep's). Else every
// pair's factor from its own segment sum, the raw rows re-read (a rare path). Ends synchronised.
template <typename T, bool kX3>
__device__ inline void pair_matrices(float* sm, bool bounded, const DplrChunkPass& p, const SeqSpan& s, int h,
                                     int64_t ci) {
  using L = FusedSmem;
  const int tid = threadIdx.x, warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
  float* const mats = sm + L::mats;
  if (bounded) {
    const int rows = warp < 2 ? L::rhat : L::ahat, cols = warp % 2 ? L::btil : L::ktil;
    const bool incl = warp < 2;
#pragma unroll
    for (int n0 = 0; n0 < C; n0 += 8) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      if (kX3) {
        const float* pa = sm + rows + g * LA + q;
        const float* pb = sm + cols + (n0 + g) * LA + q;
#pragma unroll 4
        for (int c0 = 0; c0 < K; c0 += 8, pa += 8, pb += 8) {
          const float av[4] = {pa[0], pa[8 * LA], pa[4], pa[8 * LA + 4]}, bv[2] = {pb[0], pb[4]};
          tile::mma_tf32x3(acc, av, bv);
        }
      } else {
        warp_mma_ld<false, true>(acc, K, sm + rows, LA, sm + cols + n0 * LA, LA);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = g + 8 * (e / 2), j = n0 + 2 * q + e % 2;
        mats[warp * C * LM + i * LM + j] = (incl ? j <= i : j < i) ? acc[e] : 0.f;
      }
    }
  } else {
    const int64_t rem = s.len - ci * C;
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
      mats[kMatArk * C * LM + i * LM + j] = rk, mats[kMatArb * C * LM + i * LM + j] = rb;
      mats[kMatAak * C * LM + i * LM + j] = ak, mats[kMatAab * C * LM + i * LM + j] = ab;
    }
  }
  __syncthreads();
}

// X = (I - A_ab)^-1 by forward substitution into its block of `mats`, on warp 0 (a lane per
// column, held in registers; A_ab's rows read as broadcasts). Every entry is written (the upper
// triangle explicit zeros). Not synchronised.
__device__ inline void solve_x(float* sm) {
  using L = FusedSmem;
  const int j = threadIdx.x;
  if (j >= C) return;
  const float* const A = sm + L::mats + kMatAab * C * LM;
  float* const X = sm + L::mats + kMatX * C * LM;
  float x[C];
#pragma unroll
  for (int i = 0; i < C; ++i) {
    float acc = i == j ? 1.f : 0.f;  // x[m] = 0 for m < j: exact zeros
#pragma unroll
    for (int m = 0; m < i; ++m) acc += A[i * LM + m] * x[m];
    x[i] = acc;
  }
#pragma unroll
  for (int i = 0; i < C; ++i) X[i * LM + j] = x[i];
}

}  // namespace dplr_fused_detail
}  // namespace fla
