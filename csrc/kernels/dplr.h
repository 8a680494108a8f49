// Torch-free description of the DPLR (RWKV7) recurrence, forward and backward (docs/algorithms.md §6,
// §8.1), per (sequence n, head h):
//   h_t = diag(exp(w_t)) h_{t-1} + b_t (a_t^T h_{t-1}) + k_t v_t^T,   o_t = scale * h_t^T r_t.
// The state h is K x V (fp32; fp64 for fp64 inputs). Its columns evolve independently (a_t^T h
// reduces over K per column), so both backends split V into tiles of kDplrTileCols columns and
// run each (n, h, tile) on its own.
//
// Backward (reverse-mode of the loop above; D = dL/dh_t, starting at dh_T):
//   D += scale r_t dO_t^T;  dr_t = scale h_t dO_t;  dk_t = D v_t;  dv_t = D^T k_t
//   c = h_{t-1}^T a_t, e = D^T b_t;  db_t = D c;  da_t = h_{t-1} e
//   dw_t = exp(w_t) * rowsum(D * h_{t-1})       (exactly 0 where exp(w_t) == 0)
//   D = diag(exp(w_t)) D + a_t e^T;             after t = 0, D = dh0.
// The sweep needs h_{t-1} in reverse order. The transition is not inverted (it can be singular):
// a forward sweep stores the state every kDplrSeg steps (checkpoints), then each segment is
// recomputed forward from its checkpoint into a scratch of kDplrSeg states and swept backward.
// dr, dw, dk, da, db reduce over columns, so each tile writes its partial sums (acc type) and the
// op layer adds the tiles.
#pragma once
#include <cstdint>

#include "tensor_args.h"  // DType, VecArg, MatArg
#include "sequence.h"

namespace fla {

constexpr int kDplrSeg = 16;       // steps between checkpoints = states in a segment's scratch
constexpr int kDplrTileCols = 32;  // state columns per backward tile

// Checkpoint slots per batch row: sequence n's checkpoint j lives in slot
// bos / kDplrSeg + (varlen ? n : 0) + j; slots of different sequences never collide because
// floor(bos/S) + ceil(len/S) <= floor((bos+len)/S) + 1.
FLA_HD int64_t dplr_slots(int64_t T, int64_t N, bool varlen) { return T / kDplrSeg + (varlen ? N : 1); }
FLA_HD int64_t dplr_slot(const SeqSpan& s, int n, bool varlen, int64_t j) {
  return s.bos / kDplrSeg + (varlen ? n : 0) + j;
}
FLA_HD int dplr_tiles(int V) { return (V + kDplrTileCols - 1) / kDplrTileCols; }

// The K-vector gradients, in the order of DplrPass::kg.
enum DplrKGrad : int { kGradR = 0, kGradW = 1, kGradK = 2, kGradA = 3, kGradB = 4, kNumKGrads = 5 };

// What both RWKV7 engines (this sequential one and the chunked one, dplr_chunk.h) read and write.
struct DplrArgs {
  DType dtype = DType::f32;  // of every VecArg except kg
  int N = 0, H = 0, T = 0, K = 0, V = 0;
  const int64_t* cu_seqlens = nullptr;  // [N+1] on the pass's device, or null
  double scale = 1;

  VecArg r, w, k, v, a, b;  // inputs: r, w, k, a, b have K entries, v has V
  MatArg h0;                // initial state (read), zero when off

  // Forward: o (V entries, written) and the final state (written when on).
  VecArg o;
  MatArg hT;

  // Backward (when dout is on): inputs dO and dh_T (zero when off); outputs dv (input dtype),
  // dh0 (when on) and the K-vector partials: grad g of column tile p at kg with ptr offset
  // (p / kg_pair) * kg_tile + g * kg_grad (acc type). kg_pair = 1: one slab per tile, written.
  // kg_pair = 2 (the CUDA chunk engine only): tiles 2b and 2b + 1 add into slab b, which the
  // caller zero-fills; two terms added onto 0 give the same sum in either order, so the result
  // does not depend on which tile's CTA runs first, and the slabs take half the memory.
  VecArg dout;
  MatArg dht, dh0;
  VecArg dv;
  // kg_pair = 0 (the CUDA chunk engine, V in one tile): no partial sums; grad g goes straight to
  // kgd[g], in the input dtype (kg unused).
  VecArg kg;
  int64_t kg_tile = 0, kg_grad = 0;
  int kg_pair = 1;
  VecArg kgd[kNumKGrads];

  FLA_HD bool backward() const { return dout.on(); }
};

struct DplrPass : DplrArgs {
  bool reverse = false;
  // Workspaces (acc type, contiguous): checkpoints [B, slots, H, K, V] with
  // slots = dplr_slots(T, N, cu_seqlens != null), and the segment scratch [N, H, kDplrSeg, K, V].
  void* chk = nullptr;
  void* seg = nullptr;
};

// Backends: forward when !p.backward(), else backward. The CPU runs on at::parallel_for's
// threads; CUDA on `stream`, returning nullptr or the launch's error string.
void dplr_cpu(const DplrPass& p);
const char* dplr_cuda(const DplrPass& p, void* stream);

}  // namespace fla
