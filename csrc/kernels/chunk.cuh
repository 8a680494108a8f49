// CUDA engine for the chunked diagonal-gate algebra of kernels/chunk.h (docs/algorithms.md §1-§5).
//
// Kernels (fp32 arithmetic; the tile products run on TF32 tensor cores for bf16/fp16 inputs and
// on exact SIMT FMA for fp32 inputs, never plain TF32 there: tile_mma.cuh):
//   intra  (chunk slot, H)  the pair matrix A (kept in a workspace, computed once whatever V;
//          chunk_intra.cuh).
//   state  (N, H, tiles)  the state passes, sequential over chunks, with the state in registers:
//          forward hst (and o when K <= 128), backward dHst and the zeta partials
//          (chunk_state.cuh).
//   out    (chunk slot, H, V/64)  forward o = ρ(Q̂ S + A V) (K > 128), backward
//          dv = K̂ dS+ + ρ Aᵀ dO (chunk_out.cuh).
//   grad_qk (chunk slot, H, K/64)  dA, dq, dk (inter + intra), dg by the segmented reverse
//          cumsum with exact resets, the u terms and the du partials; GSA's softmax (over the
//          value-side forward's o) and its backward (over dq) as epilogues (chunk_grad_qk.cuh).
// Launch sequences: chunk_launch.cuh. This file: what the kernels share (constants, ex2, where a
// CTA's chunk lives, the tile loads and stores, the decay exponents and the scaled rows).
// Decay exponents (log2 units) are only ever *added* (§2.6 additive segment sums), so they are
// <= 0 in every factor, -inf is exact and nothing cancels: off-diagonal sub-chunk blocks use the
// §1.2 boundary references (query from its sub-chunk start, key to its sub-chunk end, the
// sub-chunk totals in between); inside a diagonal block the same scheme runs once more on 4-row
// micro-blocks, and only pairs inside one micro-block sum λ pair by pair.
#pragma once
#include <type_traits>

#include "async_copy.cuh"
#include "chunk.h"
#include "chunk_pieces.cuh"
#include "elements.cuh"
#include "sequence.h"
#include "tile_mma.cuh"

