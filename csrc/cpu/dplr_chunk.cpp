// CPU backend of the chunked RWKV7 engine (kernels/dplr_chunk.h): the WY/UT algebra of
// docs/algorithms.md §6 as written, one (sequence, head, column tile) per task, all chunk math in
// double. Every decay exponent is a running sum of log decays <= 0 (§2.6), so w = -inf and mixed
// -1e4/-0.05 gates are exact. It is what the CUDA kernels (kernels/dplr_chunk_*.cuh, the same
// steps in fp32) are compared with.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../kernels/dplr_chunk.h"
#include "../kernels/sequence.h"
#include "elements.h"

namespace fla {
namespace {

using cpu::elem;
using Vec = std::vector<double>;
constexpr int C = kDplrChunk;

// One chunk of one (sequence, head, tile), padded to C rows (padding: w = 0, every other input
// 0, so it adds nothing and exp(G) of the last row is gamma). K-rows are [C][K], tile rows
// [C][nc]; the four pair matrices and X are [C][C].
struct Chunk {
  int L = 0;
  Vec r, w, k, a, b, v, dout;
  Vec eG, eO;  // exp(G_i) from the chunk start (inclusive), exp(Omega_j) to the chunk end
  Vec Ark, Arb, Aak, Aab, X;
  Vec M, P, U;  // A_ak V, (A * exp(E)) S, X (M + P)
  double eE(int i, int d, int K) const { return i ? eG[(i - 1) * K + d] : 1.0; }
};

template <typename T, typename Acc>
struct Engine {
  const DplrChunkPass& p;
  int K = p.K, V = p.V, cols = dplr_chunk_cols(p.K);

  // Calls f(i, j, fin, fex) for every row pair j <= i of the chunk with fin[d] = exp(sum of w_s,
  // j < s <= i) and (j < i only, else null) fex[d] = exp(sum of w_s, j < s < i): sums built by
  // adding one w per step of j downward, never by a difference.
  template <typename F>
  void for_pairs(const Chunk& c, F&& f) const {
    Vec ex(K), fin(K), fex(K);
    for (int i = 0; i < c.L; ++i) {
      std::fill(ex.begin(), ex.end(), 0.0);
      std::fill(fin.begin(), fin.end(), 1.0);
      f(i, i, fin.data(), static_cast<const double*>(nullptr));
      for (int j = i - 1; j >= 0; --j) {
        for (int d = 0; d < K; ++d) {
          fex[d] = std::exp(ex[d]);
          fin[d] = std::exp(ex[d] + c.w[i * K + d]);
        }
        f(i, j, fin.data(), fex.data());
        for (int d = 0; d < K; ++d) ex[d] += c.w[j * K + d];
      }
    }
  }

