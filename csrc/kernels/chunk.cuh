// CUDA engine for the chunked diagonal-gate algebra of kernels/chunk.h (ALGORITHMS.md §1-§5).
//
// Kernels (fp32 arithmetic; the tile products run on TF32 tensor cores for bf16/fp16 inputs and
// on exact SIMT FMA for fp32 inputs, never plain TF32 there: tile_mma.cuh):
//   intra  (chunk slot, H)  the pair matrix A (kept in a workspace, computed once whatever V).
//   state  (N, H, tiles)  the state passes, sequential over chunks, with the state in registers:
//          forward hst (and o when K <= 128), backward dHst and the zeta partials
//          (chunk_state.cuh).
//   out    (chunk slot, H, V/64)  forward o = ρ(Q̂ S + A V) (K > 128), backward
//          dv = K̂ dS+ + ρ Aᵀ dO.
//   grad_qk (chunk slot, H, K/64)  dA, dq, dk (inter + intra), dg by the segmented reverse
//          cumsum with exact resets, the u terms and the du partials.
// Launch sequences: chunk_launch.cuh.
// Decay exponents (log2 units) are only ever *added* (§2.6 additive segment sums), so they are
// <= 0 in every factor, -inf is exact and nothing cancels: off-diagonal sub-chunk blocks use the
// §1.2 boundary references (query from its sub-chunk start, key to its sub-chunk end, the
// sub-chunk totals in between); inside a diagonal block the same scheme runs once more on 4-row
// micro-blocks, and only pairs inside one micro-block sum λ pair by pair.
#pragma once
#include <type_traits>

#include "chunk.h"
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

// Tile loads are split into fetch (every load of the tile issued back to back into registers)
// and store (to shared memory), so a tile costs one memory latency, not sixteen. (The sequential
// state kernel holds whole tiles one chunk ahead instead: chunk_state.cuh's RowPieces.)
constexpr int kPer = C * DT / NTH;  // elements per thread per tile

// Rows [t0, t0 + L) x channels [d0, d0 + DT) of an activation, times mul, zero outside the
// sequence and past D: padded rows and channels then contribute exactly 0 (λ = 0, §2.4).
// Thread x owns column x % DT of rows x / DT + 4 it: one pointer, advanced by a fixed row step
// (the index arithmetic, not the loads, dominated these kernels' instruction counts).
constexpr int kRowStep = NTH / DT;
// Thread x's element of row x / DT: its pointer, and in `left` how many rows it has inside the
// sequence (rows it * kRowStep < left; 0 when its column is past D or the argument is off: an off
// argument, no decay, reads as zeros).
template <typename T>
__device__ __forceinline__ const T* row_start(const VecArg& a, int64_t b, int64_t t0, int L, int h,
                                              int d0, int D, int& left) {
  const unsigned c = threadIdx.x % DT, r0 = threadIdx.x / DT;
  const bool on = a.on() && d0 + int(c) < D;
  left = on ? L - int(r0) : 0;
  return on ? vptr<T>(a, b, t0 + r0, h, d0 + c) : nullptr;
}
struct RowFetch {
  float x[kPer];
  template <typename T>
  __device__ __forceinline__ void fetch(const VecArg& a, int64_t b, int64_t t0, int L, int h,
                                        int d0, int D, float mul) {
    int left;
    const T* ptr = row_start<T>(a, b, t0, L, h, d0, D, left);
    const int64_t step = kRowStep * a.st;
#pragma unroll
    for (int it = 0; it < kPer; ++it, ptr += step) x[it] = it * kRowStep < left ? to_f(*ptr) * mul : 0.f;
  }
  // Rows [r0, r0 + DT) x cols [c0, c0 + DT) of a row-major fp32 [R, Cn] matrix, zero outside.
  __device__ __forceinline__ void fetch_mat(const float* m, int R, int Cn, int r0, int c0) {
    const unsigned c = threadIdx.x % DT, rr = threadIdx.x / DT;
    const bool on = c0 + int(c) < Cn;
    const float* ptr = m + int64_t(r0 + int(rr)) * Cn + c0 + c;
    const int64_t step = int64_t(kRowStep) * Cn;
    const int left = on ? R - r0 - int(rr) : 0;
#pragma unroll
    for (int it = 0; it < kPer; ++it, ptr += step) x[it] = it * kRowStep < left ? *ptr : 0.f;
  }
  // s[row][ch], or transposed s[ch][row].
  template <bool TRANSPOSE>
  __device__ __forceinline__ void store(Tile* s) const {
    const unsigned c = threadIdx.x % DT, r0 = threadIdx.x / DT;
#pragma unroll
    for (int it = 0; it < kPer; ++it) {
      const unsigned r = r0 + it * kRowStep;
      if (TRANSPOSE) s[c][r] = x[it]; else s[r][c] = x[it];
    }
  }
};

