// CUDA engine for the chunked RWKV7 algebra of kernels/dplr_chunk.h (the steps of
// cpu/dplr_chunk.cpp in fp32, SIMT FMA: no TF32 anywhere).
//
// Forward, two kernels:
//   prep   (chunk slot, H)  everything of a chunk that does not depend on the state: the pair
//          matrices (every thread pair (i, j) of the 16 x 16 grid adds its exponent
//          sum_{j < s < i} w_s elementwise: never a difference, never positive, so any w in
//          [-inf, 0] is exact), X = (I - A_ab)^-1 by forward substitution, then W, Q~, K^, B^,
//          gamma, U0, O0 into the workspace (DplrWs).
//   state  (N, H, V / 32)   the sequential pass over chunks with the K x 32 state slice in shared
//          memory: U = U0 + W S, o = O0 + scale Q~ S, S+ = gamma S + K^^T V + B^^T U. The next
//          chunk's workspace block is copied asynchronously while this one is used, so a step
//          costs its arithmetic, not a memory latency. Writes the chunk-start states (`hst`)
//          when the backward asks for them.
// Backward: prep and state (for hst), then one CTA of 256 threads per (sequence, head, tile of
// dplr_chunk_cols(K) columns) runs the reverse chunk pass with the rows, pair matrices and the
// K x cols state and its gradient in shared memory; its K-vector gradients are per-tile partial
// sums. No host synchronisation: the launches are CUDA-graph safe.
#pragma once
#include "dplr_chunk.h"
#include "elements.cuh"

namespace fla {
namespace dplr_chunk_detail {

using elements::from_f;
using elements::ld;
using elements::mptr;
using elements::vptr;

constexpr int C = kDplrChunk, CP = C + 1, NT = 256;
static_assert(NT == C * C, "one thread per pair (i, j) of a chunk");

// Shared memory of one CTA, in floats. K-rows [C][KP] (KP = K + 1: the pair loops read one
// channel of 16 rows at once), tile rows [C][BP], 16 x 16 matrices [C][CP], states [K][cols].
// The prep kernel (bwd = false) holds no state and no P.
struct Smem {
  int K, KP, cols, BP;
  int r, w, k, a, b, eG, eO, S, v, U, M, P, Ark, Arb, Aak, Aab, X;
  int dS, dO, dU, dM, gr, gk, ga, gb, dArk, dArb, dAak, dAab, dX, Y, zeta;  // backward
  int total;

