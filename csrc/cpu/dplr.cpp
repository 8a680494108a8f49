// CPU backend of the DPLR recurrence (kernels/dplr.h): the loop the CUDA kernels run, one
// (sequence, head, column tile) per task, fp32 state (fp64 for fp64 inputs).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../kernels/dplr.h"
#include "elements.h"

namespace fla {
namespace {

template <typename T, typename A>
struct Dplr {
  const DplrPass& p;

  // One step's operands: K-vectors (decay already exponentiated) and the tile's columns.
  struct Step {
    std::vector<A> r, al, k, a, b, v, dout;
    Step(int K, int nc) : r(K), al(K), k(K), a(K), b(K), v(nc), dout(nc) {}
  };

  static A ld(const VecArg& x, int64_t b, int64_t t, int h, int d) {
    return cpu::load<A, T>(x, b, t, h, d);
  }
  template <typename U>
  static U& at(const VecArg& x, int64_t b, int64_t t, int h, int d) {
    return *cpu::elem<U>(x, b, t, h, d);
  }
  static A& at(const MatArg& m, int n, int h, int r, int c) { return *cpu::elem<A>(m, n, h, r, c); }

  int64_t time(const SeqSpan& s, int64_t step) const {
    return s.bos + (p.reverse ? s.len - 1 - step : step);
  }
  void load(Step& x, const SeqSpan& s, int64_t t, int h, int c0, int nc) const {
    for (int i = 0; i < p.K; ++i) {
      x.r[i] = ld(p.r, s.b, t, h, i), x.al[i] = std::exp(ld(p.w, s.b, t, h, i));
      x.k[i] = ld(p.k, s.b, t, h, i), x.a[i] = ld(p.a, s.b, t, h, i), x.b[i] = ld(p.b, s.b, t, h, i);
    }
    for (int c = 0; c < nc; ++c) {
      x.v[c] = ld(p.v, s.b, t, h, c0 + c);
      if (p.backward()) x.dout[c] = ld(p.dout, s.b, t, h, c0 + c);
    }
  }
  // S [K x nc] <- diag(al) S + b (a^T S) + k v^T.
  void advance(A* S, const Step& x, int nc, std::vector<A>& sa) const {
    const int K = p.K;
    std::fill(sa.begin(), sa.begin() + nc, A(0));
    for (int i = 0; i < K; ++i)
      for (int c = 0; c < nc; ++c) sa[c] += x.a[i] * S[i * nc + c];
    for (int i = 0; i < K; ++i)
      for (int c = 0; c < nc; ++c)
        S[i * nc + c] = x.al[i] * S[i * nc + c] + x.b[i] * sa[c] + x.k[i] * x.v[c];
  }
  void load_state(A* S, const MatArg& m, int n, int h, int c0, int nc) const {
    for (int i = 0; i < p.K; ++i)
      for (int c = 0; c < nc; ++c) S[i * nc + c] = m.on() ? at(m, n, h, i, c0 + c) : A(0);
  }
  void store_state(const A* S, const MatArg& m, int n, int h, int c0, int nc) const {
    if (m.on())
      for (int i = 0; i < p.K; ++i)
        for (int c = 0; c < nc; ++c) at(m, n, h, i, c0 + c) = S[i * nc + c];
  }
  // Checkpoint j / scratch state j of (n, h), columns [c0, c0 + nc): K rows of stride V.
  A* checkpoint(const SeqSpan& s, int n, int h, int64_t j, int c0) const {
    const int64_t slot = dplr_slot(s, n, p.cu_seqlens != nullptr, j);
    const int64_t slots = dplr_slots(p.T, p.N, p.cu_seqlens != nullptr);
    return static_cast<A*>(p.chk) + ((s.b * slots + slot) * p.H + h) * int64_t(p.K) * p.V + c0;
  }
  A* scratch(int n, int h, int j, int c0) const {
    return static_cast<A*>(p.seg) + ((int64_t(n) * p.H + h) * kDplrSeg + j) * int64_t(p.K) * p.V + c0;
  }
  void copy_out(const A* S, A* dst, int nc) const {  // tile [K x nc] -> rows of stride V
    for (int i = 0; i < p.K; ++i) std::copy(S + i * nc, S + (i + 1) * nc, dst + int64_t(i) * p.V);
  }
  void copy_in(A* S, const A* src, int nc) const {
    for (int i = 0; i < p.K; ++i) std::copy(src + int64_t(i) * p.V, src + int64_t(i) * p.V + nc, S + i * nc);
  }

