// The chunked RWKV7 engine's fused inference forward (dplr_chunk_launch.cuh): one CTA of 128
// threads per (sequence, head) walks the sequence's 16-row chunks with the whole K x V state in
// shared memory and does each chunk's work (docs/algorithms.md §6.3) itself: decays, pair
// matrices, X, U, o and the state update. No workspace: nothing of a chunk leaves the CTA but o
// and, for a training forward, the chunk-start state (hst). The two-kernel forward (prep for
// every chunk, then the sweep) moves ~16x an input's bytes through memory; this one reads the
// inputs and writes o (and the states: 4x an input at K = V = 64). Taken for bf16 / fp16 with
// K = V = 64 (dplr_chunk.h dplr_fused_forward) where the op finds it the faster one.
//
// Numerics: TF32 tensor-core products with fp32 accumulators and an fp32 state; every exponent
// from an added-up decay sum. The pair matrices are products of rows factored at the chunk start
// (r e^G, a e^E against k e^-G, b e^-G) when every channel's total decay over the chunk is >= -60
// (checked per chunk, as prep does), else every pair's factor is taken from its own segment sum
// (SIMT, the exact walk; any w in [-inf, 0]). Unlike prep, whose factored pair matrices are
// 3xTF32 (the backward reads them), these are single TF32 products: the inputs are 16-bit here,
// and the repeated-token case (X from cancelling terms) stays within the 16-bit tolerance
// (tests/test_cuda_emu.py, tests/ops/test_rwkv7_inference.py). So o is close to, not bitwise
// equal to, the two-kernel forward's.
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

// A chunk's six input row blocks move as 16-byte pieces, one of each block per thread.
constexpr int kPieceElems = 8, kPiecesPerRow = K / kPieceElems;
static_assert(NTF == C * kPiecesPerRow, "a piece of each block per thread");
static_assert(LA % 4 == 0 && LB % 4 == 0, "rows of 16-byte aligned floats");

}  // namespace dplr_fused_detail

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
  extern __shared__ float4 fused_sm4[];
  float* const sm = reinterpret_cast<float*>(fused_sm4);
  const int h = int(blockIdx.x) % p.H, n = int(blockIdx.x) / p.H;
  const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
  const int64_t nch = (s.len + C - 1) / C;
  const int tid = threadIdx.x, warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
  const float rho = float(p.scale);

  // Raw rows of chunk ci into registers, 0 past the sequence (w = 0 keeps the state, k = v = b =
  // 0 add nothing): a 16-byte piece of each of the six blocks per thread, row tid / kPiecesPerRow,
  // channels kPieceElems (tid % kPiecesPerRow) on. With `vec` (rows in whole aligned pieces) a
  // piece is one load, else one per element. Addresses step from this thread's piece of the
  // sequence's first rows: the batch, head and channel terms stay out of the chunk loop.
  const int prow = tid / kPiecesPerRow, pcol = kPieceElems * (tid % kPiecesPerRow);
  const bool vec = p.paths.rows_16byte;  // the launch's dplr_chunk_detail::input_rows_in_pieces
  const VecArg* const src[6] = {&p.r, &p.w, &p.k, &p.v, &p.a, &p.b};
  const T* first[6];
#pragma unroll
  for (int m = 0; m < 6; ++m) first[m] = vptr<T>(*src[m], s.b, s.bos + prow, h, pcol);
  uint4 piece[6];
  auto fetch = [&](int64_t ci) {
    const bool on = ci < nch && prow < s.len - ci * C;
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
  };
  // The raw rows to their arrays: r, a into R^, Â (scaled in place by the scan), k, b into K^, B^,
  // w and v to theirs.
  auto stage = [&]() {
    const int dst[6] = {L::rhat, L::wrow, L::khat, L::vrow, L::ahat, L::bhat};
    const int ld[6] = {LA, K, LB, LB, LA, LB};
#pragma unroll
    for (int m = 0; m < 6; ++m) {
      T e[kPieceElems];
      memcpy(e, &piece[m], sizeof e);
      float4* const d = reinterpret_cast<float4*>(sm + dst[m] + prow * ld[m] + pcol);
      d[0] = make_float4(to_f(e[0]), to_f(e[1]), to_f(e[2]), to_f(e[3]));
      d[1] = make_float4(to_f(e[4]), to_f(e[5]), to_f(e[6]), to_f(e[7]));
    }
  };

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
    if (kStates) {  // chunk ci + 1's start
      float* const at = hst + (ci + 1) * slot_floats;
#pragma unroll
      for (int e = 4 * tid; e < K * V; e += 4 * NTF)
        *reinterpret_cast<float4*>(at + e) = *reinterpret_cast<const float4*>(S + e / V * LB + e % V);
    }
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
