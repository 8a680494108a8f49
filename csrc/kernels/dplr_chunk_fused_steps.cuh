// What the chunked RWKV7 engine's fused kernels (one CTA per (sequence, head) walking the
// sequence's 16-row chunks: the forward, dplr_chunk_fused.cuh, and the reverse pass,
// dplr_chunk_fused_reverse.cuh) do alike for every chunk: fetch its rows, the decays, the pair
// matrices and X (docs/algorithms.md §6.3), none of which reads the state. A one-block kernel
// (128 threads) runs them before each chunk's chain; a two-block one (256) on warps 4-7 for the
// next chunk while warps 0-3 run this one's chain. Taken for bf16 / fp16 with K = V = 64
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

// Threads of a fused CTA's group: the whole CTA of the one-block kernels; each half of a
// two-block kernel's (at namespace scope: nvcc takes no qualified name in a template's
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

// A chunk's block: what the chain over the state (S forward, D reverse) reads of the chunk,
// made by the chunk's own steps (below), none of which needs the state.
struct ChunkBlock {
  static constexpr int rhat = 0;                  // R^ = r e^G                       [C][LA]
  static constexpr int ahat = rhat + C * LA;      // Â = a e^E                        [C][LA]
  static constexpr int khat = ahat + C * LA;      // K^ = k e^Omega (raw k first)      [C][LB]
  static constexpr int bhat = khat + C * LB;      // B^ = b e^Omega (raw b first)      [C][LB]
  static constexpr int crow = bhat + C * LB;      // the column side: v, or scale dO   [C][LB]
  static constexpr int gam = crow + C * LB;       // gamma = e^(chunk total)           [K]
  static constexpr int ginv = gam + K;            // 1 / gamma                         [K]
  // A_rk, A_rb, A_ak, A_ab, then X: [5][C][LM], laid out as DplrWorkspaceLayout::mats_at() holds
  // them (the reverse pass stores them for grad as one block)
  static constexpr int mats = ginv + K;
  static constexpr int total = mats + 5 * C * LM;
  static_assert(mats % 4 == 0 && (C * LM) % 4 == 0 && total % 4 == 0, "16-byte pieces and blocks");
};
constexpr int kMatArk = 0, kMatArb = 1, kMatAak = 2, kMatAab = 3, kMatX = 4;  // blocks of `mats`

// Shared memory (floats) of a fused kernel with kBlocks chunk blocks. One block (128 threads,
// 57 KB: four CTAs fit an SM (with 2 KB to spare), which the kernels need where they are latency-bound at 512
// (sequence, head) pairs on 132 SMs): a chunk's own steps, then its chain, barriers between;
// the steps' scratch (w for the decay scan and the exact pair walks, then k e^-G; b e^-G) is
// the chain's scratch too (forward: M + P, U; reverse: dU, dM). Two blocks (256 threads, 95 KB,
// two CTAs an SM): one half of the CTA makes the next chunk's block while the other runs the
// chain on this one's, each with scratch of its own.
template <int kBlocks>
struct FusedSmem {
  static_assert(kBlocks == 1 || kBlocks == 2, "one block, or two in turn");
  static constexpr int block(int i) { return i * ChunkBlock::total; }
  static constexpr int wrow = kBlocks * ChunkBlock::total;  // w [C][K], then k e^-G [C][LA]
  static constexpr int btil = wrow + C * LB;                // b e^-G                  [C][LA]
  static constexpr int scr0 = kBlocks == 1 ? wrow : btil + C * LB;  // M + P, or dU   [C][LB]
  static constexpr int scr1 = scr0 + C * LB;                        // U, or dM       [C][LB]
  static constexpr int state = scr1 + C * LB;                       // S, or D        [K][LB]
  static constexpr int total = state + K * LB;
  static constexpr size_t bytes() { return size_t(total) * sizeof(float); }
  static_assert(C * K <= C * LB && C * LA <= C * LB, "scratch rows hold w, k e^-G, b e^-G");
  // an SM's 228 KB, less 1 KB the driver holds per CTA
  static_assert(kBlocks == 2 || 4 * (bytes() + 1024) <= 228 * 1024, "four one-block CTAs fit an SM");
  static_assert(kBlocks == 1 || 2 * (bytes() + 1024) <= 228 * 1024, "two two-block CTAs fit an SM");
};