  void forward(int n, int h, int c0, int nc) const {
    const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
    const int K = p.K;
    std::vector<A> S(size_t(K) * nc), sa(nc);
    Step x(K, nc);
    load_state(S.data(), p.h0, n, h, c0, nc);
    for (int64_t step = 0; step < s.len; ++step) {
      const int64_t t = time(s, step);
      load(x, s, t, h, c0, nc);
      advance(S.data(), x, nc, sa);
      for (int c = 0; c < nc; ++c) {
        A o = 0;
        for (int i = 0; i < K; ++i) o += x.r[i] * S[i * nc + c];
        at<T>(p.o, s.b, t, h, c0 + c) = static_cast<T>(A(p.scale) * o);
      }
    }
    store_state(S.data(), p.hT, n, h, c0, nc);
  }

  void backward(int n, int h, int tile, int c0, int nc) const {
    const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
    const int K = p.K;
    const A scale = A(p.scale);
    std::vector<A> S(size_t(K) * nc), D(size_t(K) * nc), hp(size_t(K) * nc), sa(nc), e(nc);
    Step x(K, nc);
    load_state(S.data(), p.h0, n, h, c0, nc);
    for (int64_t step = 0; step < s.len; ++step) {
      if (step % kDplrSeg == 0) copy_out(S.data(), checkpoint(s, n, h, step / kDplrSeg, c0), nc);
      load(x, s, time(s, step), h, c0, nc);
      advance(S.data(), x, nc, sa);
    }
    load_state(D.data(), p.dht, n, h, c0, nc);
    A* kg[kNumKGrads];
    for (int64_t j = (s.len + kDplrSeg - 1) / kDplrSeg - 1; j >= 0; --j) {
      const int64_t s0 = j * kDplrSeg, s1 = std::min<int64_t>(s.len, s0 + kDplrSeg);
      copy_in(S.data(), checkpoint(s, n, h, j, c0), nc);
      for (int64_t step = s0; step < s1; ++step) {
        copy_out(S.data(), scratch(n, h, int(step - s0), c0), nc);
        load(x, s, time(s, step), h, c0, nc);
        advance(S.data(), x, nc, sa);
      }
      for (int64_t step = s1 - 1; step >= s0; --step) {  // S = h_t
        const int64_t t = time(s, step);
        load(x, s, t, h, c0, nc);
        copy_in(hp.data(), scratch(n, h, int(step - s0), c0), nc);
        for (int g = 0; g < kNumKGrads; ++g)
          kg[g] = &at<A>(p.kg, s.b, t, h, 0) + tile * p.kg_tile + g * p.kg_grad;
        std::fill(sa.begin(), sa.end(), A(0)), std::fill(e.begin(), e.end(), A(0));
        for (int i = 0; i < K; ++i)
          for (int c = 0; c < nc; ++c) {
            A& d = D[i * nc + c];
            d += scale * x.r[i] * x.dout[c];
            sa[c] += x.a[i] * hp[i * nc + c];  // c = h_{t-1}^T a_t
            e[c] += x.b[i] * d;                // e = D^T b_t
          }
        for (int c = 0; c < nc; ++c) {
          A dv = 0;
          for (int i = 0; i < K; ++i) dv += D[i * nc + c] * x.k[i];
          at<T>(p.dv, s.b, t, h, c0 + c) = static_cast<T>(dv);
        }
        for (int i = 0; i < K; ++i) {
          A dr = 0, dk = 0, db = 0, da = 0, dw = 0;
          for (int c = 0; c < nc; ++c) {
            const A d = D[i * nc + c], hpv = hp[i * nc + c];
            dr += S[i * nc + c] * x.dout[c], dk += d * x.v[c], db += d * sa[c];
            da += hpv * e[c], dw += d * hpv;
          }
          const int64_t o = int64_t(i) * p.kg.sd;
          kg[kGradR][o] = scale * dr, kg[kGradK][o] = dk, kg[kGradB][o] = db;
          kg[kGradA][o] = da, kg[kGradW][o] = x.al[i] * dw;  // exactly 0 where exp(w) == 0
        }
        for (int i = 0; i < K; ++i)
          for (int c = 0; c < nc; ++c) D[i * nc + c] = x.al[i] * D[i * nc + c] + x.a[i] * e[c];
        std::swap(S, hp);
      }
    }
    store_state(D.data(), p.dh0, n, h, c0, nc);
  }
};

template <typename T, typename A>
void run_all(const DplrPass& p) {
  const Dplr<T, A> d{p};
  const int tiles = dplr_tiles(p.V);
  at::parallel_for(0, int64_t(p.N) * p.H * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int tile = int(i % tiles), nh = int(i / tiles);
      const int c0 = tile * kDplrTileCols, nc = std::min(kDplrTileCols, p.V - c0);
      if (p.backward())
        d.backward(nh / p.H, nh % p.H, tile, c0, nc);
      else
        d.forward(nh / p.H, nh % p.H, c0, nc);
    }
  });
}

}  // namespace

void dplr_cpu(const DplrPass& p) {
  cpu::dispatch_dtype(p.dtype, [&](auto t, auto a) { run_all<decltype(t), decltype(a)>(p); });
}

}  // namespace fla