namespace fla {
namespace chunk_detail {
using namespace elements;

constexpr int C = kChunk, SC = kSubChunk, NSC = kChunk / kSubChunk;
using tile::DT, tile::LD, tile::NTH, tile::Tile, tile::TileB, tile::Tri, tile::tf32_if;
constexpr float kLog2e = 1.4426950408889634f;

// 2^x with results below 2^-126 flushed to 0 (ex2.approx.ftz: exp2f's accuracy, without its
// 4-instruction denormal path per call). Every factor here is <= 1 and multiplies O(1) terms,
// so a flushed factor changes a result by < 1e-38 absolute; 2^-inf = 0 exactly.
__device__ __forceinline__ float ex2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else  // tests/cuda_emu
  const float y = exp2f(x);
  return y < 1.17549435e-38f ? 0.f : y;
#endif
}
static_assert(C == DT && DT == kChunkTile && NTH == 4 * DT && NSC == 4, "tile shapes");

// The products run on TF32 tensor cores for bf16/fp16 inputs and on exact fp32 FMA for fp32.
template <typename T>
constexpr bool kTC = !std::is_same_v<T, float>;
template <typename T>
using Acc = tile::Frag<kTC<T>>;

// Where one CTA's chunk lives.
struct Pos {
  int n, L;
  int64_t b, t0, slot, c, nch;
};

__device__ __forceinline__ int64_t num_chunks(int64_t len) { return (len + C - 1) / C; }

// Chunk slot -> (sequence, chunk); false for slots that hold no chunk (final-state / gap slots).
__device__ __forceinline__ bool locate(const ChunkPass& p, int64_t slot, Pos& o) {
  const int n = slot_sequence(p.cu_seqlens, p.N, p.T, slot);
  const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
  const int64_t c = slot - chunk_slot(p.cu_seqlens, n, p.T, 0), nch = num_chunks(s.len);
  if (c < 0 || c >= nch) return false;
  o.n = n, o.b = s.b, o.t0 = s.bos + c * C, o.L = int(s.len - c * C < C ? s.len - c * C : C);
  o.slot = slot, o.c = c, o.nch = nch;
  return true;
}

// Tile loads (chunk_pieces.cuh): a kernel fetches a tile's 16-byte pieces into registers and
// stores them to shared memory afterwards, converted there, so a tile costs one memory latency and
// the next one can be in flight while the current one is used (the state kernel holds the next
// chunk's pieces; the out kernel fetches each operand one step ahead). SubChunkRows (below) holds a
// thread's column of a sub-chunk instead, for the scalings that walk it in registers.

// Asks L2 for rows t < pos.L of a's columns [c0, c0 + n) (nothing for an off argument), one
// prefetch a 128-byte line shared out over the CTA's threads, so that a later tile load (or an
// epilogue's: dq_softmax_w, the dg / dk that grad_qk adds into) finds them on chip instead of the
// CTA waiting on memory there. Issued once the registers of the loads before it are free: at a
// kernel's start its addresses stayed live and the kernels spilled.
template <typename E>
__device__ __forceinline__ void prefetch_rows(const VecArg& a, const Pos& pos, int h, int c0, int n) {
  constexpr int PER_LINE = 128 / sizeof(E);
  const int lines = (n + PER_LINE - 1) / PER_LINE;
  if (!a.on()) return;
  for (int i = threadIdx.x; i < pos.L * lines; i += NTH)
    prefetch_l2(vptr<E>(a, pos.b, pos.t0 + i / lines, h, c0 + (i % lines) * PER_LINE));
}

// Columns [k0, k0 + n) of q (WITH_Q), k and λ to L2, the rows of a K tile: what intra and grad_qk's phase 2 load.
template <typename T, bool WITH_Q = true>
__device__ __forceinline__ void prefetch_key_tile(const ChunkPass& p, const Pos& pos, int h, int k0, int n) {
  if (WITH_Q) prefetch_rows<T>(p.q, pos, h, k0, n);
  prefetch_rows<T>(p.k, pos, h, k0, n);
  prefetch_rows<T>(p.g, pos, h, k0, n);
}

// A chunk's pair matrix (fp32 [C][C], from amat) into a shared tile of row stride N by cp.async:
// no registers and no wait until its product.
template <int N>
__device__ __forceinline__ void copy_pairs(float (*a)[N], const float* src) {
  for (int e = threadIdx.x; e < C * C / 4; e += NTH)
    copy16(&a[e / (C / 4)][4 * (e % (C / 4))], src + 4 * e, true);
  copy_commit();
}

// A fragment's 64 x 64 values into a shared tile, then out to a row-major fp32 matrix row by row
// (thread x writes column x % DT of rows x / DT + 4 it): consecutive threads write consecutive
// elements, where the fragment layout would scatter 8-byte pieces over 16 rows.
template <class F, bool TF = false, int N>  // TF: as TF32 values (tf32_round)
__device__ __forceinline__ void stage(const F& f, float (*s)[N], float mul) {
#pragma unroll
  for (int i = 0; i < 16; ++i) s[F::row(i)][F::col(i)] = tile::tf32_if<TF>(mul * f.v[i]);
}
// A fragment (rows = time, columns = channels d0..) straight into an activation, times mul: one
// base pointer, the per-element offsets from the fragment layout's compile-time pattern.
template <typename T, class F>
__device__ __forceinline__ void store_frag(const F& f, const VecArg& a, int64_t b, int64_t t0,
                                           int L, int h, int d0, int D, float mul, bool adds = false) {
  T* base = vptr<T>(a, b, t0 + F::row(0), h, d0 + F::col(0));
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int dr = F::row(i) - F::row(0), dc = F::col(i) - F::col(0);
    if (F::row(i) < L && d0 + F::col(i) < D) {
      T& x = base[dr * a.st + dc * a.sd];
      x = from_f<T>(adds ? mul * f.v[i] + to_f(x) : mul * f.v[i]);
    }
  }
}
// Per channel of a K tile: sub-chunk totals τ_m and, from them by addition only, the factors
// before[m] = exp2(Σ_{l<m} τ_l), after[m] = exp2(Σ_{l>m} τ_l), gap[m'][m] = exp2(Σ_{m'<l<m} τ_l)
// and gamma = exp2(Σ τ).
struct Decays {
  float tau[NSC][DT], before[NSC][DT], after[NSC][DT], gap[NSC][NSC][DT], gamma[DT];
};

template <int N>
__device__ __forceinline__ void chunk_decays(Decays& d, const float (*lam)[N]) {
  const int m = threadIdx.x / DT, ch = threadIdx.x % DT;
  float t = 0.f;
#pragma unroll
  for (int i = 0; i < SC; ++i) t += lam[m * SC + i][ch];
  d.tau[m][ch] = t;
  __syncthreads();
  float tau[NSC];
#pragma unroll
  for (int l = 0; l < NSC; ++l) tau[l] = d.tau[l][ch];
  float b = 0.f, a = 0.f;
#pragma unroll
  for (int l = 0; l < NSC; ++l) {
    if (l < m) b += tau[l];
    if (l > m) a += tau[l];
  }
  d.before[m][ch] = ex2(b), d.after[m][ch] = ex2(a);
#pragma unroll
  for (int mk = 0; mk < NSC; ++mk) {  // gap[mk][m] = exp2(Σ_{mk<l<m} τ_l)
    float g = 0.f;
#pragma unroll
    for (int l = 0; l < NSC; ++l)
      if (l > mk && l < m) g += tau[l];
    d.gap[mk][m][ch] = ex2(g);
  }
  if (m == 0) d.gamma[ch] = ex2(tau[0] + tau[1] + tau[2] + tau[3]);
  __syncthreads();
}