// Where a chunk's own steps work: its block and the steps' scratch.
struct ChunkSteps {
  float* blk;   // ChunkBlock
  float* wrow;  // w [C][K], then k e^-G [C][LA]
  float* btil;  // b e^-G [C][LA]
  template <class L>
  __device__ static ChunkSteps at(float* sm, int block) {
    return {sm + L::block(block), sm + L::wrow, sm + L::btil};
  }
};

// A chunk's six input row blocks move as 16-byte pieces, one of each block per thread of a group.
constexpr int kPieceElems = 8, kPiecesPerRow = K / kPieceElems;
constexpr int kColumnRows = 3;  // ChunkRows' block of the column side (v or dO)
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
// hst or dhst, 16-byte stores by the `threads` threads tid = 0, 1, ... After the barrier that
// ends its update; not synchronised.
__device__ __forceinline__ void store_state(float* at, const float* state, int tid, int threads) {
#pragma unroll 4
  for (int e = 4 * tid; e < K * V; e += 4 * threads)
    *reinterpret_cast<float4*>(at + e) = *reinterpret_cast<const float4*>(state + e / V * LB + e % V);
}

// A chunk block's pair matrices and X to a [5][C][LM] block of a workspace (laid out as
// DplrWorkspaceLayout::mats_at() holds them, for grad), 16-byte stores by the group's threads;
// each row's padding piece, never written in the block, as zeros, so that every float stored is
// defined. After the barrier that follows X's solve; not synchronised.
__device__ __forceinline__ void store_mats(float* out, const float* blk, int tid) {
  static_assert(LM == C + 4, "one 16-byte piece of padding per row");
  const float4* const mats = reinterpret_cast<const float4*>(blk + ChunkBlock::mats);
  for (int e = tid; e < 5 * C * LM / 4; e += NTF)
    reinterpret_cast<float4*>(out)[e] = e % (LM / 4) == C / 4 ? make_float4(0.f, 0.f, 0.f, 0.f) : mats[e];
}

// A K x V state argument (h0, hT, dht, dh0, the windows' carry) of head h of sequence n and
// the state in shared memory at row stride LB, by the `threads` threads tid = 0, 1, ...:
// load_state reads it (0 where the argument is off), also into `copy` (a contiguous fp32 slot)
// if given; save_state writes it where the argument is on. Not synchronised.
__device__ inline void load_state(float* state, const MatArg& from, int n, int h, int tid, int threads,
                                  float* copy = nullptr) {
  for (int e = tid; e < K * V; e += threads) {
    const int d = e / V, x = e % V;
    const float v = from.on() ? *mptr(from, n, h, d, x) : 0.f;
    state[d * LB + x] = v;
    if (copy) copy[e] = v;
  }
}
__device__ inline void save_state(const MatArg& to, int n, int h, const float* state, int tid, int threads) {
  if (to.on())
    for (int e = tid; e < K * V; e += threads) {
      const int d = e / V, x = e % V;
      *mptr(to, n, h, d, x) = state[d * LB + x];
    }
}

