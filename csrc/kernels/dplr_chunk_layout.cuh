// Layout of the chunked RWKV7 engine's CTAs (dplr_chunk_launch.cuh has the overview): the
// shared-memory layout of prep and grad (Smem), a grad CTA's coordinates (Cta), the 16-byte
// shared-memory accessors, and where a CTA's column tile of a state workspace starts. The
// per-chunk workspace layout is DplrWorkspaceLayout (dplr_chunk.h), shared with the op layer.
//
// Glossary of the short names used by every dplr_chunk_*.cuh:
//   C     rows per chunk (kDplrChunk = 16)
//   CP    row stride (floats) of the 16 x 16 matrices, in shared memory and the workspace
//         (kDplrMatStride = 20)
//   NT    threads per CTA of prep and grad (256 = C * C: one per pair (i, j))
//   MB    rows per micro-block of the exact pair matrices (pair_matrices)
//   PS    channels per slab of the pair workspace; PSP its row stride (PS + 4, 16-byte aligned)
//   L     a kernel's shared-memory layout (Smem; StateSmem in the sweeps)
//   KP    (Smem) row stride of K-rows in shared memory: K rounded up to 4, plus 4
//   cols  (Smem) state columns of a CTA's tile; lc = log2(cols); BP = cols + 4, the row stride
//         of tile rows and states
//   KP4, KS, VP4, UP, tiles  (DplrWorkspaceLayout, dplr_chunk.h) K rounded up to 4, the
//         workspace's K-row stride (K rounded up to 32), V rounded up to 4, the U0 / O0 row
//         stride (kDplrSweepCols + 8), the sweep tiles of V
//   SX, NTS, SXP  (dplr_chunk_sweep.cuh) state columns and threads per sweep CTA, the row stride
//         of the staged U0 / O0 (= UP)
//   TC    bf16 / fp16 inputs: products on TF32 tensor cores (fp32 inputs: 3xTF32, X3)
//   X3    fp32 inputs: fp32-accurate 3xTF32 tensor-core products (tile_mma.cuh mma_tf32x3)
//   KC    K as a compile-time constant (64 or 128), 0 for a runtime K
#pragma once
#include "dplr_chunk.h"
#include "elements.cuh"
#include "tile_mma.cuh"

namespace fla {
namespace dplr_chunk_detail {

using elements::aligned16;
using elements::from_f;
using elements::ld;
using elements::mptr;
using elements::to_f;
using elements::vptr;
using elements::voff;
using tile::acc_col;
using tile::acc_row;
using tile::warp_mma;
using tile::mma_tf32;
using tile::mma_tf32_as;
using tile::tf32_if;
using tile::tf32_round;
using tile::warp_mma_ld;
using tile::warp_mma_nt;
using tile::nt_col;
using tile::nt_row;
using tile::kp_row;

constexpr int C = kDplrChunk, CP = kDplrMatStride, NT = 256;
static_assert(NT == C * C, "one thread per pair (i, j) of a chunk");

// Pair matrices by 4-row micro-blocks, channels in slabs of PS (docs/algorithms.md §1.2 references one
// level down). Pair workspace rows [C][PSP]: r~ = r exp(Rin), a~ = a exp(Rex) (exponents from
// the micro-block start, inclusive / exclusive), k~ = k exp(L), b~ = b exp(L) (to the micro-block
// end), and P1, P2, P3: the products of the last 1, 2, 3 exp(w) of the micro-block up to the row;
// then rows [PSP]: the gap factors of micro-block pairs (2,0), (3,1), (3,0) (exp of the totals
// strictly between), ones and zeros. Every exponent is a sum of w's, never a difference.
constexpr int MB = 4, PS = 24, PSP = PS + 4;  // PSP: 16-byte aligned rows
// Rows per pair walk (grad's kvector_grads, pair_walks): each walked row's loads serve all of them.
constexpr int kWalkRows = 4;
static_assert(C % kWalkRows == 0, "whole walks");
constexpr int kPairRows = 7, kPairWs = kPairRows * C * PSP + 5 * PSP;

// Shared memory of one CTA, in floats. K-rows [C][KP] (KP: 16-byte aligned rows with 4 floats of
// padding, 0, so rows read as float4 and 16 rows' same channel spread over 8 banks), tile rows
// [C][BP], 16 x 16 matrices [C][CP], states [K][BP]; every array starts 16-byte aligned. The
// prep kernel (bwd = false) has no state; the backward kernel has no exp(G) / exp(Omega) rows
// (it multiplies them up from exp(w) where it needs them) and keeps M + P in M, so that at K = 64
// its 64-column tiles fit two CTAs per SM (109 KB).
struct Smem {
  int K, KP, cols, lc, BP;  // lc = log2(cols); BP: row stride of tile rows and states
  int r, w, k, a, b, eG, eO, S, v, U, M, Ark, Arb, Aak, Aab, X;
  // Backward. dA: the four pair-matrix gradients interleaved, [C][C][4] = (dA_rk, dA_rb, dA_ak,
  // dA_ab) per pair, so that the K-vector gradients' pair walks read one float4 per pair.
  // zeta = rowsum(S+ * dS+) in parts (grad_kernel): rowsum(S * dS+) at zeta, gamma at zgam, the
  // state-part sums at zparts ([2][K]: put_state_part's). dr_rows, dk_rows, da_rows, db_rows: the
  // K-vector gradients' rows [C][KP] (dr, dk, da, db), written last; before that grad_kernel keeps
  // exp(Omega), then K^, in dk_rows, Â in da_rows and B^ in db_rows.
  int dS, dO, dU, dM, dr_rows, dk_rows, da_rows, db_rows, dA, dX, Y, zeta, zgam, zparts;
  // A grad CTA walking two column tiles on strided states (`tile_states`): the second tile's
  // state [K][BP], made in place from chunk to chunk as S is for the first; 0 otherwise.
  int S1;
  int pw, pwn;  // pair workspace (pwn floats), 16-byte aligned; -1 (0) in the backward
  int stage;  // raw rows of the asynchronous loads: over pw (prep) or from dk_rows on (backward)
  int total;