template <typename T, bool TRANSPOSE>
__device__ __forceinline__ void load_rows(Tile* s, const VecArg& a, int64_t b, int64_t t0, int L,
                                          int h, int d0, int D, float mul) {
  RowFetch f;
  f.fetch<T>(a, b, t0, L, h, d0, D, mul);
  f.store<TRANSPOSE>(s);
}

template <bool TRANSPOSE>
__device__ __forceinline__ void load_mat(Tile* s, const float* m, int R, int Cn, int r0, int c0) {
  RowFetch f;
  f.fetch_mat(m, R, Cn, r0, c0);
  f.store<TRANSPOSE>(s);
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
                                           int L, int h, int d0, int D, float mul) {
  T* base = vptr<T>(a, b, t0 + F::row(0), h, d0 + F::col(0));
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int dr = F::row(i) - F::row(0), dc = F::col(i) - F::col(0);
    if (F::row(i) < L && d0 + F::col(i) < D) base[dr * a.st + dc * a.sd] = from_f<T>(mul * f.v[i]);
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

// ------------------------------------------------------------------------------------------------
// Diagonal sub-chunk blocks of A (and the u bonus), one more level of §1.2 references inside
// each 16-row sub-chunk: micro-blocks of MB = 4 rows. A pair (i, j) in the same micro-block
// walks its exponent Σ_{j<s<=i} λ_s (exclusive: s < i) by additions (step A); a pair in
// micro-blocks μj < μi factors, all exponents <= 0 and added, never subtracted, as
//   exp2(R_i) · exp2(Σ_{μj<ν<μi} τ4_ν) · exp2(L_j),
// R_i = reader exponent from the start of i's micro-block, L_j = Σ_{j<s<=end of j's micro-block},
// τ4 = micro-block totals (step B: q4 = q ⊙ exp2(R), k4 = k ⊙ exp2(L), no per-pair exponential).
// Thread (m, i, cq) owns row I = 16m + i and the channels ≡ cq (mod 4); a4 (its micro-block) and
// ab (earlier micro-blocks of the sub-chunk) hold its channel-quarter partials over all K tiles.
constexpr int MB = 4, NMB = SC / MB;
struct DiagAcc {
  float a4[MB] = {}, ab[SC - MB] = {}, b = 0.f;
};

// Step A, from raw q, k, λ; leaves q4 in Q (row I, this thread's channels).
template <Reader RD>
__device__ __forceinline__ void diag_step_a(DiagAcc& acc, Tile* Q, const Tile* KT_,
                                            const Tile* lam, const float* u) {
  const int m = threadIdx.x / 64, I = m * SC + (threadIdx.x / 4) % SC, cq = threadIdx.x % 4;
  const int iend = RD == Reader::Inclusive ? I : I - 1;  // last key row that carries a decay
  const int j0 = I / MB * MB;                              // first row of I's micro-block
  for (int ch = cq; ch < DT; ch += 4) {
    const float qi = Q[I][ch];
    float e = 0.f;
#pragma unroll
    for (int r = MB - 1; r >= 0; --r) {  // branch-free row mask: j > iend adds nothing
      const int j = j0 + r;
      const bool on = j <= iend;
      acc.a4[r] += qi * KT_[ch][j] * ex2(on ? e : -INFINITY);
      e += on ? lam[j][ch] : 0.f;
    }
    if (RD == Reader::Exclusive) acc.b += qi * u[ch] * KT_[ch][I];
    Q[I][ch] = qi * ex2(e);  // e = R_I now
  }
}

// Keys to their micro-block ends (k4, in place) and the micro-block totals τ4 [4 NSC][DT]:
// thread (m, ch) walks sub-chunk m.
__device__ __forceinline__ void micro_keys(Tile* KT_, const Tile* lam, float* tau4) {
  const int m = threadIdx.x / DT, ch = threadIdx.x % DT;
#pragma unroll
  for (int mu = 0; mu < NMB; ++mu) {
    float f = 0.f;
#pragma unroll
    for (int r = MB - 1; r >= 0; --r) {
      const int j = m * SC + mu * MB + r;
      KT_[ch][j] *= ex2(f);
      f += lam[j][ch];
    }
    tau4[(m * NMB + mu) * DT + ch] = f;
  }
}

// Step B, from q4 (Q) and k4 (KT_).
__device__ __forceinline__ void diag_step_b(DiagAcc& acc, const Tile* Q, const Tile* KT_,
                                            const float* tau4) {
  const int m = threadIdx.x / 64, I = m * SC + (threadIdx.x / 4) % SC, cq = threadIdx.x % 4;
  const int mi = I % SC / MB;  // I's micro-block in the sub-chunk
  for (int ch = cq; ch < DT; ch += 4) {
    const float q4 = Q[I][ch];
    float g = 0.f;  // Σ τ4 strictly between the two micro-blocks
#pragma unroll
    for (int mj = NMB - 2; mj >= 0; --mj) {
      if (mj < mi) {
        const float qg = q4 * ex2(g);
#pragma unroll
        for (int r = 0; r < MB; ++r) acc.ab[mj * MB + r] += qg * KT_[ch][m * SC + mj * MB + r];
        g += tau4[(m * NMB + mj) * DT + ch];
      }
    }
  }
}

// From micro-block to sub-chunk references in place: q4 -> q ⊙ exp2(reader exponent from the
// sub-chunk start), k4 -> k ⊙ exp2(Qex), by the τ4 of the earlier / later micro-blocks.
__device__ __forceinline__ void micro_to_sub(Tile* Q, Tile* KT_, const float* tau4) {
  const int m = threadIdx.x / DT, ch = threadIdx.x % DT;
  float t[NMB];
#pragma unroll
  for (int mu = 0; mu < NMB; ++mu) t[mu] = tau4[(m * NMB + mu) * DT + ch];
#pragma unroll
  for (int mu = 0; mu < NMB; ++mu) {
    float bq = 0.f, ak = 0.f;
#pragma unroll
    for (int nu = 0; nu < NMB; ++nu) {
      if (nu < mu) bq += t[nu];
      if (nu > mu) ak += t[nu];
    }
    const float fq = ex2(bq), fk = ex2(ak);
#pragma unroll
    for (int r = 0; r < MB; ++r) {
      const int i = m * SC + mu * MB + r;
      Q[i][ch] *= fq;
      KT_[ch][i] *= fk;
    }
  }
}

// Row I of the diagonal block m into A (every element of the block: zeros above the diagonal,
// and on it for the exclusive reader unless the bonus is there).
template <Reader RD>
__device__ __forceinline__ void diag_store(Tile* A, DiagAcc& acc) {
  const int m = threadIdx.x / 64, I = m * SC + (threadIdx.x / 4) % SC, cq = threadIdx.x % 4;
  const int iend = RD == Reader::Inclusive ? I : I - 1, mi = I % SC / MB;
  auto quarters = [](float& x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
  };
#pragma unroll
  for (int r = 0; r < MB; ++r) quarters(acc.a4[r]);
#pragma unroll
  for (int r = 0; r < SC - MB; ++r) quarters(acc.ab[r]);
  quarters(acc.b);
#pragma unroll
  for (int jj = 0; jj < SC; ++jj) {
    if (jj % 4 != cq) continue;
    const int j = m * SC + jj, mj = jj / MB;
    float v = 0.f;
    if (mj < mi) v = acc.ab[jj < SC - MB ? jj : 0];
    else if (mj == mi) v = (j <= iend ? acc.a4[jj % MB] : 0.f) + (RD == Reader::Exclusive && j == I ? acc.b : 0.f);
    A[I][j] = v;
  }
}

// The pair matrix A_ij = Σ_c q_ic k_jc exp2(Σ_{j<s<=i} λ_sc) for j < i (and the i = j terms: 1,
// or the bonus u) of one chunk and head, over all K tiles (once, whatever V), into p.amat
// [slots, H, C, C] (fp32, zero above the diagonal and for slots that hold no chunk).
// 61 KB of shared memory keep 3 CTAs on an SM: the kernel is latency-bound (ncu); 3 CTAs instead
// of 2 took it from 0.487 to 0.396 ms at gla K=V=64 (H100, NOTES c8), spills included.
template <typename T, Reader RD>
__global__ void __launch_bounds__(NTH, 3) chunk_intra_kernel(ChunkPass p) {
  extern __shared__ float4 smem4[];
  Tile* QX = reinterpret_cast<Tile*>(smem4);  // q, then q4, then q ⊙ exp2(reader exponent)
  Tile* KYt = QX + C;                          // k transposed [ch][j], then k4, then k ⊙ exp2(Qex)
  Tile* W = KYt + C;                           // λ, then A
  Decays& d = *reinterpret_cast<Decays*>(W + C);
  float* us = reinterpret_cast<float*>(&d + 1);  // [DT]
  float* tau4 = us + DT;                          // [4 NSC][DT]

  Pos pos;
  const bool chunk = locate(p, blockIdx.x, pos);
  const int h = blockIdx.y;
  float4* amat = reinterpret_cast<float4*>(static_cast<float*>(p.amat) + (blockIdx.x * p.H + h) * int64_t(C) * C);
  if (!chunk) {  // a kept A is an op output: slots without a chunk read 0. (amat may be null
    // when no slot holds a chunk: T = 0 reads as a pass without decays, see chunk_cuda.)
    if (p.amat)
      for (int e = threadIdx.x; e < C * C / 4; e += NTH) amat[e] = make_float4(0.f, 0.f, 0.f, 0.f);
    return;
  }
  DiagAcc dacc;
  Acc<T> off;  // off-diagonal blocks (query sub-chunk mq > key sub-chunk mk); the rest stays 0
  for (int k0 = 0; k0 < p.K; k0 += DT) {
    __syncthreads();
    {  // every load of the K tile in flight at once: one memory latency
      RowFetch fq, fk, fl;
      fq.fetch<T>(p.q, pos.b, pos.t0, pos.L, h, k0, p.K, 1.f);
      fk.fetch<T>(p.k, pos.b, pos.t0, pos.L, h, k0, p.K, 1.f);
      fl.fetch<T>(p.g, pos.b, pos.t0, pos.L, h, k0, p.K, kLog2e);
      fq.store<false>(QX), fk.store<true>(KYt), fl.store<false>(W);
    }
    if (RD == Reader::Exclusive && threadIdx.x < DT)
      us[threadIdx.x] = k0 + threadIdx.x < p.K ? ldu(p.u, int64_t(h) * p.K + k0 + threadIdx.x, p.udtype) : 0.f;
    __syncthreads();
    chunk_decays(d, W);
    diag_step_a<RD>(dacc, QX, KYt, W, us);
    __syncthreads();
    micro_keys(KYt, W, tau4);
    __syncthreads();
    diag_step_b(dacc, QX, KYt, tau4);
    __syncthreads();
    micro_to_sub(QX, KYt, tau4);
    __syncthreads();
    off.template mma_blocks<false>(
        QX, KYt, [](int) { return 0; }, [](int) { return DT; },
        [&](int c, int j, int mq) { return d.gap[j / SC][mq][c]; },
        [](int mq, int mk) { return mk < mq; });
  }
  __syncthreads();
  Tile* A = W;
#pragma unroll
  for (int e = 0; e < 16; ++e)
    if (off.col(e) / SC != off.row(e) / SC) A[off.row(e)][off.col(e)] = off.v[e];
  diag_store<RD>(A, dacc);
  __syncthreads();
  // As TF32 values where its readers multiply on tensor cores (kTC): the state kernel reads
  // them RAW; rounding again in the backward's out kernel changes nothing.
  for (int e = threadIdx.x; e < C * C / 4; e += NTH) {
    const float4 a = *reinterpret_cast<const float4*>(&A[e / (C / 4)][4 * (e % (C / 4))]);
    amat[e] = make_float4(tf32_if<kTC<T>>(a.x), tf32_if<kTC<T>>(a.y), tf32_if<kTC<T>>(a.z), tf32_if<kTC<T>>(a.w));
  }
}

// Forward (DV = false): o = ρ (Q̂ S + A V). Backward (DV): dv = K̂ dS+ + ρ Aᵀ dO. A comes from
// p.amat (chunk_intra_kernel, or kept from the forward).
// NV V tiles per CTA (2 when V > 64): Q̂ or K̂ is then built once for both.
template <typename T, Reader RD, bool DV, int NV>
__global__ void __launch_bounds__(NTH, DV ? 2 : 3) chunk_out_kernel(ChunkPass p) {
  extern __shared__ float4 smem4[];
  Tile* X = reinterpret_cast<Tile*>(smem4);  // Q̂, or K̂ transposed [ch][j]
  Tile* W = X + C;                            // λ, then the state tile, then V / dO
  Tile* A = W + C;
  Decays& d = *reinterpret_cast<Decays*>(A + C);

  Pos pos;
  if (!locate(p, blockIdx.x, pos)) return;
  const int h = blockIdx.y, v0 = blockIdx.z * NV * DT;
  const int nv = min(NV, (p.V - v0 + DT - 1) / DT);
  const int m = threadIdx.x / DT, ch = threadIdx.x % DT;
  const int64_t KV = int64_t(p.K) * p.V;
  const float* st = static_cast<const float*>(DV ? p.dhst : p.hst) + (pos.slot * p.H + h) * KV;
  Acc<T> acc[NV];
  for (int k0 = 0; k0 < p.K; k0 += DT) {
    __syncthreads();
    {
      RowFetch fx, fl;
      fx.fetch<T>(DV ? p.k : p.q, pos.b, pos.t0, pos.L, h, k0, p.K, 1.f);
      fl.fetch<T>(p.g, pos.b, pos.t0, pos.L, h, k0, p.K, kLog2e);
      fx.store<DV>(X), fl.store<false>(W);
    }
    __syncthreads();
    chunk_decays(d, W);
    // Q̂ = q ⊙ exp2(G or E) = q ⊙ exp2(reader exponent) before[m];  K̂ = k ⊙ exp2(Qex) after[m].
    if (DV) scale_key<true>(X, W, m, ch, d.after[m][ch]);
    else scale_reader<RD>(X, W, m, ch, d.before[m][ch]);
#pragma unroll
    for (int vt = 0; vt < NV; ++vt) {
      if (vt >= nv) break;
      __syncthreads();
      load_mat<false>(W, st, p.K, p.V, k0, v0 + vt * DT);
      __syncthreads();
      if (DV) acc[vt].template mma<true>(X, W, DT);
      else acc[vt].template mma<false>(X, W, DT);
    }
  }
  __syncthreads();
  load_mat<false>(A, static_cast<const float*>(p.amat) + (blockIdx.x * p.H + h) * int64_t(C) * C, C, C, 0, 0);
  const float rho = float(p.scale);
  if (DV) {  // dv = K̂ dS+ + ρ Aᵀ dO: fold ρ into A
    __syncthreads();
    for (int e = threadIdx.x; e < C * C; e += NTH) A[e / C][e % C] *= rho;
  }
#pragma unroll
  for (int vt = 0; vt < NV; ++vt) {
    if (vt >= nv) break;
    if (vt > 0) __syncthreads();
    load_rows<T, false>(W, DV ? p.dout : p.v, pos.b, pos.t0, pos.L, h, v0 + vt * DT, p.V, 1.f);
    __syncthreads();
    // A is lower triangular: row i of A V needs j <= i, row j of Aᵀ dO needs i >= j.
    if (DV) acc[vt].template mma<true, Tri::KFromRow>(A, W, C);
    else acc[vt].template mma<false, Tri::KUpToRow>(A, W, C);
    if (!DV && p.o_acc) store_frag<float>(acc[vt], p.o, pos.b, pos.t0, pos.L, h, v0 + vt * DT, p.V, rho);
    else store_frag<T>(acc[vt], DV ? p.dv : p.o, pos.b, pos.t0, pos.L, h, v0 + vt * DT, p.V, DV ? 1.f : rho);
  }
}

// ------------------------------------------------------------------------------------------------
// The in-sub-chunk part of dq and dk for thread (m, ch): channel ch of sub-chunk m's 16 rows. On
// entry DQ / DK hold the inter and off-diagonal terms at the sub-chunk references; on exit the
// complete dq' and dk'. The 4-row micro-blocks of diag_step_a / diag_step_b again: pairs inside a
// micro-block walk their exponents; pairs across micro-blocks use k4 = k ⊙ exp2(L) (to the key's
// micro-block end) and q4 = q ⊙ exp2(R) (reader exponent from the query's micro-block start) with
// the micro-block totals in between, every exponent a sum of terms <= 0:
//   dq_i = e^{R_i + B4} DQ_i + Σ_{j in i's micro-block} dA_ij k_j e^{(j,i]}
//          + Σ_{μj < μi} e^{R_i + τ4 between} Σ_{j in μj} dA_ij k4_j
//   dk_i = e^{L_i + A4} DK_i + Σ_{j in i's micro-block} dA_ji q_j e^{(i,j]}
//          + Σ_{μj > μi} e^{L_i + τ4 between} Σ_{j in μj} dA_ji q4_j
// (B4 / A4: the τ4 of the micro-blocks before / after i's in the sub-chunk; exclusive reader:
// (j,i) and (i,j) instead.) The pairs j = i are left out for both readers: the caller adds them
// (as the u bonus; 1 for GLA) where they cancel exactly in the dg sums. Q, Kr hold raw q, k; all
// loops unroll. Without DK only dq is formed (Q is not read).
template <Reader RD, bool DK_TOO = true>
__device__ __forceinline__ void diag_grads(Tile* DQ, Tile* DK, const Tile* DA, const Tile* Q,
                                           const Tile* Kr, const Tile* LAM, int m, int ch) {
  constexpr bool INC = RD == Reader::Inclusive;
  const int r0 = m * SC;
  float k4[SC], q4[SC], t4[NMB];
#pragma unroll
  for (int mu = 0; mu < NMB; ++mu) {
    float f = 0.f, e = 0.f;
#pragma unroll
    for (int r = MB - 1; r >= 0; --r) {
      const int j = mu * MB + r;
      k4[j] = Kr[r0 + j][ch] * ex2(f);
      f += LAM[r0 + j][ch];
    }
    t4[mu] = f;
    if constexpr (DK_TOO) {
#pragma unroll
      for (int r = 0; r < MB; ++r) {
        const int i = mu * MB + r;
        if (INC) e += LAM[r0 + i][ch];
        q4[i] = Q[r0 + i][ch] * ex2(e);
        if (!INC) e += LAM[r0 + i][ch];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < SC; ++i) {  // dq
    const int mi = i / MB, I = r0 + i;
    float e = INC ? LAM[I][ch] : 0.f, w = 0.f;
#pragma unroll
    for (int j = i - 1; j >= mi * MB; --j) {
      w += DA[I][r0 + j] * Kr[r0 + j][ch] * ex2(e);
      e += LAM[r0 + j][ch];
    }
    float before = 0.f;  // e = R_i now
#pragma unroll
    for (int nu = 0; nu < mi; ++nu) before += t4[nu];
    float x = ex2(e + before) * DQ[I][ch] + w, g = 0.f;
#pragma unroll
    for (int mj = mi - 1; mj >= 0; --mj) {
      float sum = 0.f;
#pragma unroll
      for (int r = 0; r < MB; ++r) sum += DA[I][r0 + mj * MB + r] * k4[mj * MB + r];
      x += ex2(e + g) * sum;
      g += t4[mj];
    }
    DQ[I][ch] = x;
  }
  if constexpr (DK_TOO) {
#pragma unroll
    for (int i = 0; i < SC; ++i) {  // dk
      const int mi = i / MB, I = r0 + i;
      float e = 0.f, w = 0.f;
#pragma unroll
      for (int j = i + 1; j < (mi + 1) * MB; ++j) {
        if (INC) e += LAM[r0 + j][ch];
        w += DA[r0 + j][I] * Q[r0 + j][ch] * ex2(e);
        if (!INC) e += LAM[r0 + j][ch];
      }
      float after = 0.f;  // e = L_i now
#pragma unroll
      for (int nu = mi + 1; nu < NMB; ++nu) after += t4[nu];
      float x = ex2(e + after) * DK[I][ch] + w, g = 0.f;
#pragma unroll
      for (int mj = mi + 1; mj < NMB; ++mj) {
        float sum = 0.f;
#pragma unroll
        for (int r = 0; r < MB; ++r) sum += DA[r0 + mj * MB + r][I] * q4[mj * MB + r];
        x += ex2(e + g) * sum;
        g += t4[mj];
      }
      DK[I][ch] = x;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// dq, dk, dg (and du partials) for one chunk and K tile. DQ_ONLY: dq alone (the value-side
// forward's o, chunk_vdecay.cuh): no dS+, no q, no dk or dg work; dk, dg, du are not written.
template <typename T, Reader RD, bool DQ_ONLY = false>
__global__ void __launch_bounds__(NTH, 2) chunk_grad_qk_kernel(ChunkPass p, int nts) {
  extern __shared__ float4 smem4[];
  Tile* DA = reinterpret_cast<Tile*>(smem4);
  Tile* DQ = DA + C;
  Tile* DK = DQ + C;
  Tile* QX = DK + C;   // phase 1: dO^T; phase 2: q, then q ⊙ exp2(reader exponent)
  Tile* KY = QX + C;   // phase 1: V^T;  phase 2: k, then k ⊙ exp2(Qex)
  Tile* LAM = KY + C;  // phase 1: S^T;  phase 2: λ
  Decays& d = *reinterpret_cast<Decays*>(LAM + C);
  float* zs = reinterpret_cast<float*>(&d + 1);  // [DT] zeta
  float* us = zs + DT;                            // [DT] u, then [DT] the last row's k ⊙ dk_inter
  // The dg scan's arrays reuse the decays' space (dead by then): 110 KB keeps 2 CTAs per SM.
  float* carry = reinterpret_cast<float*>(&d);              // [NSC][DT] sub-chunk scan values
  int* resets = reinterpret_cast<int*>(carry + NSC * DT);   // [NSC][DT]
  float* dup = reinterpret_cast<float*>(resets + NSC * DT); // [NSC][DT] du partials
  static_assert(sizeof(Decays) >= 4 * NSC * DT * sizeof(float), "scan arrays fit");

  Pos pos;
  if (!locate(p, blockIdx.x, pos)) return;
  const int h = blockIdx.y, k0 = blockIdx.z * DT;
  const int m = threadIdx.x / DT, ch = threadIdx.x % DT;
  const int64_t KV = int64_t(p.K) * p.V;
  const float rho = float(p.scale);

  // Phase 1, over V tiles: dA = dO Vᵀ, dqi = dO Sᵀ, dki = V dS+ᵀ.
  Acc<T> da, dqi, dki;
  const float* S = static_cast<const float*>(p.hst) + (pos.slot * p.H + h) * KV;
  const float* dS = static_cast<const float*>(p.dhst) + (pos.slot * p.H + h) * KV;
  for (int v0 = 0; v0 < p.V; v0 += DT) {
    __syncthreads();
    load_rows<T, true>(QX, p.dout, pos.b, pos.t0, pos.L, h, v0, p.V, 1.f);
    load_rows<T, true>(KY, p.v, pos.b, pos.t0, pos.L, h, v0, p.V, 1.f);
    load_mat<true>(LAM, S, p.K, p.V, k0, v0);
    if (!DQ_ONLY) load_mat<true>(DQ, dS, p.K, p.V, k0, v0);
    __syncthreads();
    da.template mma<true>(QX, KY, DT);
    dqi.template mma<true>(QX, LAM, DT);
    if (!DQ_ONLY) dki.template mma<true>(KY, DQ, DT);
  }
  __syncthreads();
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    const int i = da.row(e), j = da.col(e);
    DA[i][j] = j <= i ? rho * da.v[e] : 0.f;  // tril, diagonal included (u terms)
    DQ[i][j] = rho * dqi.v[e];
    if (!DQ_ONLY) DK[i][j] = dki.v[e];
  }
  if (threadIdx.x < DT) {
    float z = 0.f;
    const int kk = k0 + threadIdx.x;
    if (kk < p.K)
      for (int t = 0; t < nts; ++t)
        z += static_cast<const float*>(p.zeta)[((pos.slot * p.H + h) * nts + t) * p.K + kk];
    zs[threadIdx.x] = z;
    // The self pair (i = i) of dq / dk, left out of diag_grads: RWKV6's bonus u, GLA's 1.
    us[threadIdx.x] = RD == Reader::Inclusive ? 1.f
                      : kk < p.K ? ldu(p.u, int64_t(h) * p.K + kk, p.udtype) : 0.f;
  }
  __syncthreads();

  // Phase 2: the K tile's q, k, λ.
  if (!DQ_ONLY) load_rows<T, false>(QX, p.q, pos.b, pos.t0, pos.L, h, k0, p.K, 1.f);
  load_rows<T, false>(KY, p.k, pos.b, pos.t0, pos.L, h, k0, p.K, 1.f);
  load_rows<T, false>(LAM, p.g, pos.b, pos.t0, pos.L, h, k0, p.K, kLog2e);
  __syncthreads();
  chunk_decays(d, LAM);
  // Inter terms to the sub-chunk references; operands for the off-diagonal blocks. Also
  // kin = k ⊙ dk_inter (exponent Ω_i = Σ_{r>i} λ_r) for the dg scan below: summed over this
  // thread's rows but the chunk's last, L - 1, whose term stays apart. There the factor is
  // exp2(0) = 1 and nothing else ever adds to DK (no later rows), so kin_last is bitwise the
  // product the scan forms from the final DK (__fmul_rn: no contraction on either side).
  // DQ_ONLY forms the dq terms alone (q is not loaded).
  float kin_sum = 0.f, kin_last = 0.f;
  {
    float suf = 0.f;
#pragma unroll
    for (int ii = SC - 1; ii >= 0; --ii) {
      const int row = m * SC + ii;
      DQ[row][ch] *= d.before[m][ch];
      if (DQ_ONLY) continue;
      const float dki = DK[row][ch] * d.after[m][ch];
      DK[row][ch] = dki;
      const float kin = __fmul_rn(KY[row][ch], ex2(suf) * dki);
      if (row == pos.L - 1) kin_last = kin; else kin_sum += kin;
      suf += LAM[row][ch];
    }
  }
  if (!DQ_ONLY) scale_reader<RD>(QX, LAM, m, ch, 1.f);
  scale_key<false>(KY, LAM, m, ch, 1.f);
  __syncthreads();
  {  // off-diagonal: DQ[i] += Σ_{j in mk<mq} dA_ij KY_j gap;  DK[j] += Σ_{i in mq>mk} dA_ij QX_i gap
    Acc<T> aq, ak;
    auto all = [](int, int) { return true; };
    aq.template mma_blocks<false>(
        DA, KY, [](int) { return 0; }, [](int mr) { return mr * SC; },
        [&](int j, int c, int mr) { return d.gap[j / SC][mr][c]; }, all);
    if (!DQ_ONLY)
      ak.template mma_blocks<true>(
          DA, QX, [](int mr) { return (mr + 1) * SC; }, [](int) { return C; },
          [&](int i, int c, int mr) { return d.gap[mr][i / SC][c]; }, all);
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      DQ[aq.row(e)][aq.col(e)] += aq.v[e];
      if (!DQ_ONLY) DK[ak.row(e)][ak.col(e)] += ak.v[e];
    }
  }
  __syncthreads();
  if (!DQ_ONLY) load_rows<T, false>(QX, p.q, pos.b, pos.t0, pos.L, h, k0, p.K, 1.f);  // raw q, k again
  load_rows<T, false>(KY, p.k, pos.b, pos.t0, pos.L, h, k0, p.K, 1.f);
  __syncthreads();
  diag_grads<RD, !DQ_ONLY>(DQ, DK, DA, QX, KY, LAM, m, ch);
  if constexpr (DQ_ONLY) {  // the value-side forward's o: dq alone, no dg scan
    const int kk = k0 + ch;
    if (kk < p.K)
      for (int t = m * SC; t < (m + 1) * SC && t < pos.L; ++t)
        put<T>(p.dq, p.dq_acc, pos.b, pos.t0 + t, h, kk, DQ[t][ch] + DA[t][t] * us[ch] * KY[t][ch]);
    return;
  }

  // dg by the reverse cumsum (§3; RWKV6 reader terms strictly after t), as a segmented scan over
  // the 4 sub-chunks: where exp(λ_t) == 0 the true dg_t is exactly 0, and so is the suffix sum
  // (ζ included) it stands for, so the scan restarts from 0 there.
  //   ζ = rowsum(S⁺ ⊙ dS⁺) = γ ⊙ rowsum(S ⊙ dS⁺) (the state kernel's partials) + Σ_j k_j ⊙ dk_inter_j.
  // The last row's term k ⊙ dk_inter is O(1) whatever the decays and cancels against the same
  // term inside its k ⊙ dk: it goes into that row's summand instead (where the two are the same
  // fp32 product and cancel exactly), so ζ enters as γ-term + Σ_{j < L-1}; every other term then
  // carries a decay factor, and a chunk of strong decays (all <= -20) gets a dg of the right
  // size instead of an fp32 residue of O(1) terms.
  float* const kins = carry + 3 * NSC * DT;  // [NSC][DT] kin_sum partials
  kins[m * DT + ch] = kin_sum;
  if (pos.L - 1 >= m * SC && pos.L - 1 < (m + 1) * SC) us[DT + ch] = kin_last;
  __syncthreads();
  if (threadIdx.x < DT) zs[ch] += kins[ch] + kins[DT + ch] + kins[2 * DT + ch] + kins[3 * DT + ch];
  const float last_term = us[DT + ch];
  __syncthreads();
  const int kk = k0 + ch;
  // Row 0 of this thread's column of each output (null when off: chunk_vdecay.cuh wants only
  // some of them); row t is t time steps further.
  auto col0 = [&](const VecArg& a) { return a.on() ? vptr<T>(a, pos.b, pos.t0, h, kk) : nullptr; };
  T* const dgp = col0(p.dg);
  T* const dkp = col0(p.dk);
  auto step = [&](float& acc, int t, bool write) {
    const float q = QX[t][ch], k = KY[t][ch];
    const bool dead = ex2(LAM[t][ch]) == 0.f && t < pos.L;
    const float xq = q * DQ[t][ch], xk = __fmul_rn(k, DK[t][ch]) - (t == pos.L - 1 ? last_term : 0.f);
    if (RD == Reader::Inclusive) acc += xq - xk; else acc -= xk;
    float dg = acc;
    if (dead) dg = 0.f, acc = 0.f;
    if (RD == Reader::Exclusive) acc += xq;
    if (write && t < pos.L && kk < p.K) {
      const float dA = DA[t][t];
      if (dgp) dgp[t * p.dg.st] = from_f<T>(dg);
      if (p.dq.on()) put<T>(p.dq, p.dq_acc, pos.b, pos.t0 + t, h, kk, DQ[t][ch] + dA * us[ch] * k);
      if (dkp) dkp[t * p.dk.st] = from_f<T>(DK[t][ch] + dA * us[ch] * q);
      if (RD == Reader::Exclusive) dup[m * DT + ch] += dA * q * k;
    }
    return dead;
  };
  {
    float acc = 0.f;
    int reset = 0;
    for (int t = (m + 1) * SC - 1; t >= m * SC; --t) reset |= step(acc, t, false);
    carry[m * DT + ch] = acc, resets[m * DT + ch] = reset;
    dup[m * DT + ch] = 0.f;
  }
  __syncthreads();
  {
    float acc = zs[ch];
    for (int l = NSC - 1; l > m; --l) acc = resets[l * DT + ch] ? carry[l * DT + ch] : acc + carry[l * DT + ch];
    for (int t = (m + 1) * SC - 1; t >= m * SC; --t) step(acc, t, true);
  }
  if (RD == Reader::Exclusive && p.du) {
    __syncthreads();
    if (threadIdx.x < DT && kk < p.K)
      static_cast<float*>(p.du)[(pos.slot * p.H + h) * p.K + kk] =
          dup[ch] + dup[DT + ch] + dup[2 * DT + ch] + dup[3 * DT + ch];
  }
}

}  // namespace chunk_detail
}  // namespace fla