// The six row blocks of a sequence's chunks (r, w, k, the column side `cols`: v or dO, a, b), a
// 16-byte piece of each per thread of the group that stages them (tid: the thread's index in
// it): row tid / kPiecesPerRow, channels kPieceElems (tid % kPiecesPerRow) on. fetch() takes
// chunk ci's into registers (0 past the sequence: w = 0 keeps the state, k = v = b = 0 add
// nothing, dO = 0 sends nothing back), stage() puts them into a chunk's block and the steps'
// scratch. With `vec` (the launch's input_rows_in_pieces: rows in whole aligned pieces) a piece
// is one load, else one per element. kHeld: each block's first-row address is held through the
// chunk loop (the forwards: fewer instructions a fetch), else each fetch forms it from the
// kernel's arguments (the backwards: six held pointers were what they spilled, each fetch then
// waiting on their reloads; benchmarks/NOTES.md c69).
template <typename T, bool kHeld = true>
struct ChunkRows {
  const VecArg* src[6];
  const T* first[kHeld ? 6 : 1];
  uint4 piece[6];
  int prow, pcol, h;
  int64_t b, row0, len;
  bool vec;
  __device__ ChunkRows(const DplrChunkPass& p, const VecArg& cols, const SeqSpan& s, int h, int tid)
      : prow(tid / kPiecesPerRow), pcol(kPieceElems * (tid % kPiecesPerRow)), h(h), b(s.b), row0(s.bos + prow),
        len(s.len), vec(p.paths.rows_16byte) {
    src[0] = &p.r, src[1] = &p.w, src[2] = &p.k, src[kColumnRows] = &cols, src[4] = &p.a, src[5] = &p.b;
    if constexpr (kHeld)
#pragma unroll
      for (int m = 0; m < 6; ++m) first[m] = vptr<T>(*src[m], b, row0, h, pcol);
  }
  __device__ void fetch(int64_t ci) {
#pragma unroll
    for (int m = 0; m < 6; ++m) fetch_one(m, ci);
  }
  // Block m of chunk ci alone.
  __device__ void fetch_one(int m, int64_t ci) {
    const T* at;
    if constexpr (kHeld) at = first[m] + ci * C * src[m]->st;
    else at = vptr<T>(*src[m], b, row0 + ci * C, h, pcol);
    const bool on = prow < len - ci * C;
    if (vec) {
      piece[m] = on ? *reinterpret_cast<const uint4*>(at) : make_uint4(0, 0, 0, 0);
    } else {
      T e[kPieceElems];
#pragma unroll
      for (int i = 0; i < kPieceElems; ++i) e[i] = on ? at[i * src[m]->sd] : from_f<T>(0.f);
      memcpy(&piece[m], e, sizeof e);
    }
  }
  // r, a into R^, Â (scaled in place by decay_scan), k, b into K^, B^, w to the scratch and the
  // column side times col_scale to crow.
  __device__ void stage(const ChunkSteps& at, float col_scale) const {
    using B = ChunkBlock;
    float* const dst[6] = {at.blk + B::rhat, at.wrow, at.blk + B::khat, at.blk + B::crow, at.blk + B::ahat,
                           at.blk + B::bhat};
    const int ld[6] = {LA, K, LB, LB, LA, LB};
#pragma unroll
    for (int m = 0; m < 6; ++m) stage_one(m, dst[m], ld[m], m == kColumnRows ? col_scale : 1.f);
  }
  // Block m times f into dst, row stride ld.
  __device__ void stage_one(int m, float* dst, int ld, float f = 1.f) const {
    T e[kPieceElems];
    memcpy(e, &piece[m], sizeof e);
    float4* const d = reinterpret_cast<float4*>(dst + prow * ld + pcol);
    d[0] = make_float4(f * to_f(e[0]), f * to_f(e[1]), f * to_f(e[2]), f * to_f(e[3]));
    d[1] = make_float4(f * to_f(e[4]), f * to_f(e[5]), f * to_f(e[6]), f * to_f(e[7]));
  }
  // r, w, k, a, b as they came (their 16-bit elements) into raw [5][C][K] (the single-pass
  // backward's K-vector gradients read them where the staged block holds them decayed).
  __device__ void stage_raw(uint16_t* raw) const {
    static_assert(sizeof(T) == 2, "16-bit inputs");
    const int from[5] = {0, 1, 2, 4, 5};
#pragma unroll
    for (int m = 0; m < 5; ++m) *reinterpret_cast<uint4*>(raw + m * C * K + prow * K + pcol) = piece[from[m]];
  }
};

