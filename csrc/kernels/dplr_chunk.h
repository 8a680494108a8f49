// Torch-free description of the chunked RWKV7 (DPLR) algebra, docs/algorithms.md §6 (WY/UT form),
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
// is not repeated per tile; 32-column tiles at K = 128 would repeat it four times at V = 128),
// 8 beyond, so that the CUDA backward's shared memory (rows, pair matrices, K x cols state and
// its gradient) holds two CTAs per SM up to K = 64 and fits in 227 KB up to K = 256.
FLA_HD constexpr int dplr_chunk_cols(int K) { return K <= 128 ? 64 : 8; }
FLA_HD int dplr_chunk_tiles(int K, int V) {
  const int c = dplr_chunk_cols(K);
  return (V + c - 1) / c;
}

// Row stride (floats) of the 16 x 16 matrices in shared memory and the workspace. 20: the
// tensor-core fragments read them conflict-free, rows (8-byte loads, lanes 16 apart on rows
// 2 apart: banks 8 apart) and columns (rows 2q: banks 8q apart) alike; 17 has 4-way conflicts
// on the transposed reads, which the gradient kernel makes many of.
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
// memory, so that each of their fetches is one to three bulk copies (a copy per row would pay
// the copy engine's cost per copy for every row). Padding is 0, and so are U0 / O0 columns past V.
// `ws`, floats_per_chunk() fp32 values per (chunk slot, head): W, Q~, K^, B^ [C][KS] (KS: K
// rounded up to 32 floats, pieces swizzled: krow_at), gamma [KP4] (contiguous: the K-part), then
// the four pair matrices and X for the backward. `uo`, uo_floats_per_chunk() values per (chunk
// slot, head): per sweep tile of kDplrSweepCols columns U0, O0 [C][UP] (UP = kDplrSweepCols + 8:
// 8 mod 32, so that reads of rows 2q, 2q + 1 at 8 columns fall on different banks). Only the
// forward sweeps read U0 / O0, so a training forward keeps `ws` for its backward and frees `uo`
// (a third of the workspace).
// The methods return offsets in floats from the start of one (chunk slot, head) block.
struct DplrWorkspaceLayout {
  int KP4;    // K rounded up to 4: the channels of the K-part rows prep writes
  int KS;     // K rounded up to 32: the row stride of the K-part rows
  int VP4;    // V rounded up to 4: the U0 / O0 columns prep computes
  int tiles;  // sweep tiles of kDplrSweepCols columns over V
  static constexpr int UP = kDplrSweepCols + 8;  // row stride of U0 / O0
  FLA_HD DplrWorkspaceLayout(int K, int V)
      : KP4((K + 3) / 4 * 4), KS((K + 31) / 32 * 32), VP4((V + 3) / 4 * 4),
        tiles((V + kDplrSweepCols - 1) / kDplrSweepCols) {}
  // The K-part: the rows of W, Q~, K^, B^ ([C][KS] each), then gamma [KP4].
  FLA_HD int64_t w_at() const { return 0; }
  FLA_HD int64_t q_at() const { return int64_t(kDplrChunk) * KS; }
  FLA_HD int64_t khat_at() const { return 2 * q_at(); }
  FLA_HD int64_t bhat_at() const { return 3 * q_at(); }
  FLA_HD int64_t gamma_at() const { return 4 * q_at(); }
  FLA_HD int64_t kpart_floats() const { return gamma_at() + KP4; }  // floats of W .. gamma
  // Offset of channel d of K-part row `row` (0 .. 4C: W, Q~, K^, B^ rows in turn).
  FLA_HD int krow_at(int row, int d) const { return row * KS + ((((d >> 2) ^ dplr_kswz(row)) << 2) | (d & 3)); }
  // The four pair matrices and X, for the backward: [5][C][kDplrMatStride] (A_rk, A_rb, A_ak,
  // A_ab, X), rows padded as the CUDA kernels hold them in shared memory, so that they move as one
  // contiguous block of 16-byte pieces.
  FLA_HD int64_t mats_at() const { return kpart_floats(); }
  static constexpr int kMatsFloats = 5 * kDplrChunk * kDplrMatStride;
  FLA_HD int64_t floats_per_chunk() const { return mats_at() + kMatsFloats; }
  // In `uo`: tile t's block, U0 [C][UP] then O0 [C][UP]; uo_at(m, i, x): U0 (m = 0) or O0
  // (m = 1), row i, column x of the value dimension.
  FLA_HD int64_t uo_tile_at(int t) const { return int64_t(t) * 2 * kDplrChunk * UP; }
  FLA_HD int64_t uo_at(int m, int i, int x) const {
    return uo_tile_at(x / kDplrSweepCols) + (m * kDplrChunk + i) * UP + x % kDplrSweepCols;
  }
  FLA_HD int64_t uo_floats_per_chunk() const { return uo_tile_at(tiles); }
};