  // Loads chunk rows [t0, t0 + L) and the tile columns [x0, x0 + nc), then everything of the
  // chunk that does not depend on the state: decay factors, pair matrices, X, M.
  void prepare(const SeqSpan& s, int h, int64_t t0, int x0, int nc, bool with_dout,
               Chunk& c) const {
    const int L = c.L = int(std::min<int64_t>(C, s.len - t0));
    for (Vec* x : {&c.r, &c.w, &c.k, &c.a, &c.b}) x->assign(size_t(C) * K, 0.0);
    c.v.assign(size_t(C) * nc, 0.0), c.dout.assign(with_dout ? size_t(C) * nc : 0, 0.0);
    for (int i = 0; i < L; ++i) {
      const int64_t t = s.bos + t0 + i;
      for (int d = 0; d < K; ++d) {
        c.r[i * K + d] = cpu::load<double, T>(p.r, s.b, t, h, d);
        c.w[i * K + d] = cpu::load<double, T>(p.w, s.b, t, h, d);
        c.k[i * K + d] = cpu::load<double, T>(p.k, s.b, t, h, d);
        c.a[i * K + d] = cpu::load<double, T>(p.a, s.b, t, h, d);
        c.b[i * K + d] = cpu::load<double, T>(p.b, s.b, t, h, d);
      }
      for (int x = 0; x < nc; ++x) {
        c.v[i * nc + x] = cpu::load<double, T>(p.v, s.b, t, h, x0 + x);
        if (with_dout) c.dout[i * nc + x] = cpu::load<double, T>(p.dout, s.b, t, h, x0 + x);
      }
    }
    c.eG.resize(size_t(C) * K), c.eO.resize(size_t(C) * K);
    for (int d = 0; d < K; ++d) {
      double run = 0;
      for (int i = 0; i < C; ++i) c.eG[i * K + d] = std::exp(run += c.w[i * K + d]);
      run = 0;
      for (int j = C - 1; j >= 0; --j) {
        c.eO[j * K + d] = std::exp(run);
        run += c.w[j * K + d];
      }
    }
    for (Vec* x : {&c.Ark, &c.Arb, &c.Aak, &c.Aab}) x->assign(size_t(C) * C, 0.0);
    for_pairs(c, [&](int i, int j, const double* fin, const double* fex) {
      double rk = 0, rb = 0, ak = 0, ab = 0;
      for (int d = 0; d < K; ++d) {
        rk += c.r[i * K + d] * c.k[j * K + d] * fin[d];
        rb += c.r[i * K + d] * c.b[j * K + d] * fin[d];
        if (fex) {
          ak += c.a[i * K + d] * c.k[j * K + d] * fex[d];
          ab += c.a[i * K + d] * c.b[j * K + d] * fex[d];
        }
      }
      c.Ark[i * C + j] = rk, c.Arb[i * C + j] = rb, c.Aak[i * C + j] = ak, c.Aab[i * C + j] = ab;
    });
    // X = (I - A_ab)^-1: forward substitution on the strict part, row by row (§6.2).
    c.X.assign(size_t(C) * C, 0.0);
    for (int i = 0; i < C; ++i) {
      for (int j = 0; j < i; ++j) {
        double x = c.Aab[i * C + j];
        for (int l = j + 1; l < i; ++l) x += c.Aab[i * C + l] * c.X[l * C + j];
        c.X[i * C + j] = x;
      }
      c.X[i * C + i] = 1;
    }
    c.M.assign(size_t(C) * nc, 0.0);
    for (int i = 0; i < L; ++i)
      for (int j = 0; j < i; ++j)
        for (int x = 0; x < nc; ++x) c.M[i * nc + x] += c.Aak[i * C + j] * c.v[j * nc + x];
  }

  // P = (A * exp(E)) S and U = X (M + P), S = the chunk-start state [K][nc].
  void pseudo_values(Chunk& c, const Vec& S, int nc) const {
    c.P.assign(size_t(C) * nc, 0.0), c.U.assign(size_t(C) * nc, 0.0);
    for (int i = 0; i < c.L; ++i)
      for (int d = 0; d < K; ++d) {
        const double ah = c.a[i * K + d] * c.eE(i, d, K);
        for (int x = 0; x < nc; ++x) c.P[i * nc + x] += ah * S[d * nc + x];
      }
    for (int i = 0; i < c.L; ++i)
      for (int l = 0; l <= i; ++l)
        for (int x = 0; x < nc; ++x)
          c.U[i * nc + x] += c.X[i * C + l] * (c.M[l * nc + x] + c.P[l * nc + x]);
  }

  // S <- diag(gamma) S + K^^T V + B^^T U.
  void advance(const Chunk& c, Vec& S, int nc) const {
    for (int d = 0; d < K; ++d) {
      double* row = &S[size_t(d) * nc];
      const double gamma = c.eG[(C - 1) * K + d];
      for (int x = 0; x < nc; ++x) row[x] *= gamma;
      for (int j = 0; j < c.L; ++j) {
        const double kh = c.k[j * K + d] * c.eO[j * K + d], bh = c.b[j * K + d] * c.eO[j * K + d];
        for (int x = 0; x < nc; ++x) row[x] += kh * c.v[j * nc + x] + bh * c.U[j * nc + x];
      }
    }
  }

