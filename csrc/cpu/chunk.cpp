// CPU backend of the chunk engine (kernels/chunk.h): the chunked algorithm of ALGORITHMS.md
// §4.1/§4.2 (GLA) and §5.1/§5.2 (RWKV6) as written, one (sequence, head) per task. It is what
// the CUDA kernels are compared with, so it favours exactness over speed: all chunk math runs in
// double and every decay exponent is a running sum of log decays <= 0 (§2.6: partial sums are
// only ever added, never subtracted, so lambda = -inf and mixed -1e4/-0.05 gates are exact).
// Only the chunk-start states kept in the workspace (hst) for the backward take the acc type.
// fla_ext/chunk_reference.py is the same algebra in PyTorch.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "../kernels/chunk.h"
#include "../kernels/sequence.h"
#include "elements.h"

namespace fla {
namespace {

using cpu::elem;
using Vec = std::vector<double>;

// One chunk of one (sequence, head): its rows ([L, K] or [L, V], row-major) and the decay
// factors measured from the chunk boundaries: exp(G_i) (inclusive reader) or exp(E_i)
// (exclusive reader) from the chunk start, exp(Omega_j) from a key to the chunk end, and
// gamma = exp(Gamma) across the chunk.
struct Chunk {
  int L = 0;
  Vec q, k, v, lam, dout;
  Vec eread, eomega, gamma;
};

template <typename T, typename Acc>
struct Engine {
  const ChunkPass& p;
  int K = p.K, V = p.V;
  bool excl = p.reader == Reader::Exclusive;

  int64_t chunks(const SeqSpan& s) const { return (s.len + kChunk - 1) / kChunk; }
  int64_t slot(int n, int64_t c) const { return chunk_slot(p.cu_seqlens, n, p.T, c); }
  Acc* state_at(void* ws, int64_t slot, int h) const {
    return static_cast<Acc*>(ws) + (slot * p.H + h) * int64_t(K) * V;
  }
  void save_state(void* ws, int64_t slot, int h, const Vec& S) const {
    if (!ws) return;
    Acc* dst = state_at(ws, slot, h);
    for (size_t i = 0; i < S.size(); ++i) dst[i] = static_cast<Acc>(S[i]);
  }
  Vec load_state(const MatArg& m, int n, int h) const {  // zero when off
    Vec S(size_t(K) * V, 0.0);
    if (m.on())
      for (int d = 0; d < K; ++d)
        for (int x = 0; x < V; ++x) S[d * V + x] = *elem<Acc>(m, n, h, d, x);
    return S;
  }
  void store_state(const MatArg& m, int n, int h, const Vec& S) const {
    if (!m.on()) return;
    for (int d = 0; d < K; ++d)
      for (int x = 0; x < V; ++x) *elem<Acc>(m, n, h, d, x) = static_cast<Acc>(S[d * V + x]);
  }
  // The bonus row of head h (zero for the inclusive reader, which has none).
  Vec bonus_u(int h) const {
    Vec u(K, 0.0);
    if (p.u)
      for (int d = 0; d < K; ++d) u[d] = cpu::load_param<double>(p.udtype, p.u, int64_t(h) * K + d);
    return u;
  }
  // exp(lambda) == 0 in the acc type: there the true decay gradient is exactly 0 (§3).
  static bool hard(double lam) { return std::exp(static_cast<Acc>(lam)) == Acc(0); }