// CUDA: the load and store paths the launch picks for a pass's arguments (pick_paths); the CPU
// engine ignores them.
struct DplrChunkPaths {
  // Every activation row can be copied asynchronously 16 bytes at a time (last dim contiguous,
  // row starts 16-byte aligned, K and V whole 16-byte pieces) and the raw rows fit the kernels'
  // stage; else the kernels load element by element.
  bool rows_16byte = false;
  // The K-vector gradients go straight to their outputs (kg_pair = 0) and each output's rows are
  // whole 16-byte pieces at 16-byte aligned addresses.
  bool grads_16byte = false;
  // r, w, k, a, b share their strides: one element offset serves all five row copies.
  bool rows_share_offsets = false;
  // The five K-vector gradient outputs (kgd) share their strides: one element offset serves all
  // five gradient stores.
  bool grads_share_offsets = false;
  // bf16 / fp16: dv's rows are whole pairs of elements at 4-byte aligned addresses, so grad's
  // tensor-core lanes store their two adjacent columns as one 4-byte store.
  bool dv_pairs = false;
};

// Whether a CUDA pass of this dtype and head sizes can run the fused kernels, one CTA per
// (sequence, head): the forward (dplr_chunk_fused.cuh: no workspace; a training forward's also
// stores the chunk-start states, hst) and the reverse pass of a backward on those states
// (dplr_chunk_fused_reverse.cuh).
FLA_HD bool dplr_fused_forward(DType dtype, int K, int V) {
  return (dtype == DType::bf16 || dtype == DType::f16) && K == 64 && V == 64;
}

// Whether a CUDA training forward of this dtype and head sizes may keep the strided states
// (DplrKept::states): those whose grad walks strides of chunks, making the states between the
// kept ones (dplr_chunk_grad.cuh NextState). K = V = 64 (the fused forward's shapes) and K = V =
// 128 (there the forward sweep stores them: DplrChunkPass::sweep_strided_states), bf16 / fp16.
FLA_HD bool dplr_strided_states(DType dtype, int K, int V) {
  return (dtype == DType::bf16 || dtype == DType::f16) && K == V && (K == 64 || K == 128);
}

// What a CUDA training forward kept for its backward (DplrChunkPass::kept).
enum class DplrKept : int {
  nothing,
  // hst holds every kDplrStateStride-th chunk-start state (the fused forward's, or the
  // forward sweep's where DplrChunkPass::sweep_strided_states; dplr_kept_state_slot): the fused
  // reverse pass runs in place of prep and both sweeps, ws holding the pair matrices and X alone,
  // DplrWorkspaceLayout::kMatsFloats per (slot, head) (dplr_mats_offset), or with
  // sweep_strided_states prep (unless DplrChunkPass::strided_ws_kept: the forward kept its
  // workspace) and the reverse sweep; each grad CTA walks a stride of chunks, making the states
  // between the kept ones.
  states,
  // hst and ws hold the two-kernel forward's states and workspace (its prep also stored the pair
  // matrices and X): neither prep nor the forward sweep runs.
  states_and_workspace,
  // hst holds every chunk-start state as scaled fp16 (DplrF16States), the fused training forward's
  // where the single-pass backward (DplrChunkPass::single_pass_backward) is to read them; that
  // backward alone reads this form. Set on the forward's pass too: it tells the fused forward to
  // store them so.
  f16_states,
};