  __host__ __device__ Smem(int K_, bool bwd) : K(K_), KP(K_ + 1), cols(dplr_chunk_cols(K_)) {
    BP = cols + 1;
    int o = 0;
    auto take = [&](int n) { const int at = o; o += n; return at; };
    r = take(C * KP), w = take(C * KP), k = take(C * KP), a = take(C * KP), b = take(C * KP);
    eG = take(C * KP), eO = take(C * KP), S = bwd ? take(K * cols) : 0;
    v = take(C * BP), U = take(C * BP), M = take(C * BP), P = bwd ? take(C * BP) : 0;
    Ark = take(C * CP), Arb = take(C * CP), Aak = take(C * CP), Aab = take(C * CP);
    X = take(C * CP);
    dS = dO = dU = dM = gr = gk = ga = gb = dArk = dArb = dAak = dAab = dX = Y = zeta = 0;
    if (bwd) {
      dS = take(K * cols), dO = take(C * BP), dU = take(C * BP), dM = take(C * BP);
      gr = take(C * KP), gk = take(C * KP), ga = take(C * KP), gb = take(C * KP);
      dArk = take(C * CP), dArb = take(C * CP), dAak = take(C * CP), dAab = take(C * CP);
      dX = take(C * CP), Y = take(C * CP), zeta = take(K);
    }
    total = o;
  }
  __host__ __device__ size_t bytes() const { return size_t(total) * sizeof(float); }
};

struct Cta {
  int n, h, tile, x0, nc;
  SeqSpan s;
};

__device__ __forceinline__ Cta cta(const DplrChunkPass& p) {
  const int tiles = dplr_chunk_tiles(p.K, p.V), cols = dplr_chunk_cols(p.K);
  Cta c;
  c.tile = blockIdx.x % tiles;
  const int nh = blockIdx.x / tiles;
  c.h = nh % p.H, c.n = nh / p.H;
  c.s = seq_span(p.cu_seqlens, c.n, p.T);
  c.x0 = c.tile * cols;
  c.nc = min(cols, p.V - c.x0);
  return c;
}

// exp(E_i) = exp(G_{i-1}), 1 on the first row.
__device__ __forceinline__ float eE(const float* sm, const Smem& L, int i, int d) {
  return i ? sm[L.eG + (i - 1) * L.KP + d] : 1.f;
}

// Rows [t0, t0 + nrow) of the chunk's K-vectors into shared memory, padded to C rows with w = 0
// and every other input 0 (padding adds nothing, and exp(G) of the last row is the chunk's
// gamma).
template <typename T>
__device__ void load_rows(float* sm, const Smem& L, const DplrChunkPass& p, const SeqSpan& s,
                          int h, int64_t t0, int nrow) {
  for (int e = threadIdx.x; e < C * L.K; e += NT) {
    const int i = e / L.K, d = e % L.K, at = i * L.KP + d;
    float r = 0.f, w = 0.f, k = 0.f, a = 0.f, bb = 0.f;
    if (i < nrow) {
      const int64_t t = s.bos + t0 + i;
      r = ld<T>(p.r, s.b, t, h, d), w = ld<T>(p.w, s.b, t, h, d), k = ld<T>(p.k, s.b, t, h, d);
      a = ld<T>(p.a, s.b, t, h, d), bb = ld<T>(p.b, s.b, t, h, d);
    }
    sm[L.r + at] = r, sm[L.w + at] = w, sm[L.k + at] = k, sm[L.a + at] = a, sm[L.b + at] = bb;
  }
}
// The tile's v (and dO) rows; columns >= V of the tile and padded rows are 0.
template <typename T>
__device__ void load_cols(float* sm, const Smem& L, const DplrChunkPass& p, const SeqSpan& s,
                          int h, int x0, int nc, int64_t t0, int nrow, bool with_dout) {
  for (int e = threadIdx.x; e < C * L.cols; e += NT) {
    const int i = e / L.cols, x = e % L.cols, at = i * L.BP + x;
    const bool ok = i < nrow && x < nc;
    const int64_t t = s.bos + t0 + i;
    sm[L.v + at] = ok ? ld<T>(p.v, s.b, t, h, x0 + x) : 0.f;
    if (with_dout) sm[L.dO + at] = ok ? ld<T>(p.dout, s.b, t, h, x0 + x) : 0.f;
  }
}
template <typename T>
__device__ void load_chunk(float* sm, const Smem& L, const DplrChunkPass& p, const Cta& c,
                           int64_t t0, int nrow, bool with_dout) {
  load_rows<T>(sm, L, p, c.s, c.h, t0, nrow);
  load_cols<T>(sm, L, p, c.s, c.h, c.x0, c.nc, t0, nrow, with_dout);
}

// The pair-matrix entries (i, j), j <= i: A_rk, A_rb with the factor exp(sum_{j<s<=i} w_s) and
// (j < i) A_ak, A_ab with exp(sum_{j<s<i} w_s), each exponent added up (§2.6). Channels go kVec
// at a time so that their exponent sums are independent chains: one chain per channel made the
// pair matrices latency-bound. Host-callable, for testing.
FLA_HD void pair_sums(const float* sm, const Smem& L, int i, int j, float& rk, float& rb,
                      float& ak, float& ab) {
  constexpr int kVec = 8;
  const int K = L.K, KP = L.KP;
  const float *ri = sm + L.r + i * KP, *ai = sm + L.a + i * KP, *wi = sm + L.w + i * KP;
  const float *kj = sm + L.k + j * KP, *bj = sm + L.b + j * KP, *w = sm + L.w;
  rk = rb = ak = ab = 0.f;
  if (j == i) {
    for (int d = 0; d < K; ++d) rk += ri[d] * kj[d], rb += ri[d] * bj[d];
    return;
  }
  int d0 = 0;
  for (; d0 + kVec <= K; d0 += kVec) {
    float ex[kVec];
#pragma unroll
    for (int u = 0; u < kVec; ++u) ex[u] = 0.f;
    for (int s = j + 1; s < i; ++s)
#pragma unroll
      for (int u = 0; u < kVec; ++u) ex[u] += w[s * KP + d0 + u];
#pragma unroll
    for (int u = 0; u < kVec; ++u) {
      const int d = d0 + u;
      const float fin = expf(ex[u] + wi[d]), fex = expf(ex[u]);
      rk += ri[d] * kj[d] * fin, rb += ri[d] * bj[d] * fin;
      ak += ai[d] * kj[d] * fex, ab += ai[d] * bj[d] * fex;
    }
  }
  for (int d = d0; d < K; ++d) {
    float ex = 0.f;
    for (int s = j + 1; s < i; ++s) ex += w[s * KP + d];
    const float fin = expf(ex + wi[d]), fex = expf(ex);
    rk += ri[d] * kj[d] * fin, rb += ri[d] * bj[d] * fin;
    ak += ai[d] * kj[d] * fex, ab += ai[d] * bj[d] * fex;
  }
}

// Everything of a loaded chunk that does not depend on the state: exp(G), exp(Omega), the pair
// matrices and X. Ends synchronised.
__device__ inline void prepare(float* sm, const Smem& L) {
  const int K = L.K, KP = L.KP;
  for (int d = threadIdx.x; d < K; d += NT) {
    float run = 0.f;
    for (int i = 0; i < C; ++i) sm[L.eG + i * KP + d] = expf(run += sm[L.w + i * KP + d]);
    run = 0.f;
    for (int j = C - 1; j >= 0; --j) {
      sm[L.eO + j * KP + d] = expf(run);
      run += sm[L.w + j * KP + d];
    }
  }
  {
    const int i = threadIdx.x / C, j = threadIdx.x % C;
    float rk = 0.f, rb = 0.f, ak = 0.f, ab = 0.f;
    if (j <= i) pair_sums(sm, L, i, j, rk, rb, ak, ab);
    const int at = i * CP + j;
    sm[L.Ark + at] = rk, sm[L.Arb + at] = rb, sm[L.Aak + at] = ak, sm[L.Aab + at] = ab;
    sm[L.X + at] = i == j ? 1.f : 0.f;
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // X = (I - A_ab)^-1 row by row; lane j owns column j
    const int j = threadIdx.x;
    for (int i = 1; i < C; ++i) {
      if (j < i) {
        float x = sm[L.Aab + i * CP + j];
        for (int l = j + 1; l < i; ++l) x += sm[L.Aab + i * CP + l] * sm[L.X + l * CP + j];
        sm[L.X + i * CP + j] = x;
      }
      __syncwarp();
    }
  }
  __syncthreads();
}

// P = (A * exp(E)) S, M = A_ak V, then U = X (M + P). Ends synchronised.
__device__ inline void pseudo_values(float* sm, const Smem& L) {
  for (int e = threadIdx.x; e < C * L.cols; e += NT) {
    const int i = e / L.cols, x = e % L.cols;
    float pv = 0.f, m = 0.f;
    for (int d = 0; d < L.K; ++d)
      pv += sm[L.a + i * L.KP + d] * eE(sm, L, i, d) * sm[L.S + d * L.cols + x];
    for (int j = 0; j < i; ++j) m += sm[L.Aak + i * CP + j] * sm[L.v + j * L.BP + x];
    sm[L.P + i * L.BP + x] = pv, sm[L.M + i * L.BP + x] = m;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < C * L.cols; e += NT) {
    const int i = e / L.cols, x = e % L.cols;
    float u = 0.f;
    for (int l = 0; l <= i; ++l)
      u += sm[L.X + i * CP + l] * (sm[L.M + l * L.BP + x] + sm[L.P + l * L.BP + x]);
    sm[L.U + i * L.BP + x] = u;
  }
  __syncthreads();
}

// Loads a state slice [K][cols] (columns >= V and an absent matrix read 0). Not synchronised.
__device__ inline void load_state(float* dst, const Smem& L, const MatArg& m, const Cta& c) {
  for (int e = threadIdx.x; e < L.K * L.cols; e += NT) {
    const int d = e / L.cols, x = e % L.cols;
    dst[e] = m.on() && x < c.nc ? *mptr(m, c.n, c.h, d, c.x0 + x) : 0.f;
  }
}
__device__ inline void store_state(const MatArg& m, const float* src, const Smem& L, const Cta& c) {
  if (!m.on()) return;
  for (int e = threadIdx.x; e < L.K * L.cols; e += NT) {
    const int d = e / L.cols, x = e % L.cols;
    if (x < c.nc) *mptr(m, c.n, c.h, d, c.x0 + x) = src[e];
  }
}
// The chunk-start state slice in the hst workspace [slots, H, K, V].
__device__ __forceinline__ float* hst_at(const DplrChunkPass& p, const Cta& c, int64_t ci,
                                         int d, int x) {
  const int64_t slot = chunk_slot<kDplrChunk>(p.cu_seqlens, c.n, p.T, ci);
  return static_cast<float*>(p.hst) + ((slot * p.H + c.h) * p.K + d) * int64_t(p.V) + c.x0 + x;
}

// ---------------------------------------------------------------------------------------------
// Forward, parallel part: one CTA per (chunk slot, head). Slots without a chunk (final-state and
// gap slots) are never read and are left unwritten.
template <typename T>
__global__ void __launch_bounds__(NT) prep_kernel(const DplrChunkPass p) {
  extern __shared__ float sm[];
  const Smem L(p.K, false);
  const DplrWs ws(p.K, p.V);
  const int64_t slot = blockIdx.x;
  const int h = blockIdx.y, n = slot_sequence<C>(p.cu_seqlens, p.N, p.T, slot);
  const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
  const int64_t ci = slot - chunk_slot<C>(p.cu_seqlens, n, p.T, 0), t0 = ci * C;
  if (ci < 0 || t0 >= s.len) return;
  const int nrow = int(s.len - t0 < C ? s.len - t0 : C);
  const int K = L.K, KP = L.KP, cols = L.cols, BP = L.BP;
  load_rows<T>(sm, L, p, s, h, t0, nrow);
  __syncthreads();
  prepare(sm, L);
  // W = X Â into the w rows (w is not read again).
  for (int e = threadIdx.x; e < C * K; e += NT) {
    const int i = e / K, d = e % K;
    float x = 0.f;
    for (int l = 0; l <= i; ++l) x += sm[L.X + i * CP + l] * sm[L.a + l * KP + d] * eE(sm, L, l, d);
    sm[L.w + i * KP + d] = x;
  }
  __syncthreads();
  float* out = static_cast<float*>(p.ws) + (slot * p.H + h) * ws.per();
  for (int e = threadIdx.x; e < C * ws.KP4; e += NT) {
    const int i = e / ws.KP4, d = e % ws.KP4;
    float wv = 0.f, q = 0.f, kh = 0.f, bh = 0.f;
    if (d < K) {
      const int at = i * KP + d;
      wv = sm[L.w + at];
      q = sm[L.r + at] * sm[L.eG + at];
      for (int j = 0; j <= i; ++j) q += sm[L.Arb + i * CP + j] * sm[L.w + j * KP + d];
      kh = sm[L.k + at] * sm[L.eO + at], bh = sm[L.b + at] * sm[L.eO + at];
    }
    out[ws.W() + e] = wv, out[ws.Q() + e] = q, out[ws.Kh() + e] = kh, out[ws.Bh() + e] = bh;
  }
  for (int d = threadIdx.x; d < ws.KP4; d += NT)
    out[ws.gam() + d] = d < K ? sm[L.eG + (C - 1) * KP + d] : 0.f;
  const float rho = float(p.scale);
  for (int x0 = 0; x0 < p.V; x0 += cols) {  // U0 = X A_ak V, O0 = scale (A_rk V + A_rb U0)
    __syncthreads();
    load_cols<T>(sm, L, p, s, h, x0, min(cols, p.V - x0), t0, nrow, false);
    __syncthreads();
    for (int e = threadIdx.x; e < C * cols; e += NT) {
      const int i = e / cols, x = e % cols;
      float m = 0.f;
      for (int j = 0; j < i; ++j) m += sm[L.Aak + i * CP + j] * sm[L.v + j * BP + x];
      sm[L.M + i * BP + x] = m;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < C * cols; e += NT) {
      const int i = e / cols, x = e % cols;
      float u = 0.f;
      for (int l = 0; l <= i; ++l) u += sm[L.X + i * CP + l] * sm[L.M + l * BP + x];
      sm[L.U + i * BP + x] = u;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < C * cols; e += NT) {
      const int i = e / cols, x = e % cols;
      if (x0 + x >= ws.VP4) continue;  // columns in [V, VP4) are written: 0 there
      float o = 0.f;
      for (int j = 0; j <= i; ++j)
        o += sm[L.Ark + i * CP + j] * sm[L.v + j * BP + x] + sm[L.Arb + i * CP + j] * sm[L.U + j * BP + x];
      out[ws.U0() + i * ws.VP4 + x0 + x] = sm[L.U + i * BP + x];
      out[ws.O0() + i * ws.VP4 + x0 + x] = rho * o;
    }
  }
}

// 16-byte global -> shared copy that does not wait (cp.async); `on` false writes zeros. The host
// branch (a synchronous copy) serves tests/cuda_emu, which runs these kernels on the CPU.
__device__ __forceinline__ void copy16(float* dst, const float* src, bool on) {
#ifdef __CUDA_ARCH__
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(on ? 16 : 0));
#else
  for (int i = 0; i < 4; ++i) dst[i] = on ? src[i] : 0.f;
#endif
}
__device__ __forceinline__ void copy_commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;");
#endif
}
template <int Pending>
__device__ __forceinline__ void copy_wait() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending));
#endif
}

