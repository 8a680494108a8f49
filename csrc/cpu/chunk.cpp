// CPU backend of the chunk engine (kernels/chunk.h): the chunked algorithm of docs/algorithms.md
// §4.1/§4.2 (GLA), §5.1/§5.2 (RWKV6) and §7.1/§7.2 (value-side decay) as written, one
// (sequence, head) per task. Key-side (g) and value-side (gv) decays may be on together: the
// pair terms then carry a key factor inside the score a_ij and a value factor per column. It is what
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
using cpu::put;
using Vec = std::vector<double>;

// One chunk of one (sequence, head): its rows ([L, K] or [L, V], row-major) and the decay
// factors measured from the chunk boundaries: exp(G_i) (inclusive reader) or exp(E_i)
// (exclusive reader) from the chunk start, exp(Omega_j) from a key to the chunk end, and
// gamma = exp(Gamma) across the chunk.
struct Chunk {
  int L = 0;
  Vec q, k, v, lam, dout;
  Vec eread, eomega, gamma;
  Vec lamv, ereadv, eomegav, gammav;  // the value-side decay over V (ones when gv is off)
};

template <typename T, typename Acc>
struct Engine {
  const ChunkPass& p;
  int K = p.K, V = p.V;
  bool excl = p.reader == Reader::Exclusive;
  bool vd = p.gv.on();  // value-side decay

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
  // A gradient element, written or (ChunkPass dk_adds, ..) added to what the tensor holds.
  void store_grad(const VecArg& a, bool adds, int64_t b, int64_t t, int h, int d, double x) const {
    T* e = elem<T>(a, b, t, h, d);
    *e = static_cast<T>(adds ? x + static_cast<double>(*e) : x);
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
    c.lamv.resize(size_t(L) * V);
    for (int i = 0; i < L; ++i) {
      const int64_t t = s.bos + t0 + i;
      for (int d = 0; d < K; ++d) {
        c.q[i * K + d] = cpu::load<double, T>(p.q, s.b, t, h, d);
        c.k[i * K + d] = cpu::load<double, T>(p.k, s.b, t, h, d);
        c.lam[i * K + d] = p.g.on() ? cpu::load<double, T>(p.g, s.b, t, h, d) : 0.0;
      }
      for (int x = 0; x < V; ++x) {
        c.v[i * V + x] = cpu::load<double, T>(p.v, s.b, t, h, x);
        c.lamv[i * V + x] = vd ? cpu::load<double, T>(p.gv, s.b, t, h, x) : 0.0;
        if (with_dout) c.dout[i * V + x] = cpu::load<double, T>(p.dout, s.b, t, h, x);
      }
    }
    boundary_factors(c.lam, L, K, excl, c.eread, c.eomega, c.gamma);
    boundary_factors(c.lamv, L, V, false, c.ereadv, c.eomegav, c.gammav);
  }

  // Per channel of a [L, D] log decay: exp of the reader sum from the chunk start (inclusive or
  // exclusive), of the sum from a row to the chunk end (Omega), and of the chunk total.
  static void boundary_factors(const Vec& lam, int L, int D, bool exclusive, Vec& eread,
                               Vec& eomega, Vec& gamma) {
    eread.resize(size_t(L) * D), eomega.resize(size_t(L) * D), gamma.resize(D);
    for (int d = 0; d < D; ++d) {
      double run = 0;  // sum of lambda over the rows before i
      for (int i = 0; i < L; ++i) {
        const double before = run;
        run += lam[i * D + d];
        eread[i * D + d] = std::exp(exclusive ? before : run);
      }
      gamma[d] = std::exp(run);
      run = 0;  // sum of lambda over the rows after j
      for (int j = L - 1; j >= 0; --j) {
        eomega[j * D + d] = std::exp(run);
        run += lam[j * D + d];
      }
    }
  }