  void load(const SeqSpan& s, int h, int64_t t0, bool with_dout, Chunk& c) const {
    const int L = c.L = int(std::min<int64_t>(kChunk, s.len - t0));
    c.q.resize(size_t(L) * K), c.k.resize(size_t(L) * K), c.lam.resize(size_t(L) * K);
    c.v.resize(size_t(L) * V), c.dout.resize(with_dout ? size_t(L) * V : 0);
    for (int i = 0; i < L; ++i) {
      const int64_t t = s.bos + t0 + i;
      for (int d = 0; d < K; ++d) {
        c.q[i * K + d] = cpu::load<double, T>(p.q, s.b, t, h, d);
        c.k[i * K + d] = cpu::load<double, T>(p.k, s.b, t, h, d);
        c.lam[i * K + d] = p.g.on() ? cpu::load<double, T>(p.g, s.b, t, h, d) : 0.0;
      }
      for (int x = 0; x < V; ++x) {
        c.v[i * V + x] = cpu::load<double, T>(p.v, s.b, t, h, x);
        if (with_dout) c.dout[i * V + x] = cpu::load<double, T>(p.dout, s.b, t, h, x);
      }
    }
    c.eread.resize(size_t(L) * K), c.eomega.resize(size_t(L) * K), c.gamma.resize(K);
    for (int d = 0; d < K; ++d) {
      double run = 0;  // sum of lambda over the rows before i
      for (int i = 0; i < L; ++i) {
        const double before = run;
        run += c.lam[i * K + d];
        c.eread[i * K + d] = std::exp(excl ? before : run);
      }
      c.gamma[d] = std::exp(run);
      run = 0;  // sum of lambda over the rows after j
      for (int j = L - 1; j >= 0; --j) {
        c.eomega[j * K + d] = std::exp(run);
        run += c.lam[j * K + d];
      }
    }
  }

  // Calls f(i, j, fac) for every decay-carrying pair (j <= i inclusive, j < i exclusive) with
  // fac[d] = exp(sum of lambda_s over j < s <= i, or j < s < i): the exponent grows by one
  // lambda per step of j downward, so it is a sum and never a difference.
  template <typename F>
  void for_pairs(const Chunk& c, F&& f) const {
    Vec e(K), fac(K);
    for (int i = 0; i < c.L; ++i) {
      std::fill(e.begin(), e.end(), 0.0);
      for (int j = excl ? i - 1 : i; j >= 0; --j) {
        for (int d = 0; d < K; ++d) fac[d] = std::exp(e[d]);
        f(i, j, fac.data());
        for (int d = 0; d < K; ++d) e[d] += c.lam[j * K + d];
      }
    }
  }

  // The pair matrix A [L, L] (§4.1/§5.1): decayed q_i.k_j below the diagonal, and on it the
  // decayed self term (GLA) or the undecayed bonus q_i.(u * k_i) (RWKV6). With `dA`, the same
  // pass accumulates the intra-chunk parts of dq' and dk' (§4.2).
  void pair_matrix(const Chunk& c, const Vec& u, Vec& A, const Vec* dA, Vec* dq, Vec* dk) const {
    const int L = c.L;
    A.assign(size_t(L) * L, 0.0);
    for_pairs(c, [&](int i, int j, const double* fac) {
      const double w = dA ? (*dA)[i * L + j] : 0.0;
      double a = 0;
      for (int d = 0; d < K; ++d) {
        const double kf = c.k[j * K + d] * fac[d];
        a += c.q[i * K + d] * kf;
        if (dA) {
          (*dq)[i * K + d] += w * kf;
          (*dk)[j * K + d] += w * c.q[i * K + d] * fac[d];
        }
      }
      A[i * L + j] = a;
    });
    if (excl)
      for (int i = 0; i < L; ++i) {
        double a = 0;
        for (int d = 0; d < K; ++d) a += c.q[i * K + d] * u[d] * c.k[i * K + d];
        A[i * L + i] = a;
      }
  }

  // S <- diag(gamma) S + (K * exp(Omega))^T V: the state across one chunk.
  void advance(const Chunk& c, Vec& S) const {
    for (int d = 0; d < K; ++d) {
      double* row = &S[size_t(d) * V];
      for (int x = 0; x < V; ++x) row[x] *= c.gamma[d];
      for (int j = 0; j < c.L; ++j) {
        const double kh = c.k[j * K + d] * c.eomega[j * K + d];
        for (int x = 0; x < V; ++x) row[x] += kh * c.v[j * V + x];
      }
    }
  }

