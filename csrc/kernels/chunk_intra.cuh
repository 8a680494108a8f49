// The chunk engine's intra kernel (chunk.cuh has the overview): the pair matrix A of every chunk,
// its diagonal sub-chunk blocks by 4-row micro-blocks (shared with chunk_grad_qk.cuh).
#pragma once
#include "chunk.cuh"

namespace fla {
namespace chunk_detail {

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

// A micro-block's MB entries of one row of a transposed tile (k by channel) as one 16-byte shared
// access. Read as four scalars they were bank-conflicted (at the row stride LD, lanes 8 channels
// apart share a bank): two-way in diag_step_a, four-way in micro_keys. Rows are 16-byte aligned
// (LD % 4 == 0) and micro-blocks start at multiples of MB.
struct MicroRow {
  float v[MB];
};
static_assert(MB == 4 && LD % 4 == 0, "a micro-block row is one float4");
__device__ __forceinline__ MicroRow micro_row(const float* row, int j0) {
  const float4 x = *reinterpret_cast<const float4*>(row + j0);
  return {{x.x, x.y, x.z, x.w}};
}
__device__ __forceinline__ void put_micro_row(float* row, int j0, const MicroRow& r) {
  *reinterpret_cast<float4*>(row + j0) = make_float4(r.v[0], r.v[1], r.v[2], r.v[3]);
}

// Step A, from raw q, k, λ; leaves q4 in Q (row I, this thread's channels).
template <Reader RD>
__device__ __forceinline__ void diag_step_a(DiagAcc& acc, Tile* Q, const Tile* KT_,
                                            const Tile* lam, const float* u) {
  const int m = threadIdx.x / 64, I = m * SC + (threadIdx.x / 4) % SC, cq = threadIdx.x % 4;
  const int iend = RD == Reader::Inclusive ? I : I - 1;  // last key row that carries a decay
  const int j0 = I / MB * MB;                              // first row of I's micro-block
  for (int ch = cq; ch < DT; ch += 4) {
    const float qi = Q[I][ch];
    const MicroRow kr = micro_row(KT_[ch], j0);
    float e = 0.f;
#pragma unroll
    for (int r = MB - 1; r >= 0; --r) {  // branch-free row mask: j > iend adds nothing
      const int j = j0 + r;
      const bool on = j <= iend;
      acc.a4[r] += qi * kr.v[r] * ex2(on ? e : -INFINITY);
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
    const int j0 = m * SC + mu * MB;
    MicroRow kr = micro_row(KT_[ch], j0);
    float f = 0.f;
#pragma unroll
    for (int r = MB - 1; r >= 0; --r) {
      kr.v[r] *= ex2(f);
      f += lam[j0 + r][ch];
    }
    put_micro_row(KT_[ch], j0, kr);
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
// [slots, H, C, C] (fp32, zero above the diagonal and for slots that hold no chunk). vec: q, k
// and λ are rows of whole 16-byte pieces (key_rows_vec).
// 61 KB of shared memory keep 3 CTAs on an SM: the kernel is latency-bound, so a third CTA to
// switch to is worth more than the registers it costs (the bound of 3 spills a little).
template <typename T, Reader RD>
__global__ void __launch_bounds__(NTH, 3) chunk_intra_kernel(ChunkPass p, bool vec) {
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
    {  // every load of the K tile in flight at once (kTilesTogether): one memory latency
      constexpr bool together = kTilesTogether<T>;
      RowPieces<T> fq, fl;
      RowPieces<T, true> fk;  // by columns: its transposed store is conflict-free
      fq.fetch(p.q, pos.b, pos.t0, pos.L, h, k0, p.K, vec);
      if (!together) fq.store(QX, 1.f);
      fk.fetch(p.k, pos.b, pos.t0, pos.L, h, k0, p.K, vec);
      if (!together) fk.store_transposed(KYt, 1.f);
      fl.fetch(p.g, pos.b, pos.t0, pos.L, h, k0, p.K, vec);
      if (together) fq.store(QX, 1.f), fk.store_transposed(KYt, 1.f);
      fl.store(W, kLog2e);
    }
    // The next K tile's rows, on their way to L2 under this tile's work.
    if (k0 + DT < p.K) prefetch_key_tile<T>(p, pos, h, k0 + DT, min(DT, p.K - k0 - DT));
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

// The `vec` argument of chunk_intra_kernel (and its part of grad_qk_vec): q, k and λ are rows of
// whole 16-byte pieces.
template <typename T>
inline bool key_rows_vec(const ChunkPass& p) {
  constexpr int P = RowPieces<T>::P;
  return rows_in_pieces(p.q, p.K, P) && rows_in_pieces(p.k, p.K, P) && rows_in_pieces(p.g, p.K, P);
}

}  // namespace chunk_detail
}  // namespace fla