  // Calls f(i, j, fac, facv) for every decay-carrying pair (j <= i inclusive, j < i exclusive)
  // with fac[d] = exp(sum of lambda_s over j < s <= i, or j < s < i) and facv[x] the same over
  // the value-side decay (1 when gv is off): the exponents grow by one lambda per step of j
  // downward, so they are sums and never differences.
  template <typename F>
  void for_pairs(const Chunk& c, F&& f) const {
    Vec e(K), fac(K), ev(V), facv(V, 1.0);
    for (int i = 0; i < c.L; ++i) {
      std::fill(e.begin(), e.end(), 0.0), std::fill(ev.begin(), ev.end(), 0.0);
      for (int j = excl ? i - 1 : i; j >= 0; --j) {
        for (int d = 0; d < K; ++d) fac[d] = std::exp(e[d]);
        if (vd)
          for (int x = 0; x < V; ++x) facv[x] = std::exp(ev[x]);
        f(i, j, fac.data(), facv.data());
        for (int d = 0; d < K; ++d) e[d] += c.lam[j * K + d];
        if (vd)
          for (int x = 0; x < V; ++x) ev[x] += c.lamv[j * V + x];
      }
    }
  }

  // The intra-chunk pair terms (§4.1/§4.2, §7.1/§7.2). Per pair, the key-decayed score
  // a_ij = q_i.(k_j * fac) (A [L, L]; on the diagonal of RWKV6 the undecayed bonus q_i.(u * k_i))
  // weighs v_j * facv into io_i (the intra part of o / scale). With dO (`bwd`), also
  // dA_ij = scale dO_i.(v_j * facv) (tril, diagonal included), the intra parts of dq' and dk'
  // (dA_ij k_j * fac, dA_ij q_i * fac) and of dv (scale a_ij dO_i * facv).
  struct Intra {
    Vec A, io, dA, dq, dk, dv;
  };
  void intra(const Chunk& c, const Vec& u, bool bwd, Intra& r) const {
    const int L = c.L;
    r.A.assign(size_t(L) * L, 0.0), r.io.assign(size_t(L) * V, 0.0);
    if (bwd) {
      r.dA.assign(size_t(L) * L, 0.0), r.dq.assign(size_t(L) * K, 0.0);
      r.dk.assign(size_t(L) * K, 0.0), r.dv.assign(size_t(L) * V, 0.0);
    }
    auto values = [&](int i, int j, double a, const double* facv) {
      double w = 0;
      for (int x = 0; x < V; ++x) {
        r.io[i * V + x] += a * c.v[j * V + x] * facv[x];
        if (bwd) {
          w += c.dout[i * V + x] * c.v[j * V + x] * facv[x];
          r.dv[j * V + x] += p.scale * a * c.dout[i * V + x] * facv[x];
        }
      }
      if (bwd) r.dA[i * L + j] = p.scale * w;
      return p.scale * w;
    };
    for_pairs(c, [&](int i, int j, const double* fac, const double* facv) {
      double a = 0;
      for (int d = 0; d < K; ++d) a += c.q[i * K + d] * c.k[j * K + d] * fac[d];
      r.A[i * L + j] = a;
      const double w = values(i, j, a, facv);
      if (bwd)
        for (int d = 0; d < K; ++d) {
          r.dq[i * K + d] += w * c.k[j * K + d] * fac[d];
          r.dk[j * K + d] += w * c.q[i * K + d] * fac[d];
        }
    });
    if (excl) {  // the bonus diagonal (no value-side decay with this reader)
      const Vec ones(V, 1.0);
      for (int i = 0; i < L; ++i) {
        double a = 0;
        for (int d = 0; d < K; ++d) a += c.q[i * K + d] * u[d] * c.k[i * K + d];
        r.A[i * L + i] = a;
        values(i, i, a, ones.data());
      }
    }
  }

  // S <- diag(gamma) S diag(gammav) + (K * exp(Omega))^T (V * exp(Omegav)): one chunk.
  void advance(const Chunk& c, Vec& S) const {
    for (int d = 0; d < K; ++d) {
      double* row = &S[size_t(d) * V];
      for (int x = 0; x < V; ++x) row[x] *= c.gamma[d] * c.gammav[x];
      for (int j = 0; j < c.L; ++j) {
        const double kh = c.k[j * K + d] * c.eomega[j * K + d];
        for (int x = 0; x < V; ++x) row[x] += kh * c.v[j * V + x] * c.eomegav[j * V + x];
      }
    }
  }

  // o = scale (expv(G) * (Q^ S) + io): the inter part leaves the state decayed to row i on
  // both sides (the key side inside Q^, the value side per column).
  void outputs(const Chunk& c, const Vec& S, const Vec& io, Vec& o) const {
    o.assign(size_t(c.L) * V, 0.0);
    for (int i = 0; i < c.L; ++i) {
      double* row = &o[size_t(i) * V];
      for (int d = 0; d < K; ++d) {
        const double qh = c.q[i * K + d] * c.eread[i * K + d];
        for (int x = 0; x < V; ++x) row[x] += qh * S[d * V + x];
      }
      for (int x = 0; x < V; ++x)
        row[x] = p.scale * (row[x] * c.ereadv[i * V + x] + io[i * V + x]);
    }
  }