// The decays of a staged chunk, a thread per channel and direction (tid < 2K of the group), the
// channel's w in registers: Omega_i (rows after i) from a backward sum (tid 0..K-1: K^, B^),
// E_i (exclusive) and G_i = E_{i+1} from a forward one (tid K..2K-1: R^, Â, gamma and its
// reciprocal). Every exponent an added-up sum of w <= 0. Returns this thread's part of whether the chunk is
// bounded (every channel's total >= -60), to be AND-ed over the CTA at the barrier after it.
__device__ inline bool decay_scan(const ChunkSteps& at, int tid) {
  using B = ChunkBlock;
  const int d = tid % K;
  float wv[C];
#pragma unroll
  for (int i = 0; i < C; ++i) wv[i] = at.wrow[i * K + d];
  float e = 0.f;
  if (tid < K) {
#pragma unroll
    for (int i = C - 1; i >= 0; --i) {  // K^, B^ = (k, b) e^Omega
      const float f = expf(e);
      at.blk[B::khat + i * LB + d] *= f;
      at.blk[B::bhat + i * LB + d] *= f;
      e += wv[i];
    }
    return true;
  }
#pragma unroll
  for (int i = 0; i < C; ++i) {
    const float gi = e + wv[i];
    at.blk[B::rhat + i * LA + d] *= expf(gi);
    at.blk[B::ahat + i * LA + d] *= expf(e);
    e = gi;
  }
  const float gamma = expf(e);
  at.blk[B::gam + d] = gamma;
  at.blk[B::ginv + d] = 1.f / gamma;  // (inf where gamma underflows: read only where bounded)
  return e >= -60.f;
}

// Where the chunk is bounded: k e^-G = K^ / gamma and b e^-G = B^ / gamma over w's scratch
// (gamma >= e^-60 there: the one negative exponent, bounded), by `threads` threads. After the
// barrier that ANDs decay_scan's flags; not synchronised.
__device__ inline void factor_keys(const ChunkSteps& at, int tid, int threads = NTF) {
  using B = ChunkBlock;
  for (int e = tid; e < C * K; e += threads) {
    const int i = e / K, d = e % K;
    const float inv = at.blk[B::ginv + d];
    at.wrow[i * LA + d] = at.blk[B::khat + i * LB + d] * inv;
    at.btil[i * LA + d] = at.blk[B::bhat + i * LB + d] * inv;
  }
}