  void forward(int n, int h) const {
    const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
    const Vec u = bonus_u(h);
    Vec S = load_state(p.h0, n, h), A, o(V);
    Chunk c;
    const int64_t nc = chunks(s);
    for (int64_t ci = 0; ci < nc; ++ci) {
      load(s, h, ci * kChunk, false, c);
      save_state(p.hst, slot(n, ci), h, S);
      pair_matrix(c, u, A, nullptr, nullptr, nullptr);
      const int L = c.L;
      for (int i = 0; i < L; ++i) {  // O = scale (Q^ S + A V)
        std::fill(o.begin(), o.end(), 0.0);
        for (int d = 0; d < K; ++d) {
          const double qh = c.q[i * K + d] * c.eread[i * K + d];
          for (int x = 0; x < V; ++x) o[x] += qh * S[d * V + x];
        }
        for (int j = 0; j <= i; ++j)
          for (int x = 0; x < V; ++x) o[x] += A[i * L + j] * c.v[j * V + x];
        const int64_t t = s.bos + ci * kChunk + i;
        for (int x = 0; x < V; ++x) *elem<T>(p.o, s.b, t, h, x) = static_cast<T>(p.scale * o[x]);
      }
      advance(c, S);
    }
    save_state(p.hst, slot(n, nc), h, S);
    store_state(p.hT, n, h, S);
  }

