// Torch-free description of the chunked RWKV7 (DPLR) algebra, ALGORITHMS.md §6 (WY/UT form),
// forward and backward, per (sequence n, head h):
//   h_t = diag(exp(w_t)) h_{t-1} + b_t (a_t^T h_{t-1}) + k_t v_t^T,   o_t = scale * h_t^T r_t.
//
// Chunks of kDplrChunk = 16 rows, restarted at every sequence start. With C = 16 every pair
// factor exp(sum of w over the rows between i and j) is evaluated elementwise from an additive
// segment sum (never a difference of cumsums, never a positive exponent), so any w in
// [-inf, 0] is exact and no sub-chunk reference or block inverse is needed; X = (I - A_ab)^-1 is
// one 16 x 16 forward substitution (fla's DPLR default, §6.2). C = 64 with 16-row sub-chunks
// and a block inverse would shorten the sequential pass 4x.
//
// The CUDA forward splits the chunk step (§6.3) into what does not depend on the state, done
// for all chunks at once, and a sequential pass that only multiplies by it:
//   W = X Â,  Q~ = R^ + A_rb W,  U0 = X A_ak V,  O0 = scale (A_rk V + A_rb U0)     (parallel)
//   U = U0 + W S,  O = O0 + scale Q~ S,  S+ = diag(gamma) S + K^^T V + B^^T U       (sequential)
//
// Per chunk (local rows i, j; G/E inclusive/exclusive sums from the chunk start, Omega to the
// chunk end; S the chunk-start state):
//   A_rk, A_rb (j <= i), A_ak, A_ab (j < i)    the four pair matrices
//   P = (A * exp(E)) S,  M = A_ak V,  U = X (M + P)          (U = "v_new": U0 + W S)
//   O = scale (R^ S + A_rk V + A_rb U),  S+ = diag(gamma) S + K^^T V + B^^T U
// Backward (§6.4) with dS+ the gradient at the chunk end:
//   dU = scale A_rb^T dO + B^ dS+,  dM = X^T dU (= d(M + P)),  dX = dU (M + P)^T,
//   dA_ab = stril(X^T dX X^T),  dS = diag(gamma) dS+ + scale R^^T dO + A^^T dM,
//   zeta = rowsum(S+ * dS+),  dw = reverse cumsum of (r dr - k dk - b db) (plus a da one row
//   later) + zeta, reset to exactly 0 where exp(w) == 0 (there the true dw is 0).
// Every step is linear in the state's columns, so both backends split V into tiles of
// dplr_chunk_cols(K) columns and run each (n, h, tile) on its own; the K-vector gradients are
// per-tile partial sums (layout of DplrPass::kg) that the op layer adds, or, on CUDA with V in
// one tile, written straight into the outputs (DplrArgs::kg_pair = 0).
#pragma once
#include <cstdint>

#include "chunk.h"  // chunk_slot / chunk_slots (slot map of the chunk-start states)
#include "dplr.h"   // DplrKGrad