// The pair matrices A_rk, A_rb (j <= i), A_ak, A_ab (j < i) into the block's `mats`, by the
// kWarps warps of a group (tid its thread index). Bounded (after factor_keys): warp m makes
// matrix m % 4's 8-column tiles m / 4, m / 4 + kWarps / 4, ... as 16 x 16 tensor-core products
// over K of the factored rows, single TF32 (kX3 = false: the forward, whose inputs are 16-bit
// and whose o stays within their tolerance) or fp32-accurate 3xTF32 (kX3: the reverse pass,
// whose matrices grad reads, as prep's). Single TF32 loads its fragments in 16-byte pieces along
// k (kVectorLoads) or one float at a time: the single pass runs at its register limit, where the
// wider fragments spill and cost more than the loads they save (benchmarks/NOTES.md c71). Else
// every pair's factor from its own segment sum (w still in the scratch), the raw rows re-read (a
// rare path). Not synchronised.
template <typename T, bool kX3, int kWarps, bool kVectorLoads = true>
__device__ inline void pair_matrices(const ChunkSteps& at, bool bounded, const DplrChunkPass& p, const SeqSpan& s,
                                     int h, int64_t ci, int tid) {
  static_assert(kWarps == 4 || kWarps == 8, "a warp per matrix, or per matrix and column tile");
  using B = ChunkBlock;
  const int warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
  float* const mats = at.blk + B::mats;
  if (bounded) {
    const int m = warp % 4;
    const float* const rows = at.blk + (m < 2 ? B::rhat : B::ahat);
    const float* const cols = m % 2 ? at.btil : at.wrow;
    const bool incl = m < 2;
    if constexpr (!kX3 && kVectorLoads) {
      // warp_mma_nt_tiles: a quarter of warp_mma_ld's loads, the k sum in another order
      // (benchmarks/NOTES.md c70), both of the warp's column tiles at once where kWarps == 4
      // (tiles n0 and n0 + 8), one where 8.
      constexpr int kTiles = kWarps == 4 ? 2 : 1;
      const int n0 = 8 * (warp / 4);
      float acc[kTiles][4] = {};
      tile::warp_mma_nt_tiles<false, false, kTiles>(acc, kTiles, K, rows, LA, cols + n0 * LA, LA);
#pragma unroll
      for (int t = 0; t < kTiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = tile::nt_row(0, e), j = tile::nt_col(n0 + 8 * t, e);
          mats[m * C * LM + i * LM + j] = (incl ? j <= i : j < i) ? acc[t][e] : 0.f;
        }
    } else {
#pragma unroll
      for (int n0 = 8 * (warp / 4); n0 < C; n0 += 8 * (kWarps / 4)) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (kX3) {
          const float* pa = rows + g * LA + q;
          const float* pb = cols + (n0 + g) * LA + q;
#pragma unroll 4
          for (int c0 = 0; c0 < K; c0 += 8, pa += 8, pb += 8) {
            const float av[4] = {pa[0], pa[8 * LA], pa[4], pa[8 * LA + 4]}, bv[2] = {pb[0], pb[4]};
            tile::mma_tf32x3(acc, av, bv);
          }
        } else {
          warp_mma_ld<false, true>(acc, K, rows, LA, cols + n0 * LA, LA);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = g + 8 * (e / 2), j = n0 + 2 * q + e % 2;
          mats[m * C * LM + i * LM + j] = (incl ? j <= i : j < i) ? acc[e] : 0.f;
        }
      }
    }
  } else {
    const int64_t rem = s.len - ci * C;
    for (int e = tid; e < C * C; e += 32 * kWarps) {
      const int i = e / C, j = e % C;
      float rk = 0.f, rb = 0.f, ak = 0.f, ab = 0.f;
      if (j <= i && i < rem) {
        const int64_t ti = s.bos + ci * C + i, tj = s.bos + ci * C + j;
        for (int d = 0; d < K; ++d) {
          float seg = 0.f;  // sum of w over rows j < s < i
          for (int r = j + 1; r < i; ++r) seg += at.wrow[r * K + d];
          const float kj = to_f(*vptr<T>(p.k, s.b, tj, h, d)), bj = to_f(*vptr<T>(p.b, s.b, tj, h, d));
          const float fi = expf(seg + (i > j ? at.wrow[i * K + d] : 0.f));
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
}

// A one-block kernel's chunk steps after staging (its 128 threads): the decays, the keys
// factored where bounded, the pair matrices. After the staging barrier; ends synchronised.
template <typename T, bool kX3>
__device__ inline void chunk_steps(const ChunkSteps& at, const DplrChunkPass& p, const SeqSpan& s, int h,
                                   int64_t ci) {
  const int tid = threadIdx.x;
  const bool bounded = __syncthreads_and(decay_scan(at, tid));
  if (bounded) factor_keys(at, tid);
  __syncthreads();
  pair_matrices<T, kX3, 4>(at, bounded, p, s, h, ci, tid);
  __syncthreads();
}

// X = (I - A_ab)^-1 by forward substitution into its block of `mats`, on the group's warp 0
// (tid < C: a lane per column, held in registers; A_ab's rows read as broadcasts). Every entry
// is written (the upper triangle explicit zeros). Not synchronised.
__device__ inline void solve_x(float* blk, int tid) {
  const int j = tid;
  if (j >= C) return;
  const float* const A = blk + ChunkBlock::mats + kMatAab * C * LM;
  float* const X = blk + ChunkBlock::mats + kMatX * C * LM;
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