  Vec load_state(const MatArg& m, int n, int h, int x0, int nc) const {  // zero when off
    Vec S(size_t(K) * nc, 0.0);
    if (m.on())
      for (int d = 0; d < K; ++d)
        for (int x = 0; x < nc; ++x) S[d * nc + x] = *elem<Acc>(m, n, h, d, x0 + x);
    return S;
  }
  void store_state(const MatArg& m, int n, int h, int x0, int nc, const Vec& S) const {
    if (!m.on()) return;
    for (int d = 0; d < K; ++d)
      for (int x = 0; x < nc; ++x) *elem<Acc>(m, n, h, d, x0 + x) = static_cast<Acc>(S[d * nc + x]);
  }

  void forward(int n, int h, int tile) const {
    const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
    const int x0 = tile * cols, nc = std::min(cols, V - x0);
    Vec S = load_state(p.h0, n, h, x0, nc), o(nc);
    Chunk c;
    for (int64_t t0 = 0; t0 < s.len; t0 += C) {
      prepare(s, h, t0, x0, nc, false, c);
      pseudo_values(c, S, nc);
      for (int i = 0; i < c.L; ++i) {  // O = scale (R^ S + A_rk V + A_rb U)
        std::fill(o.begin(), o.end(), 0.0);
        for (int d = 0; d < K; ++d) {
          const double rh = c.r[i * K + d] * c.eG[i * K + d];
          for (int x = 0; x < nc; ++x) o[x] += rh * S[d * nc + x];
        }
        for (int j = 0; j <= i; ++j)
          for (int x = 0; x < nc; ++x)
            o[x] += c.Ark[i * C + j] * c.v[j * nc + x] + c.Arb[i * C + j] * c.U[j * nc + x];
        const int64_t t = s.bos + t0 + i;
        for (int x = 0; x < nc; ++x)
          *elem<T>(p.o, s.b, t, h, x0 + x) = static_cast<T>(p.scale * o[x]);
      }
      advance(c, S, nc);
    }
    store_state(p.hT, n, h, x0, nc, S);
  }