// The chunk-start states of DplrKept::f16_states, K = V = 64: the state before chunk ci of
// sequence n at chunk_slot<kDplrChunk>(n, ci), head h, as a record of kFloats floats (laid out in
// kernels/dplr_f16_states.cuh: the K x V values as fp16 in the backward's lane order, then one
// inverse power-of-two scale per 16 value columns). The slots after a sequence's chunks, which
// no pass reads, hold zeros (`saved` is an op output).
struct DplrF16States {
  static constexpr int64_t kFloats = 64 * 64 / 2 + 64 / 16;
  static FLA_HD int64_t floats(int N, int T, bool varlen, int H) {
    return chunk_slots<kDplrChunk>(N, T, varlen) * H * kFloats;
  }
};

// Chunks per state that a fused training forward keeps (DplrKept::states): the state before
// chunks 0, S, 2S, .. of each sequence, and its final state after them. A grad CTA walks those S
// chunks in order and makes each next chunk-start state from the one before (S+ = gamma S + K^^T
// V + B^^T U, every term of which it holds anyway), so the states kept through the forward take
// a quarter of the memory of one per chunk (at B = 8, T = 4096, H = 64, K = V = 64: 0.5 GB
// instead of 2 GB a layer), and the forward writes a quarter of them.
constexpr int kDplrStateStride = 4;
// The hst slot of the state before chunk S g of sequence n (g = ceil(chunks / S): its final
// state) where the forward kept every S-th (DplrKept::states): chunk_slot's map for chunks of
// S C rows, so that any cu_seqlens content keeps every slot inside chunk_slots of that size.
FLA_HD int64_t dplr_kept_state_slot(const int64_t* cu_seqlens, int n, int T, int64_t g) {
  return chunk_slot<kDplrChunk * kDplrStateStride>(cu_seqlens, n, T, g);
}
FLA_HD int64_t dplr_kept_state_slots(int N, int T, bool varlen) {
  return chunk_slots<kDplrChunk * kDplrStateStride>(N, T, varlen);
}

// Whether one CUDA grad CTA walks every column tile of its chunk (bf16 / fp16 at K = 128): the
// tiles' column products are summed in the CTA's registers, so the chunk-wide work (the K-rows
// and pair matrices, the decay rows, the pair walks, the dw scan) runs once per chunk instead of
// once per tile, and the K-vector gradients go straight to the outputs with no partial-sum slab.
// At K = 128 the kernel holds one CTA per SM anyway (its shared memory), so the registers for the
// sums are free. Elsewhere each tile has its own CTA: K <= 64 holds two CTAs per SM within 128
// registers, and fp32's raw v and dO rows would not fit over dA, dX and Y (load_tile_columns).
FLA_HD constexpr bool dplr_grad_walks_tiles(DType dtype, int K) {
  return (dtype == DType::bf16 || dtype == DType::f16) && K == 128;
}
// Column tiles of the CUDA grad grid (its blockIdx.z).
FLA_HD int dplr_grad_grid_tiles(DType dtype, int K, int V) {
  return dplr_grad_walks_tiles(dtype, K) ? 1 : dplr_chunk_tiles(K, V);
}

