// CPU backend of the recurrent sweep (kernels/recurrent.h): the same sweep the CUDA engine runs,
// one (sequence, head) per task, fp32 state (fp64 for fp64 inputs).
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "../kernels/recurrent.h"
#include "../kernels/sequence.h"
#include "elements.h"

namespace fla {
namespace {

using cpu::elem;
using cpu::put;

template <typename T, typename A>
struct Sweep {
  const RecurrentPass& p;

  A ld(const VecArg& v, int64_t b, int64_t t, int h, int d) const {
    return cpu::load<A, T>(v, b, t, h, d);
  }
  static A* at(const MatArg& m, int n, int h, int r, int c) { return elem<A>(m, n, h, r, c); }
  static A* vec(const void* p, int64_t i) { return const_cast<A*>(static_cast<const A*>(p)) + i; }
  A uval(const void* u, int64_t i) const { return cpu::load_param<A>(p.udtype, u, i); }

  // zeta[c] = sum_r S[r][c] * zdot[r][c] (Produce).
  void produce_zeta(const std::vector<A>& S, int n, int h) const {
    if (!p.zeta) return;
    for (int c = 0; c < p.Dc; ++c) {
      A z = 0;
      if (p.zdot.on())
        for (int r = 0; r < p.Dr; ++r) z += S[r * p.Dc + c] * *at(p.zdot, n, h, r, c);
      *vec(p.zeta, (int64_t(n) * p.H + h) * p.Dc + c) = z;
    }
  }

  void run(int n, int h) const {
    const int Dr = p.Dr, Dc = p.Dc;
    const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
    std::vector<A> S(size_t(Dr) * Dc, A(0)), q(Dr), a(Dr), lr(Dr), lcs(Dc), pc(Dc), acc(Dc, A(0)), du(Dc, A(0));
    if (p.h0.on())
      for (int r = 0; r < Dr; ++r)
        for (int c = 0; c < Dc; ++c) S[r * Dc + c] = *at(p.h0, n, h, r, c);
    if (p.gate == GateGrad::Consume && p.zeta)
      for (int c = 0; c < Dc; ++c) acc[c] = *vec(p.zeta, (int64_t(n) * p.H + h) * Dc + c);

    for (int64_t step = 0; step < s.len; ++step) {
      const int64_t t = s.bos + (p.reverse ? s.len - 1 - step : step);
      A bonus = 0;
      for (int r = 0; r < Dr; ++r) {
        q[r] = ld(p.q, s.b, t, h, r);
        a[r] = ld(p.a, s.b, t, h, r) * A(p.a_scale);
        lr[r] = p.row_decay.on() ? std::exp(ld(p.row_decay, s.b, t, h, r)) : A(1);
        if (p.x.on()) bonus += q[r] * ld(p.x, s.b, t, h, r) * (p.ux ? uval(p.ux, h * Dr + r) : A(1));
      }
      auto read = [&] {
        for (int c = 0; c < Dc; ++c) {
          A sum = 0;
          for (int r = 0; r < Dr; ++r) sum += q[r] * S[r * Dc + c];
          pc[c] = sum * A(p.scale);
        }
      };
      // One pass over the columns applies the write and, unless it comes last, the decay.
      const bool decay_last = p.order == Order::DecayLast || p.order == Order::ReadWriteDecay;
      const bool mid = p.order == Order::DecayReadWrite, last = step == s.len - 1;
      if (p.order == Order::ReadFirst || p.order == Order::ReadWriteDecay) read();
      for (int c = 0; c < Dc; ++c) {
        lcs[c] = p.col_decay.on() ? std::exp(ld(p.col_decay, s.b, t, h, c)) : A(1);
        if (mid)
          for (int r = 0; r < Dr; ++r) S[r * Dc + c] *= lr[r] * lcs[c];
      }
      if (mid) {
        read();
        if (last && p.gate == GateGrad::Produce) produce_zeta(S, n, h);
      }
      for (int c = 0; c < Dc; ++c) {
        const A bc = ld(p.b, s.b, t, h, c) * A(p.b_scale);
        for (int r = 0; r < Dr; ++r) {
          A& e = S[r * Dc + c];
          e = (decay_last || mid ? A(1) : lr[r] * lcs[c]) * e + a[r] * bc;
        }
      }
      if (p.order == Order::ReadLast || p.order == Order::DecayLast) read();
      if (decay_last)
        for (int r = 0; r < Dr; ++r)
          for (int c = 0; c < Dc; ++c) S[r * Dc + c] *= lr[r] * lcs[c];
      for (int c = 0; c < Dc; ++c) {
        A o = pc[c];
        A yb = 0;
        if (p.x.on()) {
          yb = A(p.bonus_scale) * bonus * ld(p.y, s.b, t, h, c);
          o += yb * (p.uy ? uval(p.uy, h * Dc + c) : A(1));
        }
        if (p.out.on()) put<T>(p.out, p.out_acc, s.b, t, h, c, o);
        if (p.gate == GateGrad::Produce) {
          *elem<A>(p.ws, s.b, t, h, c) = ld(p.z, s.b, t, h, c) * pc[c];
        } else if (p.gate == GateGrad::Consume) {
          const A z = ld(p.z, s.b, t, h, c), ws = *elem<A>(p.ws, s.b, t, h, c);
          if (p.ws_inclusive) acc[c] += ws;
          if (step > 0 || p.order != Order::ReadWriteDecay) acc[c] -= z * pc[c];
          if (lcs[c] == A(0)) acc[c] = 0;
          *elem<T>(p.dlam, s.b, t, h, c) = static_cast<T>(acc[c]);
          if (!p.ws_inclusive) acc[c] += ws;
          du[c] += yb * z;
        }
      }
    }
    if (p.hT.on())
      for (int r = 0; r < Dr; ++r)
        for (int c = 0; c < Dc; ++c) *at(p.hT, n, h, r, c) = S[r * Dc + c];
    if (p.gate == GateGrad::Produce && (p.order != Order::DecayReadWrite || s.len == 0))
      produce_zeta(S, n, h);
    if (p.gate == GateGrad::Consume && p.du)
      for (int c = 0; c < Dc; ++c) *vec(p.du, (int64_t(n) * p.H + h) * Dc + c) = du[c];
  }
};

template <typename T, typename A>
void run_all(const RecurrentPass& p) {
  const Sweep<T, A> sweep{p};
  at::parallel_for(0, int64_t(p.N) * p.H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) sweep.run(int(i / p.H), int(i % p.H));
  });
}

}  // namespace

void recurrent_cpu(const RecurrentPass& p) {
  cpu::dispatch_dtype(p.dtype, [&](auto t, auto a) { run_all<decltype(t), decltype(a)>(p); });
}

}  // namespace fla