  void backward(int n, int h, int tile) const {
    const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
    const int x0 = tile * cols, nc = std::min(cols, V - x0);
    const int64_t nch = (s.len + C - 1) / C;
    const double rho = p.scale;
    Chunk c;
    // Recompute the chunk-start states (the forward saves only its inputs).
    std::vector<Vec> hst(static_cast<size_t>(nch));
    Vec S = load_state(p.h0, n, h, x0, nc);
    for (int64_t ci = 0; ci < nch; ++ci) {
      hst[ci] = S;
      prepare(s, h, ci * C, x0, nc, false, c);
      pseudo_values(c, S, nc);
      advance(c, S, nc);
    }
    Vec Snext = S;  // the state at the end of the chunk being differentiated
    Vec dS = load_state(p.dht, n, h, x0, nc);
    Vec dU, dM, dX, Y, dArk, dArb, dAak, dAab, dv, zeta(K);
    Vec gr, gw, gk, ga, gb;
    for (int64_t ci = nch - 1; ci >= 0; --ci) {
      prepare(s, h, ci * C, x0, nc, true, c);
      S = hst[ci];
      pseudo_values(c, S, nc);
      const int L = c.L;
      for (int d = 0; d < K; ++d) {  // zeta = rowsum(S+ * dS+)
        double z = 0;
        for (int x = 0; x < nc; ++x) z += Snext[d * nc + x] * dS[d * nc + x];
        zeta[d] = z;
      }
      // dU = scale A_rb^T dO + B^ dS+;  dM = X^T dU.
      dU.assign(size_t(C) * nc, 0.0), dM.assign(size_t(C) * nc, 0.0);
      for (int j = 0; j < L; ++j) {
        double* row = &dU[size_t(j) * nc];
        for (int i = j; i < L; ++i)
          for (int x = 0; x < nc; ++x) row[x] += rho * c.Arb[i * C + j] * c.dout[i * nc + x];
        for (int d = 0; d < K; ++d) {
          const double bh = c.b[j * K + d] * c.eO[j * K + d];
          for (int x = 0; x < nc; ++x) row[x] += bh * dS[d * nc + x];
        }
      }
      for (int l = 0; l < L; ++l)
        for (int i = l; i < L; ++i)
          for (int x = 0; x < nc; ++x) dM[l * nc + x] += c.X[i * C + l] * dU[i * nc + x];
      // Pair-matrix gradients; dX only below the diagonal (the rest cannot reach dA_ab).
      auto dot = [&](const Vec& A, int i, const Vec& B, int j) {
        double z = 0;
        for (int x = 0; x < nc; ++x) z += A[i * nc + x] * B[j * nc + x];
        return z;
      };
      for (Vec* x : {&dArk, &dArb, &dAak, &dAab, &dX, &Y}) x->assign(size_t(C) * C, 0.0);
      for (int i = 0; i < L; ++i)
        for (int j = 0; j <= i; ++j) {
          dArk[i * C + j] = rho * dot(c.dout, i, c.v, j);
          dArb[i * C + j] = rho * dot(c.dout, i, c.U, j);
          if (j < i) {
            dAak[i * C + j] = dot(dM, i, c.v, j);
            double z = 0;
            for (int x = 0; x < nc; ++x) z += dU[i * nc + x] * (c.M[j * nc + x] + c.P[j * nc + x]);
            dX[i * C + j] = z;
          }
        }
      for (int i = 0; i < C; ++i)  // Y = X^T dX, dA_ab = stril(Y X^T)
        for (int q = 0; q < C; ++q) {
          double z = 0;
          for (int pp = 0; pp < C; ++pp) z += c.X[pp * C + i] * dX[pp * C + q];
          Y[i * C + q] = z;
        }
      for (int i = 0; i < C; ++i)
        for (int j = 0; j < i; ++j) {
          double z = 0;
          for (int q = 0; q < C; ++q) z += Y[i * C + q] * c.X[j * C + q];
          dAab[i * C + j] = z;
        }
      // dV = scale A_rk^T dO + K^ dS+ + A_ak^T dM  (this tile's columns: final).
      dv.assign(size_t(C) * nc, 0.0);
      for (int j = 0; j < L; ++j) {
        double* row = &dv[size_t(j) * nc];
        for (int i = j; i < L; ++i)
          for (int x = 0; x < nc; ++x)
            row[x] += rho * c.Ark[i * C + j] * c.dout[i * nc + x] + c.Aak[i * C + j] * dM[i * nc + x];
        for (int d = 0; d < K; ++d) {
          const double kh = c.k[j * K + d] * c.eO[j * K + d];
          for (int x = 0; x < nc; ++x) row[x] += kh * dS[d * nc + x];
        }
        const int64_t t = s.bos + ci * C + j;
        for (int x = 0; x < nc; ++x) *elem<T>(p.dv, s.b, t, h, x0 + x) = static_cast<T>(row[x]);
      }
      // K-vector gradients: the state parts (dR^ = scale dO S^T, dA^ = dM S^T, dK^ = V dS+^T,
      // dB^ = U dS+^T, times their boundary factors), then the pair parts.
      for (Vec* x : {&gr, &gw, &gk, &ga, &gb}) x->assign(size_t(C) * K, 0.0);
      for (int i = 0; i < L; ++i)
        for (int d = 0; d < K; ++d) {
          double dr = 0, da = 0, dk = 0, db = 0;
          for (int x = 0; x < nc; ++x) {
            dr += c.dout[i * nc + x] * S[d * nc + x];
            da += dM[i * nc + x] * S[d * nc + x];
            dk += c.v[i * nc + x] * dS[d * nc + x];
            db += c.U[i * nc + x] * dS[d * nc + x];
          }
          gr[i * K + d] = rho * dr * c.eG[i * K + d];
          ga[i * K + d] = da * c.eE(i, d, K);
          gk[i * K + d] = dk * c.eO[i * K + d];
          gb[i * K + d] = db * c.eO[i * K + d];
        }
      for_pairs(c, [&](int i, int j, const double* fin, const double* fex) {
        const double rk = dArk[i * C + j], rb = dArb[i * C + j];
        const double ak = dAak[i * C + j], ab = dAab[i * C + j];
        for (int d = 0; d < K; ++d) {
          const int id = i * K + d, jd = j * K + d;
          gr[id] += (rk * c.k[jd] + rb * c.b[jd]) * fin[d];
          gk[jd] += rk * c.r[id] * fin[d];
          gb[jd] += rb * c.r[id] * fin[d];
          if (fex) {
            ga[id] += (ak * c.k[jd] + ab * c.b[jd]) * fex[d];
            gk[jd] += ak * c.a[id] * fex[d];
            gb[jd] += ab * c.a[id] * fex[d];
          }
        }
      });
      // dw_t = sum_{t' >= t} (r dr - k dk - b db) + sum_{t' > t} a da + zeta (§6.4), exactly 0
      // where exp(w_t) == 0 in the acc type, which also drops the rounding carried so far.
      for (int d = 0; d < K; ++d) {
        double acc = zeta[d];
        for (int t = L - 1; t >= 0; --t) {
          const int td = t * K + d;
          acc += c.r[td] * gr[td] - c.k[td] * gk[td] - c.b[td] * gb[td];
          if (std::exp(static_cast<Acc>(c.w[td])) == Acc(0)) acc = 0;
          gw[td] = acc;
          acc += c.a[td] * ga[td];
        }
      }
      const Vec* grads[kNumKGrads];
      grads[kGradR] = &gr, grads[kGradW] = &gw, grads[kGradK] = &gk, grads[kGradA] = &ga;
      grads[kGradB] = &gb;
      for (int g = 0; g < kNumKGrads; ++g) {
        VecArg dst = p.kg;
        dst.ptr = static_cast<const Acc*>(p.kg.ptr) + tile * p.kg_tile + g * p.kg_grad;
        for (int i = 0; i < L; ++i)
          for (int d = 0; d < K; ++d)
            *elem<Acc>(dst, s.b, s.bos + ci * C + i, h, d) = static_cast<Acc>((*grads[g])[i * K + d]);
      }
      // dS of the previous chunk's end: diag(gamma) dS+ + scale R^^T dO + A^^T dM.
      for (int d = 0; d < K; ++d) {
        double* row = &dS[size_t(d) * nc];
        const double gamma = c.eG[(C - 1) * K + d];
        for (int x = 0; x < nc; ++x) row[x] *= gamma;
        for (int i = 0; i < L; ++i) {
          const double rh = rho * c.r[i * K + d] * c.eG[i * K + d];
          const double ah = c.a[i * K + d] * c.eE(i, d, K);
          for (int x = 0; x < nc; ++x) row[x] += rh * c.dout[i * nc + x] + ah * dM[i * nc + x];
        }
      }
      Snext = S;
    }
    store_state(p.dh0, n, h, x0, nc, dS);
  }
};

template <typename T, typename Acc>
void run_all(const DplrChunkPass& p) {
  const Engine<T, Acc> engine{p};
  const bool bwd = p.backward();
  const int tiles = dplr_chunk_tiles(p.K, p.V);
  at::parallel_for(0, int64_t(p.N) * p.H * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int tile = int(i % tiles), nh = int(i / tiles);
      if (bwd)
        engine.backward(nh / p.H, nh % p.H, tile);
      else
        engine.forward(nh / p.H, nh % p.H, tile);
    }
  });
}

}  // namespace

void dplr_chunk_cpu(const DplrChunkPass& p) {
  cpu::dispatch_dtype(p.dtype, [&](auto t, auto a) { run_all<decltype(t), decltype(a)>(p); });
}

}  // namespace fla
