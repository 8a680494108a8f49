// Torch-free description of the chunked diagonal-gate algebra (docs/algorithms.md §1-§5, §7.1): GLA
// (inclusive reader) and RWKV6 (exclusive reader plus the bonus u), forward and backward, with a
// key-side decay g and (inclusive reader only) a value-side decay gv: the state update is
// h_t = diag(exp(g_t)) h_{t-1} diag(exp(gv_t)) + k_t v_t^T. gv is GSA pass 1 (decay on slots).
//
// Per (sequence, head) the time axis is cut into chunks of kChunk rows, restarted at every
// sequence start. The chunk-start states live in a workspace `hst` of fp32 (fp64 for fp64
// inputs) [slots, H, K, V] matrices, contiguous; sequence n's chunk c has slot
// chunk_slot(n, c) and the state after its last chunk (the final state) the slot after that.
// The slot map needs no host knowledge of cu_seqlens, so every launch is CUDA-graph safe.
#pragma once
#include <cstdint>

#include "tensor_args.h"  // DType, VecArg, MatArg

namespace fla {

constexpr int kChunk = 64;     // C
constexpr int kSubChunk = 16;  // c: the §1.2 reference points sit on sub-chunk boundaries
constexpr int kChunkTile = 64;  // K and V tile of the CUDA kernels
constexpr int kStateCols = 32;  // columns per zeta partial of the CUDA state kernel

enum class Reader : int { Inclusive = 0, Exclusive = 1 };

struct ChunkPass {
  DType dtype = DType::f32;  // of every VecArg
  int N = 0, H = 0, T = 0, K = 0, V = 0;
  const int64_t* cu_seqlens = nullptr;  // [N+1] on the pass's device, or null
  Reader reader = Reader::Inclusive;
  double scale = 1;

  VecArg q, k, v, g;           // q, k, g: K; v: V; g off = no decay
  VecArg gv;                   // V: value-side log decay (Inclusive only), off = none
  const void* u = nullptr;     // [H, K] contiguous bonus (Exclusive), dtype udtype
  DType udtype = DType::f32;
  MatArg h0;                   // initial state, zero when off

  // Forward: o (written) and hT (written when on).
  VecArg o;
  MatArg hT;
  // o / dq written in the acc type instead of `dtype` (a float32 q with bf16/fp16 k, v: GSA's
  // softmax input and its gradient stay unrounded).
  bool o_acc = false, dq_acc = false;
  // o's rows through a softmax over their V entries, computed in the acc type (GSA's slot
  // weights, ops/chunk_gsa_core.cpp): o then holds the weights in `dtype` (o_acc off) and
  // o_softmax_acc, when on, the same unrounded; the logits themselves are never stored. The CUDA
  // engine takes it with the value-side decay alone and V <= kChunkTile (chunk_softmax_on_cuda).
  bool o_softmax = false;
  VecArg o_softmax_acc;

  // Backward (when `dout` is on): every gradient below is written when on.
  VecArg dout;
  MatArg dht;                  // incoming final-state gradient, zero when off
  VecArg dq, dk, dv, dg, dgv;  // dgv: when gv is on
  // When on: dq's rows through the backward of a softmax with these acc-type weights w (K wide),
  // dq_t := w_t ⊙ (dq_t − ⟨w_t, dq_t⟩) in the acc type, then written in `dtype` (dq_acc off): GSA's
  // dok from pass 2's dp and p. The CUDA engine takes it in GLA's key-side pass (the inclusive
  // reader) with K <= kChunkTile (chunk_softmax_on_cuda).
  VecArg dq_softmax_w;
  // Added to what the tensor holds instead of written over it, with one rounding of the sum
  // (GSA adds its first pass's gradients of s and g into the second's: ops/chunk_gsa_core.cpp).
  bool dk_adds = false, dv_adds = false, dg_adds = false, dgv_adds = false;
  MatArg dh0;
  void* du = nullptr;          // [slots, H, K] acc per-chunk partials of du (summed by the op)

  // [slots, H, K, V] acc workspace (chunk-start states). May be null in a key-side forward with
  // chunk_fused_out(K) on CUDA (the state kernel forms o itself): the states are then not kept.
  void* hst = nullptr;
  void* dhst = nullptr;        // [slots, H, K, V] acc workspace (backward: dS at chunk ends)
  // [slots, H, ceil(V / kStateCols), K] acc workspace (backward): per-column-tile partial sums of
  // zeta = rowsum(S+ * dS+) (docs/algorithms.md §3); a backend may leave it unused.
  void* zeta = nullptr;
  // With gv on and g off the CUDA engine runs the transposed problem (chunk_vdecay.cuh): hst and
  // dhst then hold [V, K] matrices, and zeta [slots, H, ceil(K / 32), V].