// Forward, sequential part: one CTA of 256 threads per (sequence, head, 32 state columns).
constexpr int SX = 32;  // state columns per CTA
FLA_HD int state_tiles(int V) { return (V + SX - 1) / SX; }
struct StateSmem {
  int S, U, Vt, buf, stage, total;  // floats
  FLA_HD StateSmem(const DplrWs& ws, int K) {
    stage = int(ws.kpart()) + 2 * C * SX;  // W .. gamma, then U0 and O0 [C][SX]
    S = 0, U = K * SX, Vt = U + C * SX, buf = Vt + C * SX;
    buf = (buf + 3) / 4 * 4;
    total = buf + 2 * stage;
  }
  FLA_HD size_t bytes() const { return size_t(total) * sizeof(float); }
};

template <typename T>
__global__ void __launch_bounds__(NT) state_kernel(const DplrChunkPass p) {
  extern __shared__ float4 sm4[];
  float* sm = reinterpret_cast<float*>(sm4);
  const DplrWs ws(p.K, p.V);
  const StateSmem L(ws, p.K);
  const int K = p.K, KP4 = ws.KP4, tiles = state_tiles(p.V);
  const int tile = blockIdx.x % tiles, nh = blockIdx.x / tiles, h = nh % p.H, n = nh / p.H;
  const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
  const int x0 = tile * SX, nc = min(SX, p.V - x0);
  const int64_t nch = (s.len + C - 1) / C;
  float *S = sm + L.S, *U = sm + L.U, *Vt = sm + L.Vt;
  const float* wsb = static_cast<const float*>(p.ws);
  auto slot_of = [&](int64_t ci) { return chunk_slot<C>(p.cu_seqlens, n, p.T, ci); };

  // Chunk ci's workspace block (W .. gamma whole, U0 and O0 at this tile's columns) into buf.
  auto fetch = [&](int64_t ci) {
    float* dst = sm + L.buf + (ci & 1) * L.stage;
    const float* src = wsb + (slot_of(ci) * p.H + h) * ws.per();
    for (int e = threadIdx.x; e < ws.kpart() / 4; e += NT) copy16(dst + 4 * e, src + 4 * e, true);
    for (int e = threadIdx.x; e < 2 * C * (SX / 4); e += NT) {
      const int mtx = e / (C * SX / 4), i = e / (SX / 4) % C, q = e % (SX / 4), col = x0 + 4 * q;
      const bool on = col < ws.VP4;
      copy16(dst + ws.kpart() + (mtx * C + i) * SX + 4 * q,
             src + ws.U0() + (mtx * C + i) * ws.VP4 + (on ? col : 0), on);
    }
    copy_commit();
  };
  // Chunk ci's v rows at this tile's columns, two per thread (0 outside).
  auto fetch_v = [&](int64_t ci, float* x) {
#pragma unroll
    for (int it = 0; it < C * SX / NT; ++it) {
      const int e = threadIdx.x + it * NT, i = e / SX, c = e % SX;
      const int64_t t = ci * C + i;
      x[it] = ci < nch && t < s.len && c < nc ? ld<T>(p.v, s.b, s.bos + t, h, x0 + c) : 0.f;
    }
  };
  auto store_hst = [&](int64_t ci) {
    float* dst = static_cast<float*>(p.hst) + (slot_of(ci) * p.H + h) * int64_t(K) * p.V + x0;
    for (int e = threadIdx.x; e < K * SX; e += NT)
      if (e % SX < nc) dst[int64_t(e / SX) * p.V + e % SX] = S[e];
  };

  for (int e = threadIdx.x; e < K * SX; e += NT) {
    const int d = e / SX, x = e % SX;
    S[e] = p.h0.on() && x < nc ? *mptr(p.h0, n, h, d, x0 + x) : 0.f;
  }
  float vx[C * SX / NT];
  if (nch > 0) fetch(0);
  fetch_v(0, vx);
  const float rho = float(p.scale);
  const int i = threadIdx.x / 16, xp = 2 * (threadIdx.x % 16);  // phase A: row i, columns xp, xp + 1
  for (int64_t ci = 0; ci < nch; ++ci) {
    const float* cur = sm + L.buf + (ci & 1) * L.stage;
    if (ci + 1 < nch) {
      fetch(ci + 1);
      copy_wait<1>();
    } else {
      copy_wait<0>();
    }
#pragma unroll
    for (int it = 0; it < C * SX / NT; ++it) Vt[threadIdx.x + it * NT] = vx[it];
    fetch_v(ci + 1, vx);
    __syncthreads();
    if (p.hst) store_hst(ci);
    {  // U = U0 + W S, o = O0 + scale Q~ S
      const float *wr = cur + ws.W() + i * KP4, *qr = cur + ws.Q() + i * KP4;
      float t0 = 0.f, t1 = 0.f, q0 = 0.f, q1 = 0.f;
#pragma unroll 4
      for (int d = 0; d < K; ++d) {
        const float2 sv = *reinterpret_cast<const float2*>(S + d * SX + xp);
        const float w = wr[d], q = qr[d];
        t0 += w * sv.x, t1 += w * sv.y, q0 += q * sv.x, q1 += q * sv.y;
      }
      const float* u0 = cur + ws.kpart() + i * SX + xp;
      const float* o0 = u0 + C * SX;
      U[i * SX + xp] = u0[0] + t0, U[i * SX + xp + 1] = u0[1] + t1;
      const int64_t t = ci * C + i;
      if (p.o.on() && t < s.len) {
        T* o = vptr<T>(p.o, s.b, s.bos + t, h, x0 + xp);
        if (xp < nc) o[0] = from_f<T>(o0[0] + rho * q0);
        if (xp + 1 < nc) o[p.o.sd] = from_f<T>(o0[1] + rho * q1);
      }
    }
    __syncthreads();
    // S+ = gamma S + K^^T V + B^^T U: thread owns rows 4 dg .. 4 dg + 3, columns xp, xp + 1.
    for (int dg = threadIdx.x / 16; 4 * dg < K; dg += NT / 16) {
      const int d0 = 4 * dg;
      float acc[4][2];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float g = cur[ws.gam() + d0 + r];
        const bool in = d0 + r < K;
        acc[r][0] = in ? g * S[(d0 + r) * SX + xp] : 0.f;
        acc[r][1] = in ? g * S[(d0 + r) * SX + xp + 1] : 0.f;
      }
#pragma unroll 4
      for (int j = 0; j < C; ++j) {
        const float4 kh = *reinterpret_cast<const float4*>(cur + ws.Kh() + j * KP4 + d0);
        const float4 bh = *reinterpret_cast<const float4*>(cur + ws.Bh() + j * KP4 + d0);
        const float2 v = *reinterpret_cast<const float2*>(Vt + j * SX + xp);
        const float2 u = *reinterpret_cast<const float2*>(U + j * SX + xp);
        const float kr[4] = {kh.x, kh.y, kh.z, kh.w}, br[4] = {bh.x, bh.y, bh.z, bh.w};
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          acc[r][0] += kr[r] * v.x + br[r] * u.x;
          acc[r][1] += kr[r] * v.y + br[r] * u.y;
        }
      }
#pragma unroll
      for (int r = 0; r < 4; ++r)
        if (d0 + r < K) S[(d0 + r) * SX + xp] = acc[r][0], S[(d0 + r) * SX + xp + 1] = acc[r][1];
    }
    __syncthreads();
  }
  if (p.hst) store_hst(nch);
  if (p.hT.on())
    for (int e = threadIdx.x; e < K * SX; e += NT)
      if (e % SX < nc) *mptr(p.hT, n, h, e / SX, x0 + e % SX) = S[e];
}