  // ChunkPass::o_softmax: each of the L rows of o replaced by its softmax over the V entries.
  void softmax_rows(int L, Vec& o) const {
    for (int i = 0; i < L && V > 0; ++i) {
      double* row = &o[size_t(i) * V];
      const double top = *std::max_element(row, row + V);
      double sum = 0;
      for (int x = 0; x < V; ++x) sum += row[x] = std::exp(row[x] - top);
      for (int x = 0; x < V; ++x) row[x] /= sum;
    }
  }

  // ChunkPass::dq_softmax_w: each of the L rows of dq from row t0 on through the backward of the
  // softmax with those weights w, dq := w * (dq - <w, dq>).
  void softmax_grad_rows(const SeqSpan& s, int h, int64_t t0, int L, Vec& dq) const {
    Vec w(K);
    for (int i = 0; i < L; ++i) {
      double* row = &dq[size_t(i) * K];
      double dot = 0;
      for (int d = 0; d < K; ++d) {
        w[d] = cpu::load<double, Acc>(p.dq_softmax_w, s.b, t0 + i, h, d);
        dot += w[d] * row[d];
      }
      for (int d = 0; d < K; ++d) row[d] = w[d] * (row[d] - dot);
    }
  }

  void forward(int n, int h) const {
    const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
    const Vec u = bonus_u(h);
    Vec S = load_state(p.h0, n, h), o;
    Intra r;
    Chunk c;
    const int64_t nc = chunks(s);
    for (int64_t ci = 0; ci < nc; ++ci) {
      load(s, h, ci * kChunk, false, c);
      save_state(p.hst, slot(n, ci), h, S);
      intra(c, u, false, r);
      outputs(c, S, r.io, o);
      if (p.o_softmax) softmax_rows(c.L, o);
      for (int i = 0; i < c.L; ++i) {
        const int64_t t = s.bos + ci * kChunk + i;
        for (int x = 0; x < V; ++x) {
          put<T>(p.o, p.o_acc, s.b, t, h, x, Acc(o[i * V + x]));
          if (p.o_softmax_acc.on()) *elem<Acc>(p.o_softmax_acc, s.b, t, h, x) = Acc(o[i * V + x]);
        }
      }
      advance(c, S);
    }
    save_state(p.hst, slot(n, nc), h, S);
    store_state(p.hT, n, h, S);
  }