  // amat [slots, H, C, C] acc: the CUDA engine's pair matrices A (written by its key-side
  // forward, read by its out kernels; a backend may leave it unused). Training workspaces kept
  // from the forward (key-side passes only): in the backward, amat_kept says amat already holds
  // the forward's A and hst_kept that hst holds its chunk-start states (their passes are skipped).
  void* amat = nullptr;
  bool amat_kept = false;
  bool hst_kept = false;

  // The CUDA state kernel walks in windows of this many chunks (chunk_window_chunks; 0: one walk
  // per sequence): each window hands its end state to the next through window_states
  // (chunk_window_states floats, [window][sequence][head][K][V]) and a flag in window_flags
  // (chunk_window_flags ints, zeroed by each launch).
  int window_chunks = 0;
  int* window_flags = nullptr;
  float* window_states = nullptr;
};

// The CUDA engine's value-side decay (kernels/chunk_vdecay.cuh) runs the transposed key-side pass.
FLA_HD MatArg transposed(MatArg m) {
  const int64_t r = m.sr;
  m.sr = m.sc, m.sc = r;
  return m;
}

// The transposed pass P' of a value-side-decay pass (chunk_vdecay.cuh); outputs off, set per launch.
inline ChunkPass value_side_as_key_side(const ChunkPass& p) {
  ChunkPass r = p;
  r.K = p.V, r.V = p.K;
  r.q = p.dout.on() ? p.dout : p.v;  // forward: only P''s dq is used, which does not read q'
  r.k = p.v, r.v = p.k, r.dout = p.q;
  r.g = p.gv, r.gv = VecArg{};
  r.h0 = transposed(p.h0), r.hT = transposed(p.hT);
  r.dht = transposed(p.dht), r.dh0 = transposed(p.dh0);
  r.o = r.dq = r.dk = r.dv = r.dg = r.dgv = r.o_softmax_acc = r.dq_softmax_w = VecArg{};
  r.dk_adds = r.dv_adds = r.dg_adds = r.dgv_adds = r.o_softmax = false;
  return r;
}

// P' for the forward: P''s dq is P's o (grad_qk's dq-only form), with o's softmax.
inline ChunkPass value_side_forward_as_key_side(const ChunkPass& p) {
  ChunkPass f = value_side_as_key_side(p);
  f.dq = p.o, f.dq_acc = p.o_acc;
  f.o_softmax = p.o_softmax, f.o_softmax_acc = p.o_softmax_acc;
  return f;
}

// P' with the backward's outputs of P: P''s out kernels write P's dk (as dv) and dq (as o),
// its grad_qk kernel P's dv (as dk) and dgv (as dg); P''s dq (P's o) stays off.
inline ChunkPass value_side_grads_as_key_side(const ChunkPass& p) {
  ChunkPass b = value_side_as_key_side(p);
  b.dv = p.dk, b.o = p.dq, b.o_acc = p.dq_acc, b.dk = p.dv, b.dg = p.dgv;
  b.dv_adds = p.dk_adds, b.dk_adds = p.dv_adds, b.dg_adds = p.dgv_adds;
  return b;
}

// Whether the CUDA engine takes a softmax over rows of D entries (ChunkPass::o_softmax, D = V;
// dq_softmax_w, D = K): one CTA then holds whole rows.
FLA_HD constexpr bool chunk_softmax_on_cuda(int D) { return D <= kChunkTile; }

// Whether the CUDA key-side forward forms o inside its sequential state kernel (its state
// fragments for all of K fit in registers), so that it needs no hst workspace.
FLA_HD constexpr bool chunk_fused_out(int K) { return K <= 2 * kChunkTile; }

// Windows of the chunk index for the CUDA state kernel's walks (kernels/chunk_state.cuh):
// where the (sequence, head, V tile) walks are few (at most kWindowMaxWalks, far below the SMs of
// the GPUs this targets) and the sequences long, each walk is cut into windows of at least
// kWindowMinChunks chunks, about kWindowCtas CTAs in all; else 0. With cu_seqlens (`varlen`, T
// the rows of all N sequences) the windows are sized for the mean length (the launch runs
// chunk_window_count of them).
constexpr int kWindowMaxWalks = 64, kWindowMinChunks = 8, kWindowCtas = 256;
FLA_HD constexpr int chunk_window_chunks(int N, int H, int V, int T, bool varlen = false) {
  const int64_t walks = int64_t(N) * H * ((V + kChunkTile - 1) / kChunkTile);
  if (walks <= 0 || walks > kWindowMaxWalks) return 0;
  const int64_t rows = varlen ? (int64_t(T) + N - 1) / N : int64_t(T);
  const int64_t nch = (rows + kChunk - 1) / kChunk;
  const int64_t windows = (kWindowCtas + walks - 1) / walks, per = (nch + windows - 1) / windows;
  const int64_t chunks = per < kWindowMinChunks ? kWindowMinChunks : per;
  return chunks < nch ? int(chunks) : 0;
}
// The windows a launch runs per walk: enough for ceil(T / C) chunks (with cu_seqlens, for the
// longest sequence there could be; the windows past a sequence's end return at once).
FLA_HD constexpr int64_t chunk_window_count(int T, int window_chunks) {
  if (window_chunks <= 0) return 0;
  const int64_t nch = (int64_t(T) + kChunk - 1) / kChunk;
  return (nch + window_chunks - 1) / window_chunks;
}
// The window_flags of such a pass: a flag per window and CTA of a walk (K x V tiles bound the CTAs
// of every form, the value-side pass's transposed one included).
FLA_HD constexpr int64_t chunk_window_flags(int N, int H, int K, int V, int T, int window_chunks) {
  return chunk_window_count(T, window_chunks) * N * H * ((K + kChunkTile - 1) / kChunkTile) *
         ((V + kChunkTile - 1) / kChunkTile);
}
// The window_states of such a pass: a state a window and (sequence, head), of the walk's K x V.
FLA_HD constexpr int64_t chunk_window_states(int N, int H, int K, int V, int T, int window_chunks) {
  return chunk_window_count(T, window_chunks) * N * H * int64_t(K) * V;
}

// Slots in the workspaces for a batch of T rows (T = total rows with cu_seqlens), for chunks of
// C rows (the RWKV7 chunk engine, kernels/dplr_chunk.h, uses the same map with C = 16).
template <int C = kChunk>
FLA_HD int64_t chunk_slots(int N, int T, bool varlen) {
  const int64_t per = (int64_t(T) + C - 1) / C + 1;
  return varlen ? int64_t(T) / C + 2 * int64_t(N) + 1 : int64_t(N) * per;
}

// Slot of chunk c of sequence n (its final state: c = number of chunks). With cu_seqlens the
// offset floor(bos / C) + 2n is monotone and leaves room for ceil(len / C) + 1 slots. The bound
// needs only bos + len <= T and n < N, which seq_span's clamping guarantees for any cu_seqlens
// content: floor(bos / C) + ceil(len / C) <= ceil(T / C), so every slot is below chunk_slots.
// (Unchecked, non-monotone content may make two sequences share slots: wrong values, never an
// access outside the workspace; slot_sequence's callers skip a chunk index outside [0, nch).)
template <int C = kChunk>
FLA_HD int64_t chunk_slot(const int64_t* cu_seqlens, int n, int T, int64_t c) {
  if (cu_seqlens) return seq_boundary(cu_seqlens, n, T) / C + 2 * int64_t(n) + c;
  return int64_t(n) * ((int64_t(T) + C - 1) / C + 1) + c;
}

// The sequence that owns `slot` (its chunk index is slot - chunk_slot(n, 0); a final-state or
// gap slot gives an index >= the sequence's chunk count).
template <int C = kChunk>
FLA_HD int slot_sequence(const int64_t* cu_seqlens, int N, int T, int64_t slot) {
  if (!cu_seqlens) return int(slot / ((int64_t(T) + C - 1) / C + 1));
  int lo = 0, hi = N - 1;  // the last sequence whose first slot is <= slot
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (chunk_slot<C>(cu_seqlens, mid, T, 0) <= slot) lo = mid; else hi = mid - 1;
  }
  return lo;
}

void chunk_cpu(const ChunkPass& p);
// Returns nullptr on success, else the CUDA error string of the failed launch.
const char* chunk_cuda(const ChunkPass& p, void* stream);

}  // namespace fla