struct DplrChunkPass : DplrArgs {  // dplr.h: the operands, outputs and gradients
  // Backward workspace (acc, contiguous [chunk_slots<kDplrChunk>(N, T, varlen), H, K, V]): the
  // chunk-start states and, in the slot after a sequence's last chunk, its final state. A CUDA
  // forward stores them when set (the training forward keeps them for its backward).
  void* hst = nullptr;
  // CUDA backward: what hst and ws hold of the training forward's; a fused training forward's
  // f16_states: store them in that form.
  DplrKept kept = DplrKept::nothing;
  // CUDA workspaces (CPU: unused): [chunk_slots<kDplrChunk>(N, T, varlen), H,
  // DplrWorkspaceLayout::floats_per_chunk()] and [.., DplrWorkspaceLayout::uo_floats_per_chunk()]
  // (U0 / O0: any call that runs a forward sweep) fp32, and for the backward dS at every chunk
  // end, laid out as hst.
  void* ws = nullptr;
  void* uo = nullptr;
  void* dhst = nullptr;
  DplrChunkPaths paths;  // CUDA: set by the launch
  // CUDA forward: run the fused kernel (the op decides, where dplr_fused_forward allows it; no
  // workspace is then set; hst, when set, receives the chunk-start states). The backward on those
  // states (kept == DplrKept::states) always runs the fused reverse pass.
  bool fused = false;
  // CUDA training forward on the two-kernel path (not `fused`; hst and the kept workspace set):
  // where few (sequence, head) pairs leave the two kernels' chunk walk latency-bound, the launch
  // runs it as the two-block fused kernel that stores the same states and workspace
  // (dplr_chunk_launch.cuh), unless this is off (the op's FLA_EXT_RWKV7_FUSED=0).
  bool fused_may_keep = true;
  // CUDA backward on the fused forward's fp16 states (kept == DplrKept::f16_states), bf16 / fp16,
  // K = V = 64, one pass (no windows): run the single-pass backward
  // (kernels/dplr_chunk_fused_backward.cuh) in place of the fused reverse pass and grad; the op
  // sets it wherever the forward kept those states (keeps_f16_states).
  bool single_pass_backward = false;
  // CUDA, no cu_seqlens: the pass in windows of the chunk index when window_chunks > 0 (the
  // launch walks them, dplr_chunk_launch.cuh; window_begin is its cursor: each window's kernels
  // take chunks [window_begin, window_begin + window_chunks) of every sequence).
  //   The per-window buffers hold window_buffers (1 or 2) windows' slots, window k taking the
  //   (k mod window_buffers)-th: uo, dhst (dplr_work_slot), and ws unless it is whole
  //   (dplr_ws_kept, dplr_ws_slot). With two, a window's kernels need not wait for the last
  //   reader of the window before's.
  //   Forward on the two-kernel path: prep, then the forward sweep, window by window, so that the
  //   sweep of one window runs beside prep of the next (side_stream). hst's slots stay the whole
  //   pass's, and so do ws's in a forward keeping it; the sweep starts from `carry` where the
  //   window does not hold the first chunk and ends in it where it does not hold the last.
  //   Backward on kept states (DplrKept::states or states_and_workspace): the reverse sweep (or
  //   the fused reverse pass), then grad, the latest window first; with two buffers the reverse
  //   pass of window k + 1 runs on side_stream beside grad of window k. hst stays whole. On
  //   strided states (DplrKept::states) window_chunks is a multiple of kDplrStateStride. The
  //   reverse pass starts from dht where the window holds a sequence's last chunk, else from
  //   `carry` (the gradient at the window's end, which the later window left there), and ends in
  //   dh0 where it holds the first chunk, else in `carry`.
  // `carry`: [N, H, K, V] fp32, the state (forward) or its gradient (backward) between windows.
  int64_t window_begin = 0, window_chunks = 0;
  int window_buffers = 1;
  // Prep's ws slot in windows: blockIdx.x + blockIdx.z prep_ws_seq_slots + prep_ws_slot0 (set by
  // the launch per window: the window's own slots, or in a forward keeping ws the whole pass's,
  // chunk_slot without cu_seqlens; 0 and 0 outside windows).
  int64_t prep_ws_seq_slots = 0, prep_ws_slot0 = 0;
  MatArg carry;
  // CUDA: a second stream (cudaStream_t) for the windows' sequential kernels, of higher priority
  // than the caller's; null: every kernel on the caller's stream, one after another.
  void* side_stream = nullptr;
  // CUDA, bf16 / fp16 at K = V = 64 or 128 (dplr_strided_states; at 64 in the pipelined windows,
  // which take no cu_seqlens): the two-kernel path on the strided states (DplrKept::states) in
  // place of every chunk-start state. A training
  // forward's sweep stores them; the backward on them runs the reverse sweep where the fused
  // reverse pass would run, and grad reads the pair matrices and X from prep's workspace. That
  // workspace is either
  //   not kept (strided_ws_kept off): prep's serves each window alone, and the backward makes it
  //   again, a window at a time (for long sequences at few pairs, where the fused walks would be
  //   latency-bound: the least memory kept), or
  //   kept whole (strided_ws_kept, K = 128 elsewhere): the forward's prep stores it whole with the
  //   pair matrices into the kept buffer, as for DplrKept::states_and_workspace, and the backward
  //   runs no prep.
  bool sweep_strided_states = false;
  bool strided_ws_kept = false;
};