  // Prep's column tiles stay at 32 (K <= 128): its U0 / O0 loop gains nothing from wider ones,
  // and 64 would cost it its third CTA per SM.
  __host__ __device__ Smem(int K_, bool bwd, bool tile_states = false)
      : K(K_), KP((K_ + 3) / 4 * 4 + 4), cols(bwd ? dplr_chunk_cols(K_) : K_ <= 128 ? 32 : 8) {
    lc = 0;
    while ((1 << lc) < cols) ++lc;
    // cols + 4: 16-byte aligned rows (a thread's walk along a row reads float4), and the
    // K-vector gradients' float4 reads down a state column (lanes on channels) put the 8 lanes
    // of a 16-byte phase on different banks (cols apart: 32-way conflicts).
    BP = cols + 4;
    int o = 0;
    auto take = [&](int n) { const int at = o; o += (n + 3) / 4 * 4; return at; };
    r = take(C * KP), w = take(C * KP), k = take(C * KP), a = take(C * KP), b = take(C * KP);
    eG = bwd ? -1 : take(C * KP), eO = bwd ? -1 : take(C * KP), S = bwd ? take(K * BP) : 0;
    v = take(C * BP), U = take(C * BP), M = take(C * BP);
    Ark = take(C * CP), Arb = take(C * CP), Aak = take(C * CP), Aab = take(C * CP);
    // the five are consecutive (C * CP is a multiple of 4): DplrWorkspaceLayout::mats_at()
    X = take(C * CP);
    static_assert(CP % 4 == 0 && CP > C, "16-byte aligned rows of the 16 x 16 matrices");
    dS = dO = dU = dM = dr_rows = dk_rows = da_rows = db_rows = dA = dX = Y = zeta = zgam = zparts = S1 = 0;
    if (bwd) {
      dS = take(K * BP), dO = take(C * BP), dU = take(C * BP), dM = take(C * BP);
      zeta = take(K), zgam = take(K), zparts = take(2 * K);
      dr_rows = take(C * KP), dk_rows = take(C * KP), da_rows = take(C * KP), db_rows = take(C * KP);
      dA = take(4 * C * C);
      dX = take(C * CP), Y = take(C * CP);
      if (tile_states) S1 = take(K * BP);
    }
    // only prepare() (prep) uses the pair workspace: the pair walks' rows, or pair_matrices_tc's
    // two K-row arrays, and the stage (raw rows and v: 16-bit rows with V <= K + 8 fit)
    pwn = bwd ? 0 : kPairWs > 3 * C * KP ? kPairWs : 3 * C * KP;
    pw = bwd ? -1 : take(pwn);
    total = o;
    stage = bwd ? dk_rows : pw;
  }
  __host__ __device__ size_t bytes() const { return size_t(total) * sizeof(float); }
};

// What a grad CTA works on (grid: chunk slot, head, column tile).
struct Cta {
  int n;     // the sequence of the CTA's chunk slot
  int h;     // head
  int tile;  // column tile (blockIdx.z): columns [x0, x0 + nc) of V
  int x0;    // first column of the tile: tile * Smem::cols
  int nc;    // columns of the tile within V: min(Smem::cols, V - x0)
  SeqSpan s;  // sequence n's rows (batch row, start, length)
};

// 16-byte shared reads: rows of K-vectors and tiles and the state rows start 16-byte aligned
// (Smem), so a reduction along a row reads 4 terms per load instead of 1.
__device__ __forceinline__ float4 ld4(const float* q) { return *reinterpret_cast<const float4*>(q); }
__device__ __forceinline__ float dot4(const float4& a, const float4& b, float acc) {
  acc += a.x * b.x, acc += a.y * b.y, acc += a.z * b.z, acc += a.w * b.w;
  return acc;
}
__device__ __forceinline__ void st4(float* q, const float4& v) { *reinterpret_cast<float4*>(q) = v; }
__device__ __forceinline__ float4 mul4(const float4& a, const float4& b) {
  return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
}

// exp(E_i) = exp(G_{i-1}), 1 on the first row.
__device__ __forceinline__ float eE(const float* sm, const Smem& L, int i, int d) {
  return i ? sm[L.eG + (i - 1) * L.KP + d] : 1.f;
}

// The CTA's column tile of slot `slot` of a state workspace laid out as [slots, H, K, V] (hst,
// or dhst), at row 0.
__device__ __forceinline__ float* slot_state(const DplrChunkPass& p, void* base, const Cta& c,
                                             int64_t slot) {
  return static_cast<float*>(base) + (slot * p.H + c.h) * p.K * int64_t(p.V) + c.x0;
}

}  // namespace dplr_chunk_detail
}  // namespace fla