  void backward(int n, int h) const {
    const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
    const Vec u = bonus_u(h);
    const int64_t nc = chunks(s);
    Chunk c;
    // The chunk-start states Hst, recomputed (§4.2 "stored vs recomputed").
    Vec S = load_state(p.h0, n, h);
    for (int64_t ci = 0; ci < nc; ++ci) {
      load(s, h, ci * kChunk, false, c);
      save_state(p.hst, slot(n, ci), h, S);
      advance(c, S);
    }
    // Reverse pass: dS holds dHst[ci] (the gradient at the chunk's end) on entry.
    Vec dS = load_state(p.dht, n, h);
    Vec dA, A, dq, dk, dv, dg, dpart(K), zeta(K);
    for (int64_t ci = nc - 1; ci >= 0; --ci) {
      load(s, h, ci * kChunk, true, c);
      const int L = c.L;
      const Acc* st = state_at(p.hst, slot(n, ci), h);
      S.assign(st, st + size_t(K) * V);
      save_state(p.dhst, slot(n, ci), h, dS);

      dA.assign(size_t(L) * L, 0.0);  // scale tril(dO V^T), diagonal included
      for (int i = 0; i < L; ++i)
        for (int j = 0; j <= i; ++j) {
          double a = 0;
          for (int x = 0; x < V; ++x) a += c.dout[i * V + x] * c.v[j * V + x];
          dA[i * L + j] = p.scale * a;
        }
      dq.assign(size_t(L) * K, 0.0), dk.assign(size_t(L) * K, 0.0);
      pair_matrix(c, u, A, &dA, &dq, &dk);

      dv.assign(size_t(L) * V, 0.0);  // dV = scale A^T dO + K^ dS+
      for (int j = 0; j < L; ++j) {
        double* row = &dv[size_t(j) * V];
        for (int i = j; i < L; ++i)
          for (int x = 0; x < V; ++x) row[x] += p.scale * A[i * L + j] * c.dout[i * V + x];
        for (int d = 0; d < K; ++d) {
          const double kh = c.k[j * K + d] * c.eomega[j * K + d];
          for (int x = 0; x < V; ++x) row[x] += kh * dS[d * V + x];
        }
      }
      // Inter-chunk parts of dq' and dk', and zeta = rowsum(S+ * dS+) in its second form (§3).
      for (int d = 0; d < K; ++d) {
        double z = 0;
        for (int x = 0; x < V; ++x) z += S[d * V + x] * dS[d * V + x];
        zeta[d] = c.gamma[d] * z;
      }
      for (int i = 0; i < L; ++i)
        for (int d = 0; d < K; ++d) {
          double a = 0, b = 0;
          for (int x = 0; x < V; ++x) {
            a += c.dout[i * V + x] * S[d * V + x];
            b += c.v[i * V + x] * dS[d * V + x];
          }
          dq[i * K + d] += p.scale * a * c.eread[i * K + d];
          const double kpart = b * c.eomega[i * K + d];
          dk[i * K + d] += kpart;
          zeta[d] += c.k[i * K + d] * kpart;
        }
      // dlambda: reverse cumsum of q dq' (over t' > t for the exclusive reader) minus k dk'
      // (over t' >= t), plus zeta. Where exp(lambda_t) == 0 the true value is exactly 0, so the
      // running sum restarts there, dropping every rounding residue carried so far.
      dg.assign(size_t(L) * K, 0.0);
      for (int d = 0; d < K; ++d) {
        double acc = zeta[d];
        for (int t = L - 1; t >= 0; --t) {
          const double rq = c.q[t * K + d] * dq[t * K + d], rk = c.k[t * K + d] * dk[t * K + d];
          acc += (excl ? 0.0 : rq) - rk;
          if (hard(c.lam[t * K + d])) acc = 0;
          dg[t * K + d] = acc;
          if (excl) acc += rq;
        }
      }
      // The bonus carries no decay: its terms join dq, dk only after dlambda (§5.2).
      if (excl) {
        std::fill(dpart.begin(), dpart.end(), 0.0);
        for (int i = 0; i < L; ++i) {
          const double dii = dA[i * L + i];
          for (int d = 0; d < K; ++d) {
            dpart[d] += dii * c.q[i * K + d] * c.k[i * K + d];
            dq[i * K + d] += dii * u[d] * c.k[i * K + d];
            dk[i * K + d] += dii * u[d] * c.q[i * K + d];
          }
        }
        if (p.du) {
          Acc* du = static_cast<Acc*>(p.du) + (slot(n, ci) * p.H + h) * int64_t(K);
          for (int d = 0; d < K; ++d) du[d] = static_cast<Acc>(dpart[d]);
        }
      }
      for (int i = 0; i < L; ++i) {
        const int64_t t = s.bos + ci * kChunk + i;
        for (int d = 0; d < K; ++d) {
          if (p.dq.on()) *elem<T>(p.dq, s.b, t, h, d) = static_cast<T>(dq[i * K + d]);
          if (p.dk.on()) *elem<T>(p.dk, s.b, t, h, d) = static_cast<T>(dk[i * K + d]);
          if (p.dg.on()) *elem<T>(p.dg, s.b, t, h, d) = static_cast<T>(dg[i * K + d]);
        }
        if (p.dv.on())
          for (int x = 0; x < V; ++x) *elem<T>(p.dv, s.b, t, h, x) = static_cast<T>(dv[i * V + x]);
      }
      // dS of the previous chunk's end: diag(gamma) dS+ + scale Q^T dO.
      for (int d = 0; d < K; ++d) {
        double* row = &dS[size_t(d) * V];
        for (int x = 0; x < V; ++x) row[x] *= c.gamma[d];
        for (int i = 0; i < L; ++i) {
          const double qh = p.scale * c.q[i * K + d] * c.eread[i * K + d];
          for (int x = 0; x < V; ++x) row[x] += qh * c.dout[i * V + x];
        }
      }
    }
    store_state(p.dh0, n, h, dS);
  }
};

template <typename T, typename Acc>
void run_all(const ChunkPass& p) {
  const Engine<T, Acc> engine{p};
  const bool bwd = p.dout.on();
  if (bwd && !p.hst) throw std::invalid_argument("fla_ext: chunk_cpu: the backward needs `hst`");
  at::parallel_for(0, int64_t(p.N) * p.H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (bwd)
        engine.backward(int(i / p.H), int(i % p.H));
      else
        engine.forward(int(i / p.H), int(i % p.H));
    }
  });
}

}  // namespace

void chunk_cpu(const ChunkPass& p) {
  cpu::dispatch_dtype(p.dtype, [&](auto t, auto a) { run_all<decltype(t), decltype(a)>(p); });
}

}  // namespace fla