// The first slot after sequence n's in a slot map of R rows a slot (its chunks' and its final
// state's, then a varlen batch's gap slots up to here): the next sequence's first slot, or the
// end of the slots. R: kDplrChunk (hst, ws), or the strided states' kDplrChunk kDplrStateStride.
template <int R = kDplrChunk>
FLA_HD int64_t dplr_slots_after(const DplrChunkPass& p, int n) {
  return n + 1 < p.N ? chunk_slot<R>(p.cu_seqlens, n + 1, p.T, 0) : chunk_slots<R>(p.N, p.T, p.cu_seqlens != nullptr);
}
// The slot of sequence n's chunk ci in the backward's dhst (and in the ws the backward makes:
// prep's, or the fused reverse pass's matrices): hst's slot (chunk_slot), or in a window
// (window_chunks > 0) n * window_chunks + ci - window_begin.
FLA_HD int64_t dplr_work_slot(const DplrChunkPass& p, int n, int64_t ci) {
  return p.window_chunks > 0 ? int64_t(n) * p.window_chunks + ci - p.window_begin
                             : chunk_slot<kDplrChunk>(p.cu_seqlens, n, p.T, ci);
}
// Whether a two-kernel training forward keeps prep's workspace (with the pair matrices), or a
// backward reads the one kept (DplrKept::states_and_workspace, or strided states with
// DplrChunkPass::strided_ws_kept): then ws holds the whole pass's chunk slots, in windows of the
// chunk index too. Else each window's prep fills window_buffers windows' slots in turn: a
// training forward on strided states not keeping it, an inference forward, a backward making it
// again.
FLA_HD bool dplr_ws_kept(const DplrChunkPass& p) {
  if (p.backward()) return p.kept == DplrKept::states_and_workspace || (p.kept == DplrKept::states && p.strided_ws_kept);
  return p.hst != nullptr && (!p.sweep_strided_states || p.strided_ws_kept);
}
// The slot of sequence n's chunk ci in ws: hst's where ws is whole (dplr_ws_kept), else
// dplr_work_slot.
FLA_HD int64_t dplr_ws_slot(const DplrChunkPass& p, int n, int64_t ci) {
  return dplr_ws_kept(p) ? chunk_slot<kDplrChunk>(p.cu_seqlens, n, p.T, ci) : dplr_work_slot(p, n, ci);
}
// Prep's buffers for window `begin` of the chunk index in x, a copy of `base` (the pass whose uo
// and ws hold all window_buffers windows' slots): U0 / O0 and, unless ws is whole
// (dplr_ws_kept), prep's workspace in buffer `buf`, and the slots prep writes (prep_ws_seq_slots,
// prep_ws_slot0: the window's own, or the whole pass's, chunk_slot without cu_seqlens).
FLA_HD void dplr_prep_window(DplrChunkPass& x, const DplrChunkPass& base, int64_t begin, int buf) {
  const DplrWorkspaceLayout layout(base.K, base.V);
  const int64_t wc = base.window_chunks, per_buf = int64_t(base.N) * wc * base.H;
  x.window_begin = begin;
  x.uo = static_cast<float*>(base.uo) + buf * per_buf * layout.uo_floats_per_chunk();
  if (!dplr_ws_kept(base)) {
    x.ws = static_cast<float*>(base.ws) + buf * per_buf * layout.floats_per_chunk();
    x.prep_ws_seq_slots = wc, x.prep_ws_slot0 = 0;
  } else {
    x.prep_ws_seq_slots = (int64_t(base.T) + kDplrChunk - 1) / kDplrChunk + 1, x.prep_ws_slot0 = begin;
  }
}
// Where in ws (floats) grad reads the pair matrices and X of ws slot `slot` (dplr_ws_slot), head
// h: in the chunk's workspace block, or in blocks of their own where the fused reverse pass made
// them (DplrKept::states).
FLA_HD int64_t dplr_mats_offset(const DplrChunkPass& p, int64_t slot, int h) {
  if (p.kept == DplrKept::states && !p.sweep_strided_states) return (slot * p.H + h) * DplrWorkspaceLayout::kMatsFloats;
  const DplrWorkspaceLayout ws(p.K, p.V);
  return (slot * p.H + h) * ws.floats_per_chunk() + ws.mats_at();
}
// Prep and grad CTAs (blockIdx.x): one per slot of dhst.
FLA_HD int64_t dplr_work_slots(const DplrChunkPass& p) {
  return p.window_chunks > 0 ? int64_t(p.N) * p.window_chunks
                             : chunk_slots<kDplrChunk>(p.N, p.T, p.cu_seqlens != nullptr);
}
// The sequence and chunk whose dhst slot is `slot` (dplr_work_slot's inverse); a slot without a
// chunk gives a chunk index outside [0, the sequence's chunks).
struct DplrSlotChunk {
  int n;
  int64_t ci;
};
FLA_HD DplrSlotChunk dplr_slot_chunk(const DplrChunkPass& p, int64_t slot) {
  if (p.window_chunks > 0) return {int(slot / p.window_chunks), p.window_begin + slot % p.window_chunks};
  const int n = slot_sequence<kDplrChunk>(p.cu_seqlens, p.N, p.T, slot);
  return {n, slot - chunk_slot<kDplrChunk>(p.cu_seqlens, n, p.T, 0)};
}