  // Reverse cumsum over the chunk of x_t = reader term - key term (the reader term over t' > t
  // for the exclusive reader), plus zeta (§3). Where exp(lambda_t) == 0 the true value is
  // exactly 0, so the running sum restarts there, dropping every rounding residue carried so far.
  template <typename XR, typename XK>
  void decay_grad(int L, int D, const Vec& lam, const Vec& zeta, bool exclusive, XR&& xr, XK&& xk,
                  Vec& out) const {
    out.assign(size_t(L) * D, 0.0);
    for (int d = 0; d < D; ++d) {
      double acc = zeta[d];
      for (int t = L - 1; t >= 0; --t) {
        const double rq = xr(t, d), rk = xk(t, d);
        acc += (exclusive ? 0.0 : rq) - rk;
        if (hard(lam[t * D + d])) acc = 0;
        out[t * D + d] = acc;
        if (exclusive) acc += rq;
      }
    }
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
    Vec o, dg, dgv, dpart(K), zeta(K), zetav(V);
    Intra r;
    for (int64_t ci = nc - 1; ci >= 0; --ci) {
      load(s, h, ci * kChunk, true, c);
      const int L = c.L;
      const Acc* st = state_at(p.hst, slot(n, ci), h);
      S.assign(st, st + size_t(K) * V);
      save_state(p.dhst, slot(n, ci), h, dS);
      intra(c, u, true, r);
      Vec &dq = r.dq, &dk = r.dk, &dv = r.dv;

      // zeta = rowsum(S+ * dS+) and zetav = colsum(S+ * dS+) in their second form (§3, §7.2):
      // the decayed start state's part here, the written keys' / values' parts below.
      std::fill(zeta.begin(), zeta.end(), 0.0), std::fill(zetav.begin(), zetav.end(), 0.0);
      for (int d = 0; d < K; ++d)
        for (int x = 0; x < V; ++x) {
          const double z = c.gamma[d] * c.gammav[x] * S[d * V + x] * dS[d * V + x];
          zeta[d] += z, zetav[x] += z;
        }
      // Inter-chunk parts: dq' += scale (dO * expv(G)) S^T * exp(G); dk' += (V * expv(Omega))
      // dS+^T * exp(Omega); dv += (K * exp(Omega)) dS+ * expv(Omega).
      for (int i = 0; i < L; ++i) {
        for (int d = 0; d < K; ++d) {
          double a = 0, b = 0;
          for (int x = 0; x < V; ++x) {
            a += c.dout[i * V + x] * c.ereadv[i * V + x] * S[d * V + x];
            b += c.v[i * V + x] * c.eomegav[i * V + x] * dS[d * V + x];
          }
          dq[i * K + d] += p.scale * a * c.eread[i * K + d];
          const double kpart = b * c.eomega[i * K + d];
          dk[i * K + d] += kpart;
          zeta[d] += c.k[i * K + d] * kpart;
        }
        for (int x = 0; x < V; ++x) {
          double b = 0;
          for (int d = 0; d < K; ++d) b += c.k[i * K + d] * c.eomega[i * K + d] * dS[d * V + x];
          const double vpart = b * c.eomegav[i * V + x];
          dv[i * V + x] += vpart;
          zetav[x] += c.v[i * V + x] * vpart;
        }
      }
      // dlambda: q dq' - k dk' (§3); dlambdav: o dO - v dv (§7.2: the whole output row carries
      // expv(+G), every v row expv(-G)), with o recomputed here in double.
      decay_grad(L, K, c.lam, zeta, excl, [&](int t, int d) { return c.q[t * K + d] * dq[t * K + d]; },
                 [&](int t, int d) { return c.k[t * K + d] * dk[t * K + d]; }, dg);
      if (vd) {
        outputs(c, S, r.io, o);
        decay_grad(L, V, c.lamv, zetav, false,
                   [&](int t, int x) { return o[t * V + x] * c.dout[t * V + x]; },
                   [&](int t, int x) { return c.v[t * V + x] * dv[t * V + x]; }, dgv);
      }
      // The bonus carries no decay: its terms join dq, dk only after dlambda (§5.2).
      if (excl) {
        std::fill(dpart.begin(), dpart.end(), 0.0);
        for (int i = 0; i < L; ++i) {
          const double dii = r.dA[i * L + i];
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
      if (p.dq_softmax_w.on()) softmax_grad_rows(s, h, s.bos + ci * kChunk, L, dq);
      for (int i = 0; i < L; ++i) {
        const int64_t t = s.bos + ci * kChunk + i;
        for (int d = 0; d < K; ++d) {
          if (p.dq.on()) put<T>(p.dq, p.dq_acc, s.b, t, h, d, Acc(dq[i * K + d]));
          if (p.dk.on()) store_grad(p.dk, p.dk_adds, s.b, t, h, d, dk[i * K + d]);
          if (p.dg.on()) store_grad(p.dg, p.dg_adds, s.b, t, h, d, dg[i * K + d]);
        }
        for (int x = 0; x < V; ++x) {
          if (p.dv.on()) store_grad(p.dv, p.dv_adds, s.b, t, h, x, dv[i * V + x]);
          if (vd && p.dgv.on()) store_grad(p.dgv, p.dgv_adds, s.b, t, h, x, dgv[i * V + x]);
        }
      }
      // dS of the previous chunk's end: diag(gamma) dS+ diag(gammav) + scale Q^T (dO * expv(G)).
      for (int d = 0; d < K; ++d) {
        double* row = &dS[size_t(d) * V];
        for (int x = 0; x < V; ++x) row[x] *= c.gamma[d] * c.gammav[x];
        for (int i = 0; i < L; ++i) {
          const double qh = p.scale * c.q[i * K + d] * c.eread[i * K + d];
          for (int x = 0; x < V; ++x) row[x] += qh * c.dout[i * V + x] * c.ereadv[i * V + x];
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
  if (p.gv.on() && p.reader != Reader::Inclusive)
    throw std::invalid_argument("fla_ext: chunk_cpu: `gv` needs the inclusive reader");
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
