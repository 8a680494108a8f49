// Torch-free description of one sweep of the diagonal-gate recurrence.
//
// A sweep runs, per (sequence n, head h), over time (forward or reversed) with an fp32 state
// S [Dr x Dc] ("rows" are the contraction axis of the read):
//   ReadFirst: p_t = S^T q_t, then S = decay(S) + a_t b_t^T         (RWKV6: exclusive read)
//   ReadLast:  S = decay(S) + a_t b_t^T, then p_t = S^T q_t         (GLA: inclusive read)
//   DecayLast: S = S + a_t b_t^T, p_t = S^T q_t, then S = decay(S)  (GLA backward, reversed)
//   out_t[c] = scale * p_t[c] + bonus_scale * (sum_i q_t[i] x_t[i] ux[i]) * y_t[c] * uy[c]
// where decay(S) = diag(exp(row_decay_t)) S diag(exp(col_decay_t)); either side may be off.
// Every forward and backward sweep of RWKV6/GLA (key- and value-side decays, alone or together)
// and both GSA passes is one such sweep with some operands transposed, which is expressed purely
// by strides: one engine, many views.
#pragma once
#include <cstdint>

#include "sequence.h"     // FLA_HD
#include "tensor_args.h"  // DType, VecArg, MatArg

namespace fla {

// When a step reads the state relative to its decay and its write. The last two read the state
// without the step's own write (a bonus x, y with u = 1 adds that term to `out`): the exact
// decay-gradient sweeps (docs/algorithms.md §3) use them so that no O(1) self term enters ws / acc,
// where it would cancel to a rounding residue larger than the true gradient once every decay is
// strong. DecayReadWrite's zeta is taken before the last write; ReadWriteDecay's Consume leaves
// the first step's read (of h0 = dHT) out of acc. The two omitted terms are equal: they cancel.
enum class Order : int { ReadFirst = 0, ReadLast = 1, DecayLast = 2, DecayReadWrite = 3,
                         ReadWriteDecay = 4 };

// What the sweep does besides `out`, for the decay gradient (docs/algorithms.md §5.3 closed form):
//   Produce: ws_t = z_t * scale * p_t (fp32), and zeta[c] = sum_r S_final[r][c] * zdot[r][c].
//   Consume: dlambda_t = acc after acc -= z_t * scale * p_t, then acc += ws_t, acc starting at
//            zeta (ws_inclusive: acc += ws_t comes first); also du[c] += bonus_scale * s_t * y_t[c] * z_t[c].
//            lambda is the column decay (any row decay rides along: it commutes).
//            Since dlambda_t is exactly exp(lambda_t) times a finite sum (its BPTT form, e.g. GLA's
//            exp(g_t) * rowsum(dh_t * h_{t-1})), acc is reset to 0 where exp(lambda_t) == 0:
//            exact, and it drops the rounding carried so far.
enum class GateGrad : int { None = 0, Produce = 1, Consume = 2 };

struct RecurrentPass {
  DType dtype = DType::f32;  // of every VecArg except ws
  int N = 0, H = 0, T = 0, Dr = 0, Dc = 0;
  const int64_t* cu_seqlens = nullptr;  // [N+1] on the sweep's device, or null
  bool reverse = false, ws_inclusive = false;
  Order order = Order::ReadFirst;
  double scale = 1, a_scale = 1, b_scale = 1, bonus_scale = 0;

  VecArg q, a, b;         // q, a: Dr; b: Dc
  VecArg row_decay;       // Dr log decay on the rows (off: none)
  VecArg col_decay;       // Dc log decay on the columns (off: none)
  VecArg x, y;            // bonus operands (x: Dr, y: Dc); off when x.ptr is null
  const void* ux = nullptr;  // [H, Dr] contiguous, or null (= 1)
  const void* uy = nullptr;  // [H, Dc] contiguous, or null (= 1)
  DType udtype = DType::f32;  // of ux / uy (read as is: no conversion launch per call)
  VecArg out;                 // Dc, written (same dtype, or the acc type with out_acc); may be off
  bool out_acc = false;

  MatArg h0;  // initial state (read), zero when off
  MatArg hT;  // final state (written) when on

  GateGrad gate = GateGrad::None;
  VecArg z;       // Dc, input dtype
  VecArg ws;      // Dc, acc; written by Produce, read by Consume
  MatArg zdot;    // Produce: matrix dotted with the final state
  void* zeta = nullptr;   // [N, H, Dc] acc: written by Produce, read by Consume (null = 0)
  VecArg dlam;    // Consume: Dc, written (input dtype)
  void* du = nullptr;     // Consume: [N, H, Dc] acc partials, written when non-null
};

// Backends. Each runs the sweep on the stream/threads of the caller's device.
void recurrent_cpu(const RecurrentPass& p);
// Returns nullptr on success, else the CUDA error string of the launch.
const char* recurrent_cuda(const RecurrentPass& p, void* stream);

}  // namespace fla