template <typename T>
__global__ void __launch_bounds__(NT) backward_kernel(const DplrChunkPass p) {
  extern __shared__ float sm[];
  const Smem L(p.K, true);
  const Cta c = cta(p);
  const int K = L.K, KP = L.KP, cols = L.cols, BP = L.BP;
  const float rho = float(p.scale);
  const int64_t nch = (c.s.len + C - 1) / C;

  // The state kernel left every chunk-start state and the final state in hst.
  for (int e = threadIdx.x; e < K * cols; e += NT)
    sm[L.S + e] = e % cols < c.nc ? *hst_at(p, c, nch, e / cols, e % cols) : 0.f;
  // Reverse chunk pass. On entry to chunk ci, S holds the state at its end and dS the
  // gradient there.
  load_state(sm + L.dS, L, p.dht, c);
  __syncthreads();
  for (int64_t ci = nch - 1; ci >= 0; --ci) {
    const int64_t t0 = ci * C;
    const int nrow = int(c.s.len - t0 < C ? c.s.len - t0 : C);
    for (int d = threadIdx.x; d < K; d += NT) {  // zeta = rowsum(S+ * dS+)
      float z = 0.f;
      for (int x = 0; x < cols; ++x) z += sm[L.S + d * cols + x] * sm[L.dS + d * cols + x];
      sm[L.zeta + d] = z;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < K * cols; e += NT)
      sm[L.S + e] = e % cols < c.nc ? *hst_at(p, c, ci, e / cols, e % cols) : 0.f;
    load_chunk<T>(sm, L, p, c, t0, nrow, true);
    __syncthreads();
    prepare(sm, L);
    pseudo_values(sm, L);

    // dU = scale A_rb^T dO + B^ dS+, then dM = X^T dU.
    for (int e = threadIdx.x; e < C * cols; e += NT) {
      const int j = e / cols, x = e % cols;
      float u = 0.f;
      for (int i = j; i < C; ++i) u += rho * sm[L.Arb + i * CP + j] * sm[L.dO + i * BP + x];
      for (int d = 0; d < K; ++d)
        u += sm[L.b + j * KP + d] * sm[L.eO + j * KP + d] * sm[L.dS + d * cols + x];
      sm[L.dU + j * BP + x] = u;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < C * cols; e += NT) {
      const int l = e / cols, x = e % cols;
      float m = 0.f;
      for (int i = l; i < C; ++i) m += sm[L.X + i * CP + l] * sm[L.dU + i * BP + x];
      sm[L.dM + l * BP + x] = m;
    }
    __syncthreads();
    {  // pair-matrix gradients; dX only below the diagonal (the rest cannot reach dA_ab)
      const int i = threadIdx.x / C, j = threadIdx.x % C, at = i * CP + j;
      float rk = 0.f, rb = 0.f, ak = 0.f, dx = 0.f;
      if (j <= i)
        for (int x = 0; x < cols; ++x) {
          const float o = sm[L.dO + i * BP + x];
          rk += o * sm[L.v + j * BP + x], rb += o * sm[L.U + j * BP + x];
          if (j < i) {
            ak += sm[L.dM + i * BP + x] * sm[L.v + j * BP + x];
            dx += sm[L.dU + i * BP + x] * (sm[L.M + j * BP + x] + sm[L.P + j * BP + x]);
          }
        }
      sm[L.dArk + at] = rho * rk, sm[L.dArb + at] = rho * rb, sm[L.dAak + at] = ak;
      sm[L.dX + at] = j < i ? dx : 0.f;
    }
    __syncthreads();
    {  // Y = X^T dX, then dA_ab = stril(Y X^T)
      const int i = threadIdx.x / C, q = threadIdx.x % C;
      float y = 0.f;
      for (int pp = 0; pp < C; ++pp) y += sm[L.X + pp * CP + i] * sm[L.dX + pp * CP + q];
      sm[L.Y + i * CP + q] = y;
    }
    __syncthreads();
    {
      const int i = threadIdx.x / C, j = threadIdx.x % C;
      float z = 0.f;
      if (j < i)
        for (int q = 0; q < C; ++q) z += sm[L.Y + i * CP + q] * sm[L.X + j * CP + q];
      sm[L.dAab + i * CP + j] = z;
    }
    __syncthreads();

    // dV = scale A_rk^T dO + A_ak^T dM + K^ dS+ (this tile's columns: final).
    for (int e = threadIdx.x; e < C * cols; e += NT) {
      const int j = e / cols, x = e % cols;
      if (j >= nrow || x >= c.nc) continue;
      float dv = 0.f;
      for (int i = j; i < C; ++i)
        dv += rho * sm[L.Ark + i * CP + j] * sm[L.dO + i * BP + x] +
              sm[L.Aak + i * CP + j] * sm[L.dM + i * BP + x];
      for (int d = 0; d < K; ++d)
        dv += sm[L.k + j * KP + d] * sm[L.eO + j * KP + d] * sm[L.dS + d * cols + x];
      *vptr<T>(p.dv, c.s.b, c.s.bos + t0 + j, c.h, c.x0 + x) = from_f<T>(dv);
    }
    // K-vector gradients of row i, channel d: state parts, then the pair parts (query-type
    // rows r, a over j <= i; key-type rows k, b over i' >= j), exponents added up.
    for (int e = threadIdx.x; e < C * K; e += NT) {
      const int i = e / K, d = e % K;
      float dr = 0.f, da = 0.f, dk = 0.f, db = 0.f;
      for (int x = 0; x < cols; ++x) {
        const float s = sm[L.S + d * cols + x], ds = sm[L.dS + d * cols + x];
        dr += sm[L.dO + i * BP + x] * s, da += sm[L.dM + i * BP + x] * s;
        dk += sm[L.v + i * BP + x] * ds, db += sm[L.U + i * BP + x] * ds;
      }
      const float eo = sm[L.eO + i * KP + d];
      dr *= rho * sm[L.eG + i * KP + d], da *= eE(sm, L, i, d), dk *= eo, db *= eo;
      const float* w = sm + L.w + d;
      dr += sm[L.dArk + i * CP + i] * sm[L.k + i * KP + d] +
            sm[L.dArb + i * CP + i] * sm[L.b + i * KP + d];
      float ex = 0.f;  // sum of w_s over j < s < i
      for (int j = i - 1; j >= 0; --j) {
        const float fex = expf(ex), fin = expf(ex + w[i * KP]);
        const float kj = sm[L.k + j * KP + d], bj = sm[L.b + j * KP + d];
        dr += (sm[L.dArk + i * CP + j] * kj + sm[L.dArb + i * CP + j] * bj) * fin;
        da += (sm[L.dAak + i * CP + j] * kj + sm[L.dAab + i * CP + j] * bj) * fex;
        ex += w[j * KP];
      }
      const int j = i;  // this row as the key
      dk += sm[L.dArk + j * CP + j] * sm[L.r + j * KP + d];
      db += sm[L.dArb + j * CP + j] * sm[L.r + j * KP + d];
      ex = 0.f;  // sum of w_s over j < s < i'
      for (int i2 = j + 1; i2 < C; ++i2) {
        const float nx = ex + w[i2 * KP];
        const float fex = expf(ex), fin = expf(nx);
        const float ri = sm[L.r + i2 * KP + d], ai = sm[L.a + i2 * KP + d];
        dk += sm[L.dArk + i2 * CP + j] * ri * fin + sm[L.dAak + i2 * CP + j] * ai * fex;
        db += sm[L.dArb + i2 * CP + j] * ri * fin + sm[L.dAab + i2 * CP + j] * ai * fex;
        ex = nx;
      }
      sm[L.gr + i * KP + d] = dr, sm[L.ga + i * KP + d] = da;
      sm[L.gk + i * KP + d] = dk, sm[L.gb + i * KP + d] = db;
    }
    __syncthreads();

    auto kg_at = [&](int g, int64_t t, int d) {
      VecArg v = p.kg;
      v.ptr = static_cast<const float*>(p.kg.ptr) + c.tile * p.kg_tile + g * p.kg_grad;
      return vptr<float>(v, c.s.b, t, c.h, d);
    };
    // dw = reverse cumsum + zeta (§6.4), exactly 0 where exp(w) == 0.
    for (int d = threadIdx.x; d < K; d += NT) {
      float acc = sm[L.zeta + d];
      for (int t = nrow - 1; t >= 0; --t) {
        const int at = t * KP + d;
        acc += sm[L.r + at] * sm[L.gr + at] - sm[L.k + at] * sm[L.gk + at] -
               sm[L.b + at] * sm[L.gb + at];
        if (expf(sm[L.w + at]) == 0.f) acc = 0.f;
        *kg_at(kGradW, c.s.bos + t0 + t, d) = acc;
        acc += sm[L.a + at] * sm[L.ga + at];
      }
    }
    for (int e = threadIdx.x; e < nrow * K; e += NT) {
      const int i = e / K, d = e % K, at = i * KP + d;
      const int64_t t = c.s.bos + t0 + i;
      *kg_at(kGradR, t, d) = sm[L.gr + at], *kg_at(kGradK, t, d) = sm[L.gk + at];
      *kg_at(kGradA, t, d) = sm[L.ga + at], *kg_at(kGradB, t, d) = sm[L.gb + at];
    }
    // dS of the previous chunk's end: diag(gamma) dS+ + scale R^^T dO + A^^T dM (each thread
    // reads and writes only its own element of dS).
    for (int e = threadIdx.x; e < K * cols; e += NT) {
      const int d = e / cols, x = e % cols;
      float s = sm[L.eG + (C - 1) * KP + d] * sm[L.dS + e];
      for (int i = 0; i < C; ++i)
        s += rho * sm[L.r + i * KP + d] * sm[L.eG + i * KP + d] * sm[L.dO + i * BP + x] +
             sm[L.a + i * KP + d] * eE(sm, L, i, d) * sm[L.dM + i * BP + x];
      sm[L.dS + e] = s;
    }
    __syncthreads();
  }
  store_state(p.dh0, sm + L.dS, L, c);
}

}  // namespace dplr_chunk_detail
}  // namespace fla