// The scale_reader / scale_key walks with the rows in registers, for a kernel that needs the
// scaled tile alone (no λ in shared memory, no Decays): thread (m, ch) fetches rows m SC ..
// (m + 1) SC of channel ch of x and λ (zero outside the sequence and past D, as RowPieces), sums
// its sub-chunk total τ_m in the same order as chunk_decays, trades the totals through tau
// (NSC x DT floats; one barrier) and stores x times exp2 of the same exponents as the walks.
// Held as loaded (converted in put_scaled), so that the next K tile's rows can be fetched while
// the current one is used.
template <typename T>
struct SubChunkRows {
  T x[SC], lam[SC];
  __device__ __forceinline__ void fetch(const VecArg& xa, const VecArg& ga, int64_t b, int64_t t0,
                                        int L, int h, int d0, int D) {
    const int m = threadIdx.x / DT, ch = threadIdx.x % DT;
    const bool on = d0 + ch < D;
    const int left = on ? L - m * SC : 0;  // rows of this thread inside the sequence
    const T* px = on && xa.on() && left > 0 ? vptr<T>(xa, b, t0 + m * SC, h, d0 + ch) : nullptr;
    const T* pg = on && ga.on() && left > 0 ? vptr<T>(ga, b, t0 + m * SC, h, d0 + ch) : nullptr;
#pragma unroll
    for (int i = 0; i < SC; ++i) {
      x[i] = px && i < left ? px[i * xa.st] : from_f<T>(0.f);
      lam[i] = pg && i < left ? pg[i * ga.st] : from_f<T>(0.f);
    }
  }
  // READER: x ⊙ exp2(reader exponent) before[m] into s[row][ch] (scale_reader<RD>); else
  // x ⊙ exp2(Qex) after[m] into s[ch][row] (scale_key<true>). Ends with a barrier: s is complete.
  template <bool READER, Reader RD, int N>
  __device__ __forceinline__ void put_scaled(float (*s)[N], float (*tau)[DT]) const {
    const int m = threadIdx.x / DT, ch = threadIdx.x % DT;
    float l[SC];
#pragma unroll
    for (int i = 0; i < SC; ++i) l[i] = to_f(lam[i]) * kLog2e;
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < SC; ++i) t += l[i];
    tau[m][ch] = t;
    __syncthreads();
    float mul = 0.f;
#pragma unroll
    for (int q = 0; q < NSC; ++q)
      if (READER ? q < m : q > m) mul += tau[q][ch];
    mul = ex2(mul);
    float e = 0.f;
    if constexpr (READER) {
#pragma unroll
      for (int i = 0; i < SC; ++i) {
        if (RD == Reader::Inclusive) e += l[i];
        s[m * SC + i][ch] = to_f(x[i]) * (mul * ex2(e));
        if (RD == Reader::Exclusive) e += l[i];
      }
    } else {
#pragma unroll
      for (int j = SC - 1; j >= 0; --j) {
        s[ch][m * SC + j] = to_f(x[j]) * (mul * ex2(e));
        e += l[j];
      }
    }
  }
};

// In-sub-chunk walks of thread (m, ch): x[i][ch] *= exp2(reader exponent from the sub-chunk
// start: Pin_i inclusive, Pex_i exclusive), y[j][ch] *= exp2(Qex_j = Σ_{j<s<=end(m)} λ_s).
// y may be stored transposed (YT: y[ch][j]).
// TF: the results rounded to TF32 values (tf32_round) for an mma with RAW operands.
template <Reader RD, bool TF = false, int NX, int NL>
__device__ __forceinline__ void scale_reader(float (*x)[NX], const float (*lam)[NL], int m, int ch,
                                             float mul) {
  float e = 0.f;
#pragma unroll
  for (int i = m * SC; i < (m + 1) * SC; ++i) {
    if (RD == Reader::Inclusive) e += lam[i][ch];
    x[i][ch] = tile::tf32_if<TF>(x[i][ch] * (mul * ex2(e)));
    if (RD == Reader::Exclusive) e += lam[i][ch];
  }
}
template <bool YT, bool TF = false, int NY, int NL>
__device__ __forceinline__ void scale_key(float (*y)[NY], const float (*lam)[NL], int m, int ch,
                                          float mul) {
  float e = 0.f;
#pragma unroll
  for (int j = (m + 1) * SC - 1; j >= m * SC; --j) {
    float& v = YT ? y[ch][j] : y[j][ch];
    v = tile::tf32_if<TF>(v * (mul * ex2(e)));
    e += lam[j][ch];
  }
}

}  // namespace chunk_detail
}  // namespace fla