// Grad CTAs (blockIdx.x): one per dhst slot (dplr_work_slots), or on strided states one per
// kept state's stride of chunks (the op makes a window of the chunk index whole strides).
FLA_HD int64_t dplr_grad_ctas(const DplrChunkPass& p) {
  if (p.kept != DplrKept::states) return dplr_work_slots(p);
  return p.window_chunks > 0 ? int64_t(p.N) * (p.window_chunks / kDplrStateStride)
                             : dplr_kept_state_slots(p.N, p.T, p.cu_seqlens != nullptr);
}
// The sequence and first chunk of grad CTA `cta` (a chunk index outside [0, the sequence's
// chunks) where it has none).
FLA_HD DplrSlotChunk dplr_grad_first_chunk(const DplrChunkPass& p, int64_t cta) {
  if (p.kept != DplrKept::states) return dplr_slot_chunk(p, cta);
  constexpr int S = kDplrStateStride;
  if (p.window_chunks > 0) {
    const int64_t per = p.window_chunks / S;
    return {int(cta / per), p.window_begin + cta % per * S};
  }
  const int n = slot_sequence<kDplrChunk * S>(p.cu_seqlens, p.N, p.T, cta);
  return {n, (cta - dplr_kept_state_slot(p.cu_seqlens, n, p.T, 0)) * S};
}

void dplr_chunk_cpu(const DplrChunkPass& p);
// Returns nullptr on success, else the CUDA error string of the failed launch.
const char* dplr_chunk_cuda(const DplrChunkPass& p, void* stream);

}  // namespace fla