namespace fla {

constexpr int kDplrChunk = 16;

// State columns per backward tile: 64 up to K = 128 (V <= 64 is then one tile: a chunk's K-vector
// gradients are whole in one CTA, stored without partial sums or atomics, and its chunk-wide work
// is not repeated per tile; 32-column tiles at K = 128 repeated it four times at V = 128: grad
// 25.5 ms), 8 beyond, so that the CUDA backward's shared memory (rows, pair matrices, K x cols
// state and its gradient) holds two CTAs per SM up to K = 64 and fits in 227 KB up to K = 256.
FLA_HD int dplr_chunk_cols(int K) { return K <= 128 ? 64 : 8; }
FLA_HD int dplr_chunk_tiles(int K, int V) {
  const int c = dplr_chunk_cols(K);
  return (V + c - 1) / c;
}

// Row stride (floats) of the 16 x 16 matrices in shared memory and the workspace. 20: the
// tensor-core fragments read them conflict-free, rows (8-byte loads, lanes 16 apart on rows
// 2 apart: banks 8 apart) and columns (rows 2q: banks 8q apart) alike; 17 had 4-way conflicts
// on the transposed reads (ncu: 11 % of the gradient kernel's shared-memory wavefronts).
constexpr int kDplrMatStride = 20;

// State columns per CTA of the CUDA sequential passes (dplr_chunk_sweep.cuh).
constexpr int kDplrSweepCols = 32;

// The XOR swizzle of 16-byte pieces in the workspace's K-rows: piece c of row r sits at c ^
// kswz(r). The sweeps read those rows as tensor-core operands two ways: 16 bytes of rows g and
// g + 1 at a time (g = 0..7: bit 2 of the swizzle splits the pair) and 4 bytes of rows 4q + s
// (q = 0..3) at 8 channels (bits 1, 2 give each q its own 8 banks); both conflict-free at any
// row stride that is a multiple of 32 floats. Period 16: the same in each of the 16-row arrays.
FLA_HD int dplr_kswz(int r) { return ((r & 1) << 2) ^ (((r >> 2) & 3) << 1); }

// The CUDA per-chunk workspaces, laid out as the sequential passes hold a chunk in shared
// memory, so that each of their fetches is one to three bulk copies (one copy per row cost more
// than the fetch it replaced: NOTES c19). Padding is 0, and so are U0 / O0 columns past V.
// `ws`, `per()` fp32 values per (chunk slot, head): W, Q~, K^, B^ [C][KS] (KS: K rounded up to
// 32 floats, pieces swizzled: kat), gamma [KP4] (contiguous: the K-part), then the four pair
// matrices and X for the backward. `uo`, `uper()` values per (chunk slot, head): per sweep tile
// of kDplrSweepCols columns U0, O0 [C][UP] (UP = kDplrSweepCols + 8: 8 mod 32, so that reads of
// rows 2q, 2q + 1 at 8 columns fall on different banks). Only the forward sweeps read U0 / O0,
// so a training forward keeps `ws` for its backward and frees `uo` (a third of the workspace:
// 0.34 GB at B8 T4096 H16 K=V=64).
struct DplrWs {
  int KP4, KS, VP4, tiles;  // VP4: V rounded up to 4, the U0 / O0 columns prep computes
  static constexpr int UP = kDplrSweepCols + 8;
  FLA_HD DplrWs(int K, int V)
      : KP4((K + 3) / 4 * 4), KS((K + 31) / 32 * 32), VP4((V + 3) / 4 * 4),
        tiles((V + kDplrSweepCols - 1) / kDplrSweepCols) {}
  FLA_HD int64_t W() const { return 0; }
  FLA_HD int64_t Q() const { return int64_t(kDplrChunk) * KS; }
  FLA_HD int64_t Kh() const { return 2 * Q(); }
  FLA_HD int64_t Bh() const { return 3 * Q(); }
  FLA_HD int64_t gam() const { return 4 * Q(); }
  FLA_HD int64_t kpart() const { return gam() + KP4; }  // floats of W .. gamma
  // Offset of channel d of K-part row `row` (0 .. 4C: W, Q~, K^, B^ rows in turn).
  FLA_HD int kat(int row, int d) const { return row * KS + ((((d >> 2) ^ dplr_kswz(row)) << 2) | (d & 3)); }
  // The four pair matrices and X, for the backward: [5][C][kDplrMatStride] (A_rk, A_rb, A_ak,
  // A_ab, X), rows padded as the CUDA kernels hold them in shared memory, so that they move as one
  // contiguous block of 16-byte pieces.
  FLA_HD int64_t mats() const { return kpart(); }
  FLA_HD int64_t per() const { return mats() + 5 * kDplrChunk * kDplrMatStride; }
  // In `uo`: tile t's block, U0 [C][UP] then O0 [C][UP]; uo(m, i, x): U0 (m = 0) or O0 (m = 1),
  // row i, column x of the value dimension.
  FLA_HD int64_t utile(int t) const { return int64_t(t) * 2 * kDplrChunk * UP; }
  FLA_HD int64_t uo(int m, int i, int x) const {
    return utile(x / kDplrSweepCols) + (m * kDplrChunk + i) * UP + x % kDplrSweepCols;
  }
  FLA_HD int64_t uper() const { return utile(tiles); }
};

struct DplrChunkPass : DplrArgs {  // dplr.h: the operands, outputs and gradients
  // Backward workspace (acc, contiguous [chunk_slots<kDplrChunk>(N, T, varlen), H, K, V]): the
  // chunk-start states and, in the slot after a sequence's last chunk, its final state. A CUDA
  // forward stores them when set (the training forward keeps them for its backward).
  void* hst = nullptr;
  // CUDA backward: hst and ws hold the training forward's chunk-start states and workspace (its
  // prep also stored the pair matrices and X when hst was set): neither prep nor the forward
  // sweep runs.
  bool kept = false;
  // CUDA workspaces (CPU: unused): [chunk_slots<kDplrChunk>(N, T, varlen), H, DplrWs::per()]
  // and [.., DplrWs::uper()] (U0 / O0: any call that runs a forward sweep) fp32, and for the
  // backward dS at every chunk end, laid out as hst.
  void* ws = nullptr;
  void* uo = nullptr;
  void* dhst = nullptr;
  // CUDA: set by the launch when every activation row can be copied asynchronously 16 bytes at a
  // time (last dim contiguous, row starts 16-byte aligned, K and V whole 16-byte pieces) and the
  // raw rows fit the kernels' stage; else the kernels load element by element.
  bool rows16 = false;
  // CUDA: set by the launch when the K-vector gradients go straight to their outputs (kg_pair =
  // 0) and each output's rows are whole 16-byte pieces at 16-byte aligned addresses.
  bool kg16 = false;
  // CUDA: set by the launch when r, w, k, a, b share their strides (one element offset serves
  // all five row copies).
  bool krows_same = false;
  // CUDA: set by the launch when the five K-vector gradient outputs (kgd) share their strides.
  bool kg_same = false;
};

void dplr_chunk_cpu(const DplrChunkPass& p);
// Returns nullptr on success, else the CUDA error string of the failed launch.
const char* dplr_chunk_cuda(const DplrChunkPass& p, void* stream);

}  // namespace fla
