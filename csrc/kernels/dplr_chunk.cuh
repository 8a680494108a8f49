// CUDA engine for the chunked RWKV7 algebra of kernels/dplr_chunk.h (the steps of
// cpu/dplr_chunk.cpp in fp32). Exact SIMT FMA everywhere for fp32 inputs; for bf16 / fp16 inputs
// the sweeps' state products and the grad kernel's state parts of the K-vector gradients run on
// TF32 tensor cores (fp32 accumulators and states; the pair matrices, X and every exponent stay
// SIMT fp32).
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
// Backward: prep and the forward sweep (for hst), the reverse sweep (dS+ at every chunk end),
// then one CTA of 256 threads per (chunk slot, head, tile of dplr_chunk_cols(K) columns) makes
// that chunk's gradients with the rows, pair matrices and the K x cols state and its gradient in
// shared memory; its K-vector gradients are per-tile partial sums, added into zero-filled slabs
// two tiles per slab (DplrArgs::kg_pair). No host synchronisation: CUDA-graph safe.
#pragma once
#include <cstring>
#include <type_traits>

#include "dplr_chunk.h"
#include "elements.cuh"
#include "tile_mma.cuh"

namespace fla {
namespace dplr_chunk_detail {

using elements::aligned16;
using elements::from_f;
using elements::ld;
using elements::mptr;
using elements::to_f;
using elements::vptr;

constexpr int C = kDplrChunk, CP = C + 1, NT = 256;
static_assert(NT == C * C, "one thread per pair (i, j) of a chunk");

// Pair matrices by 4-row micro-blocks, channels in slabs of PS (ALGORITHMS.md §1.2 references one
// level down). Pair workspace rows [C][PSP]: r~ = r exp(Rin), a~ = a exp(Rex) (exponents from
// the micro-block start, inclusive / exclusive), k~ = k exp(L), b~ = b exp(L) (to the micro-block
// end), and P1, P2, P3: the products of the last 1, 2, 3 exp(w) of the micro-block up to the row;
// then rows [PSP]: the gap factors of micro-block pairs (2,0), (3,1), (3,0) (exp of the totals
// strictly between), ones and zeros. Every exponent is a sum of w's, never a difference.
constexpr int MB = 4, PS = 64, PSP = PS + 4;  // PSP: conflict-free 16-byte row reads
constexpr int kPairRows = 7, kPairWs = kPairRows * C * PSP + 5 * PSP;

// Shared memory of one CTA, in floats. K-rows [C][KP] (KP: 16-byte aligned rows with 4 floats of
// padding, 0, so rows read as float4 and 16 rows' same channel spread over 8 banks), tile rows
// [C][BP], 16 x 16 matrices [C][CP], states [K][BP]; every array starts 16-byte aligned. The
// prep kernel (bwd = false) has no state and no P; the backward kernel has everything.
struct Smem {
  int K, KP, cols, lc, BP;  // lc = log2(cols); BP: row stride of tile rows and states
  int r, w, k, a, b, eG, eO, S, v, U, M, P, Ark, Arb, Aak, Aab, X;
  // Backward. dA: the four pair-matrix gradients interleaved, [C][C][4] = (dA_rk, dA_rb, dA_ak,
  // dA_ab) per pair, so that the K-vector gradients' pair walks read one float4 per pair.
  int dS, dO, dU, dM, gr, gk, ga, gb, dA, dX, Y, zeta;
  int pw;  // pair workspace (PairWs), 16-byte aligned; the backward's gr.. block when backward
  int stage;  // raw rows of the asynchronous loads: over pw (prep) or from gk on (backward)
  int total;

  __host__ __device__ Smem(int K_, bool bwd)
      : K(K_), KP((K_ + 3) / 4 * 4 + 4), cols(dplr_chunk_cols(K_)) {
    lc = cols == 32 ? 5 : 3;
    // cols + 4: 16-byte aligned rows (a thread's walk along a row reads float4), and the
    // K-vector gradients' float4 reads down a state column (lanes on channels) put the 8 lanes
    // of a 16-byte phase on different banks (cols apart: 32-way conflicts).
    BP = cols + 4;
    int o = 0;
    auto take = [&](int n) { const int at = o; o += (n + 3) / 4 * 4; return at; };
    r = take(C * KP), w = take(C * KP), k = take(C * KP), a = take(C * KP), b = take(C * KP);
    eG = take(C * KP), eO = take(C * KP), S = bwd ? take(K * BP) : 0;
    v = take(C * BP), U = take(C * BP), M = take(C * BP), P = bwd ? take(C * BP) : 0;
    Ark = take(C * CP), Arb = take(C * CP), Aak = take(C * CP), Aab = take(C * CP);
    X = take(C * CP);  // the five are consecutive (C * CP is a multiple of 4): mat_at
    dS = dO = dU = dM = gr = gk = ga = gb = dA = dX = Y = zeta = 0;
    if (bwd) {
      dS = take(K * BP), dO = take(C * BP), dU = take(C * BP), dM = take(C * BP);
      zeta = take(K);  // before the rows the pair workspace overlays
      gr = take(C * KP), gk = take(C * KP), ga = take(C * KP), gb = take(C * KP);
      dA = take(4 * C * C);
      dX = take(C * CP), Y = take(C * CP);
    }
    // Only prepare() uses the pair workspace, before the backward writes its gradient rows
    // (from gr on): it overlays them there (small K: it may reach past them).
    pw = bwd ? gr : take(kPairWs);
    total = o > pw + kPairWs ? o : pw + kPairWs;
    stage = bwd ? gk : pw;
  }
  __host__ __device__ size_t bytes() const { return size_t(total) * sizeof(float); }
};

struct Cta {
  int n, h, tile, x0, nc;
  SeqSpan s;
};

// exp(E_i) = exp(G_{i-1}), 1 on the first row.
__device__ __forceinline__ float eE(const float* sm, const Smem& L, int i, int d) {
  return i ? sm[L.eG + (i - 1) * L.KP + d] : 1.f;
}

// 16-byte global -> shared copy that does not wait (cp.async); `on` false writes zeros. The host
// branch (a synchronous copy) serves tests/cuda_emu, which runs these kernels on the CPU.
__device__ __forceinline__ void copy16(void* dst, const void* src, bool on) {
#ifdef __CUDA_ARCH__
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(on ? 16 : 0));
#else
  char* o = static_cast<char*>(dst);
  for (int i = 0; i < 16; ++i) o[i] = on ? static_cast<const char*>(src)[i] : 0;
#endif
}
// The same for one float (4-byte destinations, such as the 17-float rows of the 16 x 16 matrices).
__device__ __forceinline__ void copy4(float* dst, const float* src) {
#ifdef __CUDA_ARCH__
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src));
#else
  *dst = *src;
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

// Asynchronous chunk loads (DplrChunkPass::rows16): every activation row goes to shared memory
// by cp.async, 16 bytes at a time, so that all of a CTA's loads are in flight together and no
// thread waits on one before it issues the next (the element-wise loads below, each converted
// right after it arrives, were a third of prep's and grad's stall samples: ncu, NOTES c13).
// fp32 K-rows land in place; bf16 / fp16 K-rows, and the column rows of every dtype, land raw in
// a stage (at L.stage, over arrays not live yet) that widen_rows / widen_cols convert.
template <typename T>
constexpr int kPiece = 16 / int(sizeof(T));  // elements per 16-byte copy
template <typename T>
constexpr bool kRawRows = !std::is_same<T, float>::value;

// The copy loops split a flat piece index e into (e / n, e % n); n is usually a power of two
// (K, V or the tile width over the piece size), and a runtime division costs ~20 instructions per
// piece where a shift costs one (the sweep's fetch: 1.03 -> 0.83 ms, NOTES c13).
struct Split {
  int n, lg;  // lg = log2(n), or -1 when n is not a power of two
  __device__ __forceinline__ explicit Split(int n_) : n(n_), lg(0) {
    while ((1 << lg) < n) ++lg;
    if ((1 << lg) != n) lg = -1;
  }
  __device__ __forceinline__ int quot(int e) const { return lg >= 0 ? e >> lg : e / n; }
};

// Stage layout (T elements): K-rows [5][C][K] (r, w, k, a, b; raw dtypes only), then column rows
// [C][ncol] of v and, with dO, [C][ncol] of dO.
template <typename T>
FLA_HD int64_t stage_cols_at(int K) { return kRawRows<T> ? int64_t(5) * C * K : 0; }
template <typename T>
FLA_HD size_t stage_bytes(int K, int ncol, int ncolmats) {
  return size_t(stage_cols_at<T>(K) + int64_t(ncolmats) * C * ncol) * sizeof(T);
}

// DplrChunkPass::rows16 for these inputs: every activation row in whole 16-byte pieces at 16-byte
// aligned addresses, and the stages of prep (raw K-rows, then all of v, over the pair workspace)
// and of grad (raw K-rows, v and dO tile rows, from gk on) within the space they overlay.
constexpr int kSp = 4;  // S+ quads a grad thread holds in registers while its copies fly

template <typename T>
inline bool rows16(const DplrChunkPass& p) {
  constexpr int E = kPiece<T>;
  auto ok = [](const VecArg& v, int n) {
    return v.sd == 1 && n % E == 0 && v.sb % E == 0 && v.st % E == 0 && v.sh % E == 0 &&
           elements::aligned16(v.ptr);
  };
  if (!(ok(p.r, p.K) && ok(p.w, p.K) && ok(p.k, p.K) && ok(p.a, p.K) && ok(p.b, p.K) && ok(p.v, p.V)))
    return false;
  if (stage_bytes<T>(p.K, p.V, 1) > size_t(kPairWs) * sizeof(float)) return false;
  if (!p.backward()) return true;
  const Smem g(p.K, true);
  return ok(p.dout, p.V) && stage_bytes<T>(p.K, g.cols, 2) <= size_t(g.total - g.stage) * sizeof(float) &&
         elements::aligned16(p.hst) && elements::aligned16(p.dhst) && (p.K << (g.lc - 2)) <= kSp * NT;
}

// Issues the copies of rows [t0, t0 + nrow) of r, w, k, a, b (rows past nrow zero-filled).
template <typename T>
__device__ void copy_rows_async(float* sm, const Smem& L, const DplrChunkPass& p, const SeqSpan& s,
                                int h, int64_t t0, int nrow) {
  constexpr int E = kPiece<T>;
  const Split pk(L.K / E);
  T* const stage = reinterpret_cast<T*>(sm + L.stage);
  for (int e = threadIdx.x; e < 5 * C * pk.n; e += NT) {
    const int qi = pk.quot(e), c = (e - qi * pk.n) * E, q = qi / C, i = qi % C;
    const VecArg& v = q == 0 ? p.r : q == 1 ? p.w : q == 2 ? p.k : q == 3 ? p.a : p.b;
    const bool on = i < nrow;
    const T* src = on ? vptr<T>(v, s.b, s.bos + t0 + i, h, c) : static_cast<const T*>(v.ptr);
    if (kRawRows<T>) copy16(stage + qi * L.K + c, src, on);
    else copy16(sm + L.r + q * C * L.KP + i * L.KP + c, src, on);
  }
}
// Issues the copies of columns [x0, x0 + ncol) of rows [t0, t0 + nrow) of x into stage matrix m
// (columns at or past x0 + nvalid and rows past nrow zero-filled; ncol and nvalid whole pieces).
template <typename T>
__device__ void copy_cols_async(float* sm, const Smem& L, const VecArg& x, int m, const SeqSpan& s,
                                int h, int64_t t0, int nrow, int x0, int ncol, int nvalid) {
  constexpr int E = kPiece<T>;
  const Split pc(ncol / E);
  T* const stage = reinterpret_cast<T*>(sm + L.stage) + stage_cols_at<T>(L.K) + m * C * ncol;
  for (int e = threadIdx.x; e < C * pc.n; e += NT) {
    const int i = pc.quot(e), c = (e - i * pc.n) * E;
    const bool on = i < nrow && c < nvalid;
    copy16(stage + i * ncol + c, on ? vptr<T>(x, s.b, s.bos + t0 + i, h, x0 + c) : x.ptr, on);
  }
}
// Widens one 16-byte piece (E elements of T) to E floats at dst (16-byte aligned); zeros if !on.
template <typename T>
__device__ __forceinline__ void widen_piece(float* dst, const T* src, bool on) {
  constexpr int E = kPiece<T>;
  uint4 raw = make_uint4(0u, 0u, 0u, 0u);
  if (on) raw = *reinterpret_cast<const uint4*>(src);
  T v[E];
  memcpy(v, &raw, sizeof(raw));  // not a pointer cast: that would break strict aliasing
#pragma unroll
  for (int q = 0; q < E; q += 4)
    *reinterpret_cast<float4*>(dst + q) = make_float4(to_f(v[q]), to_f(v[q + 1]), to_f(v[q + 2]), to_f(v[q + 3]));
}
// After the wait and a barrier: raw K-rows to fp32, a piece per thread and step. Every dtype:
// the channel padding [K, KP) of the five row arrays to 0 (fp32 rows are in place already; no
// copy goes to the padding, so this may also run before the wait).
template <typename T>
__device__ void widen_rows(float* sm, const Smem& L) {
  constexpr int E = kPiece<T>;
  if (kRawRows<T>) {
    const T* const stage = reinterpret_cast<const T*>(sm + L.stage);
    const Split pk(L.K / E);
    for (int e = threadIdx.x; e < 5 * C * pk.n; e += NT) {  // arrays r..b are C * KP apart
      const int qi = pk.quot(e), c = (e - qi * pk.n) * E;
      widen_piece<T>(sm + L.r + qi * L.KP + c, stage + qi * L.K + c, true);
    }
  }
  const int pad = L.KP - L.K;
  for (int e = threadIdx.x; e < 5 * C * pad; e += NT) sm[L.r + e / pad * L.KP + L.K + e % pad] = 0.f;
}
// Columns [x0, x0 + cols) of stage matrix m (ncol columns per row) to a tile array [C][BP]
// (columns at or past ncol: 0).
template <typename T>
__device__ void widen_cols(float* sm, const Smem& L, int m, int ncol, int x0, int dst) {
  constexpr int E = kPiece<T>;
  const T* const stage = reinterpret_cast<const T*>(sm + L.stage) + stage_cols_at<T>(L.K) + m * C * ncol;
  const Split pc(L.cols / E);
  for (int e = threadIdx.x; e < C * pc.n; e += NT) {
    const int i = pc.quot(e), c = (e - i * pc.n) * E;
    widen_piece<T>(sm + dst + i * L.BP + c, stage + i * ncol + x0 + c, x0 + c < ncol);
  }
}

// Rows [t0, t0 + nrow) of the chunk's K-vectors into shared memory, padded to C rows with w = 0
// and every other input 0 (padding adds nothing, and exp(G) of the last row is the chunk's
// gamma). Thread: rows tid / 64 + 4 q, channels tid % 64 + 64 m (the row padding too: rows are
// read as float4); row addresses once per row, not per element.
template <typename T>
__device__ void load_rows(float* sm, const Smem& L, const DplrChunkPass& p, const SeqSpan& s,
                          int h, int64_t t0, int nrow) {
  for (int i = threadIdx.x / 64; i < C; i += NT / 64) {
    const bool row = i < nrow;
    const int64_t t = s.bos + t0 + i;
    const T *r = row ? vptr<T>(p.r, s.b, t, h, 0) : nullptr, *w = row ? vptr<T>(p.w, s.b, t, h, 0) : nullptr;
    const T *k = row ? vptr<T>(p.k, s.b, t, h, 0) : nullptr, *a = row ? vptr<T>(p.a, s.b, t, h, 0) : nullptr;
    const T* b = row ? vptr<T>(p.b, s.b, t, h, 0) : nullptr;
    for (int d = threadIdx.x % 64; d < L.KP; d += 64) {
      const bool on = row && d < L.K;
      const int at = i * L.KP + d;
      sm[L.r + at] = on ? to_f(r[d * p.r.sd]) : 0.f, sm[L.w + at] = on ? to_f(w[d * p.w.sd]) : 0.f;
      sm[L.k + at] = on ? to_f(k[d * p.k.sd]) : 0.f, sm[L.a + at] = on ? to_f(a[d * p.a.sd]) : 0.f;
      sm[L.b + at] = on ? to_f(b[d * p.b.sd]) : 0.f;
    }
  }
}
// The tile's v (and dO) rows; columns >= V of the tile and padded rows are 0.
template <typename T>
__device__ void load_cols(float* sm, const Smem& L, const DplrChunkPass& p, const SeqSpan& s,
                          int h, int x0, int nc, int64_t t0, int nrow, bool with_dout) {
  const int x = threadIdx.x & (L.cols - 1);
  for (int i = threadIdx.x >> L.lc; i < C; i += NT >> L.lc) {
    const bool ok = i < nrow && x < nc;
    const int64_t t = s.bos + t0 + i;
    sm[L.v + i * L.BP + x] = ok ? ld<T>(p.v, s.b, t, h, x0 + x) : 0.f;
    if (with_dout) sm[L.dO + i * L.BP + x] = ok ? ld<T>(p.dout, s.b, t, h, x0 + x) : 0.f;
  }
}
template <typename T>
__device__ void load_chunk(float* sm, const Smem& L, const DplrChunkPass& p, const Cta& c,
                           int64_t t0, int nrow, bool with_dout) {
  load_rows<T>(sm, L, p, c.s, c.h, t0, nrow);
  load_cols<T>(sm, L, p, c.s, c.h, c.x0, c.nc, t0, nrow, with_dout);
}

// The four pair-matrix entries of thread (i, j) over all channels (0 for j > i): A_rk, A_rb with
// exp(sum_{j<s<=i} w_s), A_ak, A_ab (j < i) with exp(sum_{j<s<i} w_s), as
//   rk = sum_c (R F_in)(K), rb = sum_c (R F_in)(B), ak = sum_c (A F_ex)(K), ab = sum_c (A F_ex)(B)
// with rows picked per pair so that every thread runs the same instructions: different
// micro-blocks take the prescaled rows and the gap factor (no exponential per pair); one
// micro-block the raw rows and the products P of at most three exp(w) (each <= 1; a few ulp);
// the diagonal raw rows, F_in = 1, F_ex = 0. The per-pair exponent walk this replaced put
// ~15 x K additions on the thread of pair (15, 0), and divergent paths serialised the warps.
__device__ inline void pair_matrices(float* sm, const Smem& L, float& rk, float& rb, float& ak,
                                     float& ab) {
  float* const pw = sm + L.pw;
  auto row = [&](int q, int i) { return pw + (q * C + i) * PSP; };  // q: 0 r~ 1 a~ 2 k~ 3 b~ 4.. P
  float* const gap = pw + kPairRows * C * PSP;
  float *const ones = gap + 3 * PSP, *const zeros = ones + PSP;
  const int K = L.K, KP = L.KP, i = threadIdx.x / C, j = threadIdx.x % C;
  const int mi = i / MB, mj = j / MB, dl = i - j;
  rk = rb = ak = ab = 0.f;
  for (int d0 = 0; d0 < K; d0 += PS) {
    const int nd = min(PS, K - d0);
    __syncthreads();
    {  // thread (micro-block m, slab channel c): its four rows
      const int m = threadIdx.x / PS, c = threadIdx.x % PS, d = d0 + c;
      const bool on = c < nd;
      float e = 0.f, p1 = 1.f, p2 = 1.f;  // p1, p2: exp(w) of the previous one and two rows
#pragma unroll
      for (int q = 0; q < MB; ++q) {  // from the micro-block start
        const int rw = m * MB + q, at_ = rw * KP + d;
        const float w = on ? sm[L.w + at_] : 0.f, ew = expf(w);
        row(1, rw)[c] = on ? sm[L.a + at_] * expf(e) : 0.f;
        e += w;
        row(0, rw)[c] = on ? sm[L.r + at_] * expf(e) : 0.f;
        row(4, rw)[c] = on ? ew : 0.f, row(5, rw)[c] = on ? ew * p1 : 0.f, row(6, rw)[c] = on ? ew * p2 : 0.f;
        p2 = ew * p1, p1 = ew;
      }
      float f = 0.f;
#pragma unroll
      for (int q = MB - 1; q >= 0; --q) {  // to the micro-block end
        const int rw = m * MB + q, at_ = rw * KP + d;
        row(2, rw)[c] = on ? sm[L.k + at_] * expf(f) : 0.f;
        row(3, rw)[c] = on ? sm[L.b + at_] * expf(f) : 0.f;
        f += on ? sm[L.w + at_] : 0.f;
      }
      if (m == 0) {  // gaps: totals of micro-blocks 1 and 2, added
        float t1 = 0.f, t2 = 0.f;
#pragma unroll
        for (int q = 0; q < MB; ++q)
          t1 += on ? sm[L.w + (MB + q) * KP + d] : 0.f, t2 += on ? sm[L.w + (2 * MB + q) * KP + d] : 0.f;
        gap[c] = expf(t1), gap[PSP + c] = expf(t2), gap[2 * PSP + c] = expf(t1 + t2);
        ones[c] = on ? 1.f : 0.f, zeros[c] = 0.f;
      }
    }
    __syncthreads();
    const float *R, *A, *Kr, *Br, *Fin, *Fex;
    if (mi != mj) {
      R = row(0, i), A = row(1, i), Kr = row(2, j), Br = row(3, j);
      Fin = Fex = mi < mj ? zeros : mi - mj == 1 ? ones : gap + (mi - mj == 3 ? 2 : mi - 2) * PSP;
    } else {  // raw rows at the slab (channels >= nd: the zeroed row padding, and F = 0 there)
      R = sm + L.r + i * KP + d0, A = sm + L.a + i * KP + d0;
      Kr = sm + L.k + j * KP + d0, Br = sm + L.b + j * KP + d0;
      Fin = dl == 0 ? ones : dl > 0 ? row(3 + dl, i) : zeros;
      Fex = dl <= 0 ? zeros : dl == 1 ? ones : row(2 + dl, i - 1);
    }
    const int n4 = mi != mj ? PS : (nd + 3) / 4 * 4;  // raw rows: no reads past the row's padding
    for (int c = 0; c < n4; c += 4) {
      const float4 r4 = *reinterpret_cast<const float4*>(R + c), a4 = *reinterpret_cast<const float4*>(A + c);
      const float4 k4 = *reinterpret_cast<const float4*>(Kr + c), b4 = *reinterpret_cast<const float4*>(Br + c);
      const float4 fi = *reinterpret_cast<const float4*>(Fin + c), fe = *reinterpret_cast<const float4*>(Fex + c);
      const float r[4] = {r4.x * fi.x, r4.y * fi.y, r4.z * fi.z, r4.w * fi.w};
      const float a[4] = {a4.x * fe.x, a4.y * fe.y, a4.z * fe.z, a4.w * fe.w};
      const float k[4] = {k4.x, k4.y, k4.z, k4.w}, b[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
      for (int u = 0; u < 4; ++u) rk += r[u] * k[u], rb += r[u] * b[u], ak += a[u] * k[u], ab += a[u] * b[u];
    }
  }
}

// exp(G) and exp(Omega) of a loaded chunk and, at `ah` when >= 0, Â = a exp(E) (rows [C][KP]).
// Four threads per channel, four rows each (all 256 threads: one thread per channel walking all
// 16 rows kept three warps in four at the next barrier, ~10 % of grad's stall samples). Every
// exponent is a sum of w's (the other rows' totals through shuffles), never a difference. Not
// synchronised.
__device__ inline void chunk_decays(float* sm, const Smem& L, int ah = -1) {
  static_assert(C == 16, "four rows per thread, four threads per channel");
  const int K = L.K, KP = L.KP, part = threadIdx.x % 4, r0 = 4 * part;
  for (int d0 = 0; d0 < K; d0 += NT / 4) {  // the same trip count on every lane: shuffles below
    const int d = d0 + threadIdx.x / 4;
    const bool on = d < K;
    float wl[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) wl[r] = on ? sm[L.w + (r0 + r) * KP + d] : 0.f;
    const float tot = wl[0] + wl[1] + wl[2] + wl[3];
    float before = 0.f, after = 0.f;  // totals of the rows before and after this thread's four
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float t = __shfl_sync(0xffffffffu, tot, q, 4);
      if (q < part) before += t;
      if (q > part) after += t;
    }
    if (!on) continue;
    float run = before, prev = part ? expf(before) : 1.f;  // prev = exp(E_i) = exp(G_{i-1})
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = r0 + r;
      if (ah >= 0) sm[ah + i * KP + d] = sm[L.a + i * KP + d] * prev;
      sm[L.eG + i * KP + d] = prev = expf(run += wl[r]);
    }
    run = after;
#pragma unroll
    for (int r = 3; r >= 0; --r) {
      sm[L.eO + (r0 + r) * KP + d] = expf(run);
      run += wl[r];
    }
  }
}

// The matrices of prepare() in shared memory, in the order of DplrWs::mats().
__device__ __forceinline__ int mat_at(const Smem& L, int m) { return L.Ark + m * C * CP; }

// 16-byte shared reads: rows of K-vectors and tiles and the state rows start 16-byte aligned
// (Smem), so a reduction along a row reads 4 terms per load instead of 1.
__device__ __forceinline__ float4 ld4(const float* q) { return *reinterpret_cast<const float4*>(q); }
__device__ __forceinline__ float dot4(const float4& a, const float4& b, float acc) {
  acc += a.x * b.x, acc += a.y * b.y, acc += a.z * b.z, acc += a.w * b.w;
  return acc;
}
// s0 += sum_d R[i][d] St[d][x] and s1 the same for row i + C / 2: two K-rows (arrays [C][KP]
// at offset R, 4 channels per read; nothing at or past K is read, where the padding may be
// unset) against column x of a [K][BP] state array at offset St.
__device__ __forceinline__ void rows_dot_state(const float* sm, const Smem& L, int R, int St,
                                               int i, int x, float& s0, float& s1) {
  const int BP = L.BP;
  const float *r0 = sm + R + i * L.KP, *r1 = r0 + (C / 2) * L.KP, *st = sm + St + x;
  int d = 0;
  for (; d + 4 <= L.K; d += 4) {
    const float4 s4 = make_float4(st[d * BP], st[(d + 1) * BP], st[(d + 2) * BP], st[(d + 3) * BP]);
    s0 = dot4(ld4(r0 + d), s4, s0), s1 = dot4(ld4(r1 + d), s4, s1);
  }
  for (; d < L.K; ++d) s0 += r0[d] * st[d * BP], s1 += r1[d] * st[d * BP];
}

// Everything of a loaded chunk that does not depend on the state: exp(G), exp(Omega), the pair
// matrices and X. Ends synchronised.
__device__ inline void prepare(float* sm, const Smem& L) {
  chunk_decays(sm, L);
  // X = (I - N)^-1 for the strictly lower N = A_ab by 4 x 4 blocks (ALGORITHMS.md §6.2): each
  // diagonal block by forward substitution down its columns, then the blocks 1, 2, 3 below the
  // diagonal, X_IJ = X_II sum_{L=J..I-1} N_IL X_LJ (blocks nearer the diagonal are done by
  // then). Every thread makes its own entry, so all warps work where a 15-step substitution on
  // one warp kept seven waiting (22 % of prep's stall samples). Not the product
  // (I + N)(I + N^2)(I + N^4)(I + N^8): for repeated keys with iclr = 1 the entries of N^k grow
  // like C(14, k - 1) while |X| <= 1, and the cancellation cost ~1e-4 in fp32 (tests: the
  // "repeated" low-rank regime). Every entry is written: the upper triangle is explicit zeros.
  const int i = threadIdx.x / C, j = threadIdx.x % C, at = i * CP + j;
  const int I = i / 4, J = j / 4;
  const float* const N = sm + L.Aab;
  float* const X = sm + L.X;
  {
    float rk, rb, ak, ab;
    pair_matrices(sm, L, rk, rb, ak, ab);
    sm[L.Ark + at] = rk, sm[L.Arb + at] = rb, sm[L.Aak + at] = ak, sm[L.Aab + at] = ab;
  }
  __syncthreads();
  if (I == J) {  // column j of the diagonal block, rows from its start (x = 0 above row j)
    const int b0 = 4 * I, jj = j - b0, ii = i - b0;
    float x[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float v = q == jj ? 1.f : 0.f;
#pragma unroll
      for (int l = 0; l < q; ++l) v += N[(b0 + q) * CP + b0 + l] * x[l];
      x[q] = v;
    }
    X[at] = ii == 0 ? x[0] : ii == 1 ? x[1] : ii == 2 ? x[2] : x[3];
  } else if (I < J) {
    X[at] = 0.f;
  }
  __syncthreads();
  for (int dist = 1; dist < C / 4; ++dist) {
    if (I - J == dist) {
      float acc = 0.f;
      for (int rp = 4 * I; rp <= i; ++rp) {
        float t = 0.f;
        for (int l = 4 * J; l < 4 * I; ++l) t += N[rp * CP + l] * X[l * CP + j];
        acc += X[i * CP + rp] * t;
      }
      X[at] = acc;
    }
    __syncthreads();
  }
}

// P = Â S, M = A_ak V, then U = X (M + P) (Â at `ah`, the 16 x 16 matrices zero-filled: fixed
// 16-term sums). Thread: column x, rows i and i + 8, so each state or tile element read serves
// two rows. Ends synchronised.
__device__ inline void pseudo_values(float* sm, const Smem& L, int ah) {
  const int BP = L.BP;
  for (int e = threadIdx.x; e < (C / 2) * L.cols; e += NT) {
    const int i = e >> L.lc, x = e & (L.cols - 1);
    const float *k0 = sm + L.Aak + i * CP, *k1 = k0 + (C / 2) * CP;
    float p0 = 0.f, p1 = 0.f, m0 = 0.f, m1 = 0.f;
    rows_dot_state(sm, L, ah, L.S, i, x, p0, p1);
#pragma unroll
    for (int jj = 0; jj < C; ++jj) {
      const float v = sm[L.v + jj * BP + x];
      m0 += k0[jj] * v, m1 += k1[jj] * v;
    }
    sm[L.P + i * BP + x] = p0, sm[L.M + i * BP + x] = m0;
    sm[L.P + (i + C / 2) * BP + x] = p1, sm[L.M + (i + C / 2) * BP + x] = m1;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < (C / 2) * L.cols; e += NT) {
    const int i = e >> L.lc, x = e & (L.cols - 1);
    const float *x0 = sm + L.X + i * CP, *x1 = x0 + (C / 2) * CP;
    float u0 = 0.f, u1 = 0.f;
#pragma unroll
    for (int l = 0; l < C; ++l) {
      const float mp = sm[L.M + l * BP + x] + sm[L.P + l * BP + x];
      u0 += x0[l] * mp, u1 += x1[l] * mp;
    }
    sm[L.U + i * BP + x] = u0, sm[L.U + (i + C / 2) * BP + x] = u1;
  }
  __syncthreads();
}

// Up to 4 consecutive floats from n >= 1 available (zeros past them): one 16-byte load when
// `vec` (aligned) and all 4 are there.
__device__ __forceinline__ float4 load4(const float* q, int n, bool vec) {
  if (vec && n >= 4) return *reinterpret_cast<const float4*>(q);
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (n > 0) v.x = q[0];
  if (n > 1) v.y = q[1];
  if (n > 2) v.z = q[2];
  if (n > 3) v.w = q[3];
  return v;
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
__device__ __forceinline__ float* dhst_at(const DplrChunkPass& p, const Cta& c, int64_t ci,
                                          int d, int x) {
  const int64_t slot = chunk_slot<kDplrChunk>(p.cu_seqlens, c.n, p.T, ci);
  return static_cast<float*>(p.dhst) + ((slot * p.H + c.h) * p.K + d) * int64_t(p.V) + c.x0 + x;
}

template <typename T>
__global__ void __launch_bounds__(NT, 3) prep_kernel(const DplrChunkPass p) {
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
  if (p.rows16) {
    copy_rows_async<T>(sm, L, p, s, h, t0, nrow);
    copy_commit();
    copy_wait<0>();
    __syncthreads();
    widen_rows<T>(sm, L);
  } else {
    load_rows<T>(sm, L, p, s, h, t0, nrow);
  }
  __syncthreads();
  prepare(sm, L);
  // All of v at once into the stage (over the pair workspace, free now), in flight during the
  // K-wide rows below; every column tile reads it.
  if (p.rows16) {
    copy_cols_async<T>(sm, L, p.v, 0, s, h, t0, nrow, 0, p.V, p.V);
    copy_commit();
  }
  float* out = static_cast<float*>(p.ws) + (slot * p.H + h) * ws.per();
  for (int e = threadIdx.x; e < 5 * C * C; e += NT)
    out[ws.mats() + e] = sm[mat_at(L, e / (C * C)) + e % (C * C) / C * CP + e % C];
  // K-wide rows: thread (channel d, row group g) holds channel d of all 16 rows of an operand in
  // registers and makes rows g, g + 4, ..; the triangular matrices are zero-filled, so every
  // product is a fixed 16-term sum. W = X Â goes through the w rows (w is not read again).
  {
    const int g = threadIdx.x / 64;
    for (int d0 = 0; d0 < ws.KP4; d0 += 64) {
      const int d = d0 + threadIdx.x % 64;
      const bool on = d < K;
      float x[C];
#pragma unroll
      for (int l = 0; l < C; ++l) x[l] = on ? sm[L.a + l * KP + d] * eE(sm, L, l, d) : 0.f;
#pragma unroll
      for (int i = g; i < C; i += 4) {
        float wv = 0.f;
#pragma unroll
        for (int l = 0; l < C; ++l) wv += sm[L.X + i * CP + l] * x[l];
        if (d < ws.KP4) sm[L.w + i * KP + d] = wv, out[ws.W() + i * ws.KP4 + d] = wv;
      }
      __syncthreads();
#pragma unroll
      for (int l = 0; l < C; ++l) x[l] = on ? sm[L.w + l * KP + d] : 0.f;
#pragma unroll
      for (int i = g; i < C; i += 4) {
        float q = on ? sm[L.r + i * KP + d] * sm[L.eG + i * KP + d] : 0.f;
#pragma unroll
        for (int j = 0; j < C; ++j) q += sm[L.Arb + i * CP + j] * x[j];
        if (d < ws.KP4) {
          const float eo = on ? sm[L.eO + i * KP + d] : 0.f;
          out[ws.Q() + i * ws.KP4 + d] = q;
          out[ws.Kh() + i * ws.KP4 + d] = eo * sm[L.k + i * KP + d];
          out[ws.Bh() + i * ws.KP4 + d] = eo * sm[L.b + i * KP + d];
        }
      }
      if (g == 0 && d < ws.KP4) out[ws.gam() + d] = on ? sm[L.eG + (C - 1) * KP + d] : 0.f;
      __syncthreads();
    }
  }
  // V columns in tiles of `cols`: thread (column x, row group g). U0 = X A_ak V, O0 = scale
  // (A_rk V + A_rb U0) (forward only); columns in [V, VP4) are written (0: v reads 0 there).
  const float rho = float(p.scale);
  const int x = threadIdx.x % cols, G = NT / cols, g = threadIdx.x / cols;
  for (int x0 = 0; x0 < p.V; x0 += cols) {
    if (p.rows16) {
      if (x0 == 0) {
        copy_wait<0>();
        __syncthreads();
      }
      widen_cols<T>(sm, L, 0, p.V, x0, L.v);
    } else {
      load_cols<T>(sm, L, p, s, h, x0, min(cols, p.V - x0), t0, nrow, false);
    }
    __syncthreads();
    const bool put = x0 + x < ws.VP4;
    float vc[C], y[C];
#pragma unroll
    for (int j = 0; j < C; ++j) vc[j] = sm[L.v + j * BP + x];
    for (int i = g; i < C; i += G) {
      float m = 0.f;
#pragma unroll
      for (int j = 0; j < C; ++j) m += sm[L.Aak + i * CP + j] * vc[j];
      sm[L.M + i * BP + x] = m;
    }
    __syncthreads();
#pragma unroll
    for (int l = 0; l < C; ++l) y[l] = sm[L.M + l * BP + x];
    for (int i = g; i < C; i += G) {
      float u = 0.f;
#pragma unroll
      for (int l = 0; l < C; ++l) u += sm[L.X + i * CP + l] * y[l];
      sm[L.U + i * BP + x] = u;
      if (put) out[ws.U0() + i * ws.VP4 + x0 + x] = u;
    }
    __syncthreads();
    if (p.backward()) continue;  // O0 only serves the forward's o
#pragma unroll
    for (int l = 0; l < C; ++l) y[l] = sm[L.U + l * BP + x];
    for (int i = g; i < C; i += G) {
      float o = 0.f;
#pragma unroll
      for (int j = 0; j < C; ++j) o += sm[L.Ark + i * CP + j] * vc[j] + sm[L.Arb + i * CP + j] * y[j];
      if (put) out[ws.O0() + i * ws.VP4 + x0 + x] = rho * o;
    }
    __syncthreads();
  }
}

constexpr int SX = 32, NTS = 256;  // state columns and threads per CTA
// Row stride of the column arrays (state, U, v rows, U0, O0): 8 mod 32, so that the TF32 B
// fragments (lanes (g, q) read row k + q, column n0 + g) fall on 32 different banks.
constexpr int SXP = SX + 8;
static_assert(NTS == C * SX / 2, "phase A: one thread per row and column pair");
FLA_HD int state_tiles(int V) { return (V + SX - 1) / SX; }
// Shared memory (floats): S [K][SXP], U, Vt [C][SXP], then two stages of a chunk's workspace
// block, rows padded: W, Q~, K^, B^ [C][KS] (KS = KP4 + 4: the A fragments' rows g = 0..7 on
// different banks), gamma [KP4], U0, O0 [C][SXP].
struct StateSmem {
  int KS, S, U, Vt, buf, sW, sQ, sKh, sBh, sGam, sU0, sO0, stage, total;
  FLA_HD StateSmem(const DplrWs& ws, int K) : KS(ws.KP4 + 4) {
    S = 0, U = K * SXP, Vt = U + C * SXP, buf = Vt + C * SXP;
    sW = 0, sQ = C * KS, sKh = 2 * C * KS, sBh = 3 * C * KS, sGam = 4 * C * KS;
    sU0 = sGam + ws.KP4, sO0 = sU0 + C * SXP, stage = sO0 + C * SXP;
    total = buf + 2 * stage;
  }
  FLA_HD size_t bytes() const { return size_t(total) * sizeof(float); }
};

// The sweeps' two products for bf16/fp16 inputs, on TF32 tensor cores (tile_mma.cuh's mma_tf32;
// fp32 inputs keep exact SIMT FMA). Operands are cut to TF32 where the inputs carry 8-11
// significant bits; the state itself stays fp32 (it is the accumulator, not an operand, in S+).
// acc (this lane's m16n8 elements) += A[m0.., 0..kn) B[0..kn), n0..) with A(r, k) and B(k, n)
// given as functions (the caller masks rows and k past the live range to 0).
template <class A, class B>
__device__ __forceinline__ void warp_mma(float* acc, int kn, A a, B b) {
  const int g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
  for (int k = 0; k < kn; k += 8)
    tile::mma_tf32(acc, tile::to_tf32(a(g, k + q)), tile::to_tf32(a(g + 8, k + q)),
                   tile::to_tf32(a(g, k + q + 4)), tile::to_tf32(a(g + 8, k + q + 4)),
                   tile::to_tf32(b(k + q, g)), tile::to_tf32(b(k + q + 4, g)));
}
// Row and column of this lane's accumulator element e (0..3) in an m16n8 tile at (m0, n0).
__device__ __forceinline__ int acc_row(int m0, int e) { return m0 + threadIdx.x % 32 / 4 + 8 * (e / 2); }
__device__ __forceinline__ int acc_col(int n0, int e) { return n0 + 2 * (threadIdx.x % 4) + e % 2; }

// The sequential passes: one CTA of NTS threads per (sequence, head, SX state columns), walking
// the chunks with the K x SX slice in shared memory and the next chunk's workspace block copied
// asynchronously while the current one is used. The backward pass is the forward's transpose:
//   forward  (REV = false)  T = W S, U = U0 + T, o = O0 + scale Q~ S;  S  = gamma S + K^^T V + B^^T U
//   backward (REV = true)   T = B^ D;                                  D  = gamma D + Q~^T (scale dO) + W^T T
// (D = dS+ at a chunk's end, ALGORITHMS.md §6.4: dS = gamma dS+ + scale R^^T dO + W^T dU with
// dU = scale A_rb^T dO + B^ dS+, and Q~ = R^ + A_rb W.) The forward stores the chunk-start
// states in hst (when asked) and the final one after them; the backward stores every D in dhst.
// Tried (NOTES c9, c13): 16 columns on 128 threads (SIMT: 15 % slower; TF32: equal at K = 64,
// 35 % slower at K = 128), three workspace stages instead of two (SIMT: 8 % slower).
// OUT: the forward computes o (false in the forward sweep of a backward call, which only makes
// hst: no O0 copies, no Q~ S).
template <typename T, bool REV, bool OUT = !REV>  // two CTAs per SM: at most 128 registers
__global__ void __launch_bounds__(NTS, 512 / NTS) sweep_kernel(const DplrChunkPass p) {
  constexpr bool TC = !std::is_same<T, float>::value;
  extern __shared__ float4 sm4[];
  float* sm = reinterpret_cast<float*>(sm4);
  const DplrWs ws(p.K, p.V);
  const StateSmem L(ws, p.K);
  const int K = p.K, KS = L.KS, tiles = state_tiles(p.V);
  const int tile = blockIdx.x % tiles, nh = blockIdx.x / tiles, h = nh % p.H, n = nh / p.H;
  const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
  const int x0 = tile * SX, nc = min(SX, p.V - x0);
  const int64_t nch = (s.len + C - 1) / C;
  float *S = sm + L.S, *U = sm + L.U, *Vt = sm + L.Vt;  // S: the state or D; U: U or T
  const float* wsb = static_cast<const float*>(p.ws);
  const float rho = float(p.scale);
  auto slot_of = [&](int64_t ci) { return chunk_slot<C>(p.cu_seqlens, n, p.T, ci); };
  auto chunk_of = [&](int64_t step) { return REV ? nch - 1 - step : step; };

  const bool want_o = OUT && p.o.on();
  const Split q4(ws.KP4 / 4);  // 16-byte pieces per workspace K-row
  // Step `step`'s workspace block (W .. gamma whole, rows re-strided to KS; forward: U0 and, for
  // o, O0 at this tile's columns).
  auto fetch = [&](int64_t step) {
    float* dst = sm + L.buf + (step & 1) * L.stage;
    const float* src = wsb + (slot_of(chunk_of(step)) * p.H + h) * ws.per();
    for (int e = threadIdx.x; e < (4 * C + 1) * q4.n; e += NTS) {  // row 4C is gamma
      const int row = q4.quot(e), c = 4 * (e - row * q4.n);
      copy16(dst + row * KS + c, src + row * ws.KP4 + c, true);
    }
    if (!REV)
      for (int e = threadIdx.x; e < (want_o ? 2 : 1) * C * (SX / 4); e += NTS) {
        const int mtx = e / (C * SX / 4), i = e / (SX / 4) % C, q = e % (SX / 4), col = x0 + 4 * q;
        const bool on = col < ws.VP4;
        copy16(dst + L.sU0 + (mtx * C + i) * SXP + 4 * q,
               src + ws.U0() + (mtx * C + i) * ws.VP4 + (on ? col : 0), on);
      }
    copy_commit();
  };
  // Step `step`'s rows of v (forward) or dO (backward) at this tile's columns, two per thread (0
  // outside), kept in T until the next step stores them: converting right after the load made
  // every step wait for it (ncu: 18 % of the sweep's stall samples on that conversion).
  auto fetch_rows = [&](int64_t step, T* x) {
    const int64_t ci = chunk_of(step);
#pragma unroll
    for (int it = 0; it < C * SX / NTS; ++it) {
      const int e = threadIdx.x + it * NTS, i = e / SX, c = e % SX;
      const int64_t t = ci * C + i;
      const bool on = step < nch && t < s.len && c < nc;
      x[it] = on ? *vptr<T>(REV ? p.dout : p.v, s.b, s.bos + t, h, x0 + c) : from_f<T>(0.f);
    }
  };
  auto store_state_at = [&](void* dst_base, int64_t ci) {
    float* dst = static_cast<float*>(dst_base) + (slot_of(ci) * p.H + h) * int64_t(K) * p.V + x0;
    for (int e = threadIdx.x; e < K * SX; e += NTS)
      if (e % SX < nc) dst[int64_t(e / SX) * p.V + e % SX] = S[e / SX * SXP + e % SX];
  };
  auto store_o = [&](int64_t ci, int i, int x, float v) {
    const int64_t t = ci * C + i;
    if (t < s.len && x < nc) *vptr<T>(p.o, s.b, s.bos + t, h, x0 + x) = from_f<T>(v);
  };

  const MatArg& init = REV ? p.dht : p.h0;
  for (int e = threadIdx.x; e < K * SX; e += NTS) {
    const int d = e / SX, x = e % SX;
    S[d * SXP + x] = init.on() && x < nc ? *mptr(init, n, h, d, x0 + x) : 0.f;
  }
  T vx[C * SX / NTS];
  if (nch > 0) fetch(0);
  fetch_rows(0, vx);
  const int i = threadIdx.x / (SX / 2), xp = 2 * (threadIdx.x % (SX / 2));  // phase A: row i, columns xp, xp + 1
  const int warp = threadIdx.x / 32;
  for (int64_t step = 0; step < nch; ++step) {
    const int64_t ci = chunk_of(step);
    const float* cur = sm + L.buf + (step & 1) * L.stage;
    if (step + 1 < nch) {
      fetch(step + 1);
      copy_wait<1>();
    } else {
      copy_wait<0>();
    }
#pragma unroll
    for (int it = 0; it < C * SX / NTS; ++it) {
      const int e = threadIdx.x + it * NTS;
      Vt[e / SX * SXP + e % SX] = REV ? rho * to_f(vx[it]) : to_f(vx[it]);
    }
    fetch_rows(step + 1, vx);
    __syncthreads();
    if (REV) store_state_at(p.dhst, ci);
    else if (p.hst) store_state_at(p.hst, ci);
    if (TC) {
      // Phase A, one m16n8 tile per warp: columns 8 (warp % NN), product T (the first NN warps)
      // or Q~ S (the next NN, forward with o).
      constexpr int NN = SX / 8;
      static_assert(2 * NN <= NTS / 32, "a warp per phase-A tile");
      if (warp < (OUT ? 2 : 1) * NN) {
        const int n0 = 8 * (warp % NN);
        const float* A = cur + (REV ? L.sBh : warp < NN ? L.sW : L.sQ);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        warp_mma(acc, K, [&](int r, int k) { return k < K ? A[r * KS + k] : 0.f; },
                 [&](int k, int c) { return k < K ? S[k * SXP + n0 + c] : 0.f; });
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = acc_row(0, e), x = acc_col(n0, e);
          if (REV) U[r * SXP + x] = acc[e];
          else if (warp < NN) U[r * SXP + x] = cur[L.sU0 + r * SXP + x] + acc[e];
          else if (want_o) store_o(ci, r, x, cur[L.sO0 + r * SXP + x] + rho * acc[e]);
        }
      }
    } else if (REV) {  // T = B^ D
      const float* br = cur + L.sBh + i * KS;
      float t0 = 0.f, t1 = 0.f;
#pragma unroll 4
      for (int d = 0; d < K; ++d) {
        const float2 sv = *reinterpret_cast<const float2*>(S + d * SXP + xp);
        t0 += br[d] * sv.x, t1 += br[d] * sv.y;
      }
      U[i * SXP + xp] = t0, U[i * SXP + xp + 1] = t1;
    } else {  // U = U0 + W S, o = O0 + scale Q~ S
      const float *wr = cur + L.sW + i * KS, *qr = cur + L.sQ + i * KS;
      float t0 = 0.f, t1 = 0.f, q0 = 0.f, q1 = 0.f;
#pragma unroll 4
      for (int d = 0; d < K; ++d) {
        const float2 sv = *reinterpret_cast<const float2*>(S + d * SXP + xp);
        const float w = wr[d];
        t0 += w * sv.x, t1 += w * sv.y;
        if (OUT) {
          const float q = qr[d];
          q0 += q * sv.x, q1 += q * sv.y;
        }
      }
      const float* u0 = cur + L.sU0 + i * SXP + xp;
      const float* o0 = u0 + C * SXP;
      U[i * SXP + xp] = u0[0] + t0, U[i * SXP + xp + 1] = u0[1] + t1;
      if (want_o) store_o(ci, i, xp, o0[0] + rho * q0), store_o(ci, i, xp + 1, o0[1] + rho * q1);
    }
    __syncthreads();
    // S = gamma S + X1^T Vt + X2^T U with (X1, X2) = (K^, B^) forward, (Q~, W) backward.
    const float* x1 = cur + (REV ? L.sQ : L.sKh);
    const float* x2 = cur + (REV ? L.sW : L.sBh);
    const float* gam = cur + L.sGam;
    if (TC) {  // m16n8 tiles (16 state rows, 8 columns), warp-strided; each element has one owner
      for (int tl = warp; tl < (K + 15) / 16 * (SX / 8); tl += NTS / 32) {
        const int m0 = 16 * (tl / (SX / 8)), n0 = 8 * (tl % (SX / 8));
        float acc[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int d = acc_row(m0, e);
          acc[e] = d < K ? gam[d] * S[d * SXP + acc_col(n0, e)] : 0.f;
        }
        warp_mma(acc, C, [&](int r, int j) { return m0 + r < K ? x1[j * KS + m0 + r] : 0.f; },
                 [&](int j, int c) { return Vt[j * SXP + n0 + c]; });
        warp_mma(acc, C, [&](int r, int j) { return m0 + r < K ? x2[j * KS + m0 + r] : 0.f; },
                 [&](int j, int c) { return U[j * SXP + n0 + c]; });
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int d = acc_row(m0, e);
          if (d < K) S[d * SXP + acc_col(n0, e)] = acc[e];
        }
      }
    } else {  // thread: rows 4 dg .. 4 dg + 3, columns xp, xp + 1
      for (int dg = threadIdx.x / (SX / 2); 4 * dg < K; dg += NTS / (SX / 2)) {
        const int d0 = 4 * dg;
        float acc[4][2];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float g = gam[d0 + r];
          const bool in = d0 + r < K;
          acc[r][0] = in ? g * S[(d0 + r) * SXP + xp] : 0.f;
          acc[r][1] = in ? g * S[(d0 + r) * SXP + xp + 1] : 0.f;
        }
#pragma unroll 4
        for (int j = 0; j < C; ++j) {
          const float4 a4 = *reinterpret_cast<const float4*>(x1 + j * KS + d0);
          const float4 b4 = *reinterpret_cast<const float4*>(x2 + j * KS + d0);
          const float2 v = *reinterpret_cast<const float2*>(Vt + j * SXP + xp);
          const float2 u = *reinterpret_cast<const float2*>(U + j * SXP + xp);
          const float ar[4] = {a4.x, a4.y, a4.z, a4.w}, br[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            acc[r][0] += ar[r] * v.x + br[r] * u.x;
            acc[r][1] += ar[r] * v.y + br[r] * u.y;
          }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r)
          if (d0 + r < K) S[(d0 + r) * SXP + xp] = acc[r][0], S[(d0 + r) * SXP + xp + 1] = acc[r][1];
      }
    }
    __syncthreads();
  }
  const MatArg& fin = REV ? p.dh0 : p.hT;
  if (!REV && p.hst) store_state_at(p.hst, nch);
  if (fin.on())
    for (int e = threadIdx.x; e < K * SX; e += NTS)
      if (e % SX < nc) *mptr(fin, n, h, e / SX, x0 + e % SX) = S[e / SX * SXP + e % SX];
}

// The backward's gradients, parallel over (chunk slot, head, tile of dplr_chunk_cols(K)
// columns): with S (hst), S+ and dS+ (dhst, from the reverse sweep) known, every chunk's
// gradients are independent. The pair matrices and X come from the prep workspace.
template <typename T>
__global__ void __launch_bounds__(NT) grad_kernel(const DplrChunkPass p) {
  constexpr bool TC = !std::is_same<T, float>::value;
  extern __shared__ float4 sm4[];  // 16-byte aligned: the state rows are stored as float4
  float* sm = reinterpret_cast<float*>(sm4);
  const Smem L(p.K, true);
  const DplrWs ws(p.K, p.V);
  const int64_t slot = blockIdx.x;
  const int n = slot_sequence<C>(p.cu_seqlens, p.N, p.T, slot);
  Cta c;
  c.h = blockIdx.y, c.n = n, c.tile = blockIdx.z, c.s = seq_span(p.cu_seqlens, n, p.T);
  c.x0 = c.tile * L.cols, c.nc = min(L.cols, p.V - c.x0);
  const int64_t ci = slot - chunk_slot<C>(p.cu_seqlens, n, p.T, 0);
  if (ci < 0 || ci * C >= c.s.len) return;
  const int K = L.K, KP = L.KP, cols = L.cols, BP = L.BP;
  const float rho = float(p.scale);
  {
    const int64_t t0 = ci * C;
    const int nrow = int(c.s.len - t0 < C ? c.s.len - t0 : C);
    const float* mats = static_cast<const float*>(p.ws) + (slot * p.H + c.h) * ws.per() + ws.mats();
    // S (hst at this chunk), S+ (the next slot: the next chunk's start or the final state) and
    // dS+ at this tile's columns, 4 per thread. zeta = rowsum(S+ * dS+) with S+ from registers
    // (it is not kept): partial sums per 4 columns in the gradient rows' space, which is written
    // only after zeta is summed.
    const float *s0 = hst_at(p, c, ci, 0, 0), *s1 = hst_at(p, c, ci + 1, 0, 0);
    const float* d1 = dhst_at(p, c, ci, 0, 0);
    const int lq = L.lc - 2;  // log2(column quads per row)
    auto quad = [&](int e, int& d, int& x) { d = e >> lq, x = 4 * (e & ((1 << lq) - 1)); };
    if (p.rows16) {
      // Everything in flight before any wait: rows, v, dO, the matrices, S and dS+ by cp.async,
      // S+ into registers (at most kSp quads per thread: DplrChunkPass::rows16), consumed after.
      copy_rows_async<T>(sm, L, p, c.s, c.h, t0, nrow);
      copy_cols_async<T>(sm, L, p.v, 0, c.s, c.h, t0, nrow, c.x0, cols, c.nc);
      copy_cols_async<T>(sm, L, p.dout, 1, c.s, c.h, t0, nrow, c.x0, cols, c.nc);
      for (int e = threadIdx.x; e < 5 * C * C; e += NT)
        copy4(sm + mat_at(L, e / (C * C)) + e % (C * C) / C * CP + e % C, mats + e);
      float4 sp[kSp];
#pragma unroll
      for (int it = 0; it < kSp; ++it) {
        int d, x;
        quad(threadIdx.x + it * NT, d, x);
        if (d < K) {
          const int64_t at = int64_t(d) * p.V + x;
          copy16(sm + L.S + d * BP + x, s0 + at, x < c.nc);
          copy16(sm + L.dS + d * BP + x, d1 + at, x < c.nc);
        }
      }
      copy_commit();
#pragma unroll
      for (int it = 0; it < kSp; ++it) {
        int d, x;
        quad(threadIdx.x + it * NT, d, x);
        if (d < K) sp[it] = load4(s1 + int64_t(d) * p.V + x, c.nc - x, true);
      }
      if (!kRawRows<T>) widen_rows<T>(sm, L);  // fp32: the channel padding only
      copy_wait<0>();
      __syncthreads();
      if (kRawRows<T>) widen_rows<T>(sm, L);
      widen_cols<T>(sm, L, 0, cols, 0, L.v);
      widen_cols<T>(sm, L, 1, cols, 0, L.dO);
#pragma unroll
      for (int it = 0; it < kSp; ++it) {
        int d, x;
        const int e = threadIdx.x + it * NT;
        quad(e, d, x);
        if (d < K) {
          const float4 g = ld4(sm + L.dS + d * BP + x), b = sp[it];
          sm[L.gr + e] = b.x * g.x + b.y * g.y + b.z * g.z + b.w * g.w;
        }
      }
    } else {
      const bool vec = p.V % 4 == 0 && aligned16(p.hst) && aligned16(p.dhst);
#pragma unroll 2
      for (int e = threadIdx.x; e < K << lq; e += NT) {
        int d, x;
        quad(e, d, x);
        const int64_t at = int64_t(d) * p.V + x;
        const float4 a = load4(s0 + at, c.nc - x, vec), b = load4(s1 + at, c.nc - x, vec);
        const float4 g = load4(d1 + at, c.nc - x, vec);
        *reinterpret_cast<float4*>(sm + L.S + d * BP + x) = a;
        *reinterpret_cast<float4*>(sm + L.dS + d * BP + x) = g;
        sm[L.gr + e] = b.x * g.x + b.y * g.y + b.z * g.z + b.w * g.w;
      }
      load_chunk<T>(sm, L, p, c, t0, nrow, true);
      for (int e = threadIdx.x; e < 5 * C * C; e += NT)
        sm[mat_at(L, e / (C * C)) + e % (C * C) / C * CP + e % C] = mats[e];
    }
    __syncthreads();
    for (int d = threadIdx.x; d < K; d += NT) {
      float z = 0.f;
      for (int q = 0; q < cols / 4; ++q) z += sm[L.gr + d * (cols / 4) + q];
      sm[L.zeta + d] = z;
    }
    chunk_decays(sm, L, L.ga);  // Â in the gradient rows' space (written after P is made)
    __syncthreads();
    // exp(w) in place of w: the pair parts of the K-vector gradients multiply the factors up
    // (products of <= 15 factors <= 1, a few ulp) instead of exponentiating sums per pair. K^ =
    // k exp(Omega) and B^ = b exp(Omega) in the gradient rows gk, gb (free until the K-vector
    // gradients write them), 0 on the channel padding where exp(Omega) is not set.
    for (int e = threadIdx.x; e < C * KP; e += NT) {
      const bool on = e % KP < K;
      sm[L.w + e] = on ? expf(sm[L.w + e]) : 0.f;
      sm[L.gk + e] = on ? sm[L.k + e] * sm[L.eO + e] : 0.f;
      sm[L.gb + e] = on ? sm[L.b + e] * sm[L.eO + e] : 0.f;
    }
    pseudo_values(sm, L, L.ga);

    // Thread (column x, rows j and j + 8) in the loops over tile rows, so that each state or
    // tile element read serves two rows; 4 channels per K-row read.
    const int x = threadIdx.x & (cols - 1), j0 = threadIdx.x >> L.lc;
    const bool rows2 = j0 < C / 2;  // all 256 threads when cols = 32

    // dU = scale A_rb^T dO + B^ dS+, then dM = X^T dU (the 16 x 16 matrices are zero-filled
    // outside their triangles: fixed 16-term sums).
    if (rows2) {
      float u0 = 0.f, u1 = 0.f;
      for (int i = 0; i < C; ++i) {
        const float o = rho * sm[L.dO + i * BP + x];
        u0 += sm[L.Arb + i * CP + j0] * o, u1 += sm[L.Arb + i * CP + j0 + C / 2] * o;
      }
      rows_dot_state(sm, L, L.gb, L.dS, j0, x, u0, u1);
      sm[L.dU + j0 * BP + x] = u0, sm[L.dU + (j0 + C / 2) * BP + x] = u1;
    }
    __syncthreads();
    if (rows2) {
      float m0 = 0.f, m1 = 0.f;
      for (int i = 0; i < C; ++i) {
        const float du = sm[L.dU + i * BP + x];
        m0 += sm[L.X + i * CP + j0] * du, m1 += sm[L.X + i * CP + j0 + C / 2] * du;
      }
      sm[L.dM + j0 * BP + x] = m0, sm[L.dM + (j0 + C / 2) * BP + x] = m1;
    }
    __syncthreads();
    {  // pair-matrix gradients; dX only below the diagonal (the rest cannot reach dA_ab)
      const int i = threadIdx.x / C, j = threadIdx.x % C, at = i * CP + j;
      float rk = 0.f, rb = 0.f, ak = 0.f, dx = 0.f;
      if (j <= i)
        for (int q = 0; q < cols; q += 4) {
          const float4 o = ld4(sm + L.dO + i * BP + q), vj = ld4(sm + L.v + j * BP + q);
          rk = dot4(o, vj, rk), rb = dot4(o, ld4(sm + L.U + j * BP + q), rb);
          if (j < i) {
            const float4 m = ld4(sm + L.M + j * BP + q), pp = ld4(sm + L.P + j * BP + q);
            ak = dot4(ld4(sm + L.dM + i * BP + q), vj, ak);
            dx = dot4(ld4(sm + L.dU + i * BP + q),
                      make_float4(m.x + pp.x, m.y + pp.y, m.z + pp.z, m.w + pp.w), dx);
          }
        }
      *reinterpret_cast<float4*>(sm + L.dA + 4 * (i * C + j)) = make_float4(rho * rk, rho * rb, ak, 0.f);
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
      sm[L.dA + 4 * (i * C + j) + 3] = z;
    }

    // dV = scale A_rk^T dO + A_ak^T dM + K^ dS+ (this tile's columns: final).
    if (rows2) {
      float v0 = 0.f, v1 = 0.f;
      for (int i = 0; i < C; ++i) {
        const float o = rho * sm[L.dO + i * BP + x], m = sm[L.dM + i * BP + x];
        v0 += sm[L.Ark + i * CP + j0] * o + sm[L.Aak + i * CP + j0] * m;
        v1 += sm[L.Ark + i * CP + j0 + C / 2] * o + sm[L.Aak + i * CP + j0 + C / 2] * m;
      }
      rows_dot_state(sm, L, L.gk, L.dS, j0, x, v0, v1);
      if (x < c.nc) {
        if (j0 < nrow) *vptr<T>(p.dv, c.s.b, c.s.bos + t0 + j0, c.h, c.x0 + x) = from_f<T>(v0);
        if (j0 + C / 2 < nrow)
          *vptr<T>(p.dv, c.s.b, c.s.bos + t0 + j0 + C / 2, c.h, c.x0 + x) = from_f<T>(v1);
      }
    }
    __syncthreads();  // dA_ab complete; K^, B^ read: the gradient rows are written below
    // bf16 / fp16: the state parts of the K-vector gradients, dO S^T, dM S^T, v dS^T, U dS^T
    // ([C][K] over this tile's columns), on TF32 tensor cores into the gradient rows (the SIMT
    // sums below were a quarter of grad's instructions); fp32 keeps the exact sums below.
    if (TC) {
      const int ntile = (K + 7) / 8;
      for (int task = threadIdx.x / 32; task < 4 * ntile; task += NT / 32) {
        const int m = task / ntile, n0 = 8 * (task % ntile);
        const int A = m == 0 ? L.dO : m == 1 ? L.dM : m == 2 ? L.v : L.U, B = m < 2 ? L.S : L.dS;
        const int D = m == 0 ? L.gr : m == 1 ? L.ga : m == 2 ? L.gk : L.gb;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        warp_mma(acc, cols, [&](int r, int k) { return sm[A + r * BP + k]; },
                 [&](int k, int n) { return n0 + n < K ? sm[B + (n0 + n) * BP + k] : 0.f; });
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int d = acc_col(n0, e);
          if (d < K) sm[D + acc_row(0, e) * KP + d] = acc[e];
        }
      }
      __syncthreads();
    }
    // K-vector gradients of rows i and i + 8 (one read of S and dS serves both), channel d:
    // state parts, then the pair parts (query-type rows r, a over j <= i; key-type rows k, b
    // over i' >= j), factors multiplied up from exp(w).
    for (int e = threadIdx.x; e < (C / 2) * K; e += NT) {
      const int i0 = e / K, d = e % K;
      float g[2][4] = {};
      if (TC) {
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int at = (i0 + h2 * (C / 2)) * KP + d;
          g[h2][0] = sm[L.gr + at], g[h2][1] = sm[L.ga + at], g[h2][2] = sm[L.gk + at], g[h2][3] = sm[L.gb + at];
        }
      }
      for (int q = 0; q < (TC ? 0 : cols); q += 4) {
        const float4 s = ld4(sm + L.S + d * BP + q), ds = ld4(sm + L.dS + d * BP + q);
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int i = i0 + h2 * (C / 2);
          g[h2][0] = dot4(ld4(sm + L.dO + i * BP + q), s, g[h2][0]);
          g[h2][1] = dot4(ld4(sm + L.dM + i * BP + q), s, g[h2][1]);
          g[h2][2] = dot4(ld4(sm + L.v + i * BP + q), ds, g[h2][2]);
          g[h2][3] = dot4(ld4(sm + L.U + i * BP + q), ds, g[h2][3]);
        }
      }
#pragma unroll 1
      for (int h2 = 0; h2 < 2; ++h2) {
        const int i = i0 + h2 * (C / 2);
        float dr = h2 ? g[1][0] : g[0][0], da = h2 ? g[1][1] : g[0][1];  // selects: no local memory
        float dk = h2 ? g[1][2] : g[0][2], db = h2 ? g[1][3] : g[0][3];
        const float eo = sm[L.eO + i * KP + d];
        dr *= rho * sm[L.eG + i * KP + d], da *= eE(sm, L, i, d), dk *= eo, db *= eo;
        const float* ew = sm + L.w + d;  // exp(w)
        const float4 di = ld4(sm + L.dA + 4 * (i * C + i));
        dr += di.x * sm[L.k + i * KP + d] + di.y * sm[L.b + i * KP + d];
        const float ewi = ew[i * KP];
        float fex = 1.f;  // exp(sum of w_s over j < s < i)
        for (int j = i - 1; j >= 0; --j) {
          const float fin = fex * ewi;
          const float kj = sm[L.k + j * KP + d], bj = sm[L.b + j * KP + d];
          const float4 a = ld4(sm + L.dA + 4 * (i * C + j));
          dr += (a.x * kj + a.y * bj) * fin;
          da += (a.z * kj + a.w * bj) * fex;
          fex *= ew[j * KP];
        }
        const int j = i;  // this row as the key
        const float4 dj = ld4(sm + L.dA + 4 * (j * C + j));
        dk += dj.x * sm[L.r + j * KP + d];
        db += dj.y * sm[L.r + j * KP + d];
        fex = 1.f;  // exp(sum of w_s over j < s < i')
        for (int i2 = j + 1; i2 < C; ++i2) {
          const float fin = fex * ew[i2 * KP];
          const float ri = sm[L.r + i2 * KP + d], ai = sm[L.a + i2 * KP + d];
          const float4 a = ld4(sm + L.dA + 4 * (i2 * C + j));
          dk += a.x * ri * fin + a.z * ai * fex;
          db += a.y * ri * fin + a.w * ai * fex;
          fex = fin;
        }
        sm[L.gr + i * KP + d] = dr, sm[L.ga + i * KP + d] = da;
        sm[L.gk + i * KP + d] = dk, sm[L.gb + i * KP + d] = db;
      }
    }
    __syncthreads();

    auto kg_at = [&](int g, int64_t t, int d) {
      VecArg v = p.kg;
      v.ptr = static_cast<const float*>(p.kg.ptr) + c.tile / p.kg_pair * p.kg_tile + g * p.kg_grad;
      return vptr<float>(v, c.s.b, t, c.h, d);
    };
    // dw = reverse cumsum + zeta (§6.4), exactly 0 where exp(w) == 0: per row t (reverse)
    // acc += x_t; acc = 0 where exp(w_t) == 0; dw_t = acc; acc += y_t. Four threads per channel,
    // four rows each: a row group maps the sum entering it to acc_in + c (no reset in it) or to
    // c, and each thread starts from zeta carried through the later groups' maps (shuffles).
    {
      const int part = threadIdx.x % 4, r0 = 4 * part;
      for (int d0 = 0; d0 < K; d0 += NT / 4) {  // the same trip count on every lane
        const int d = d0 + threadIdx.x / 4;
        const bool on = d < K;
        float x[4], y[4], cg = 0.f;
        bool z[4], keep = true;  // keep: no reset in this row group
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int at = (r0 + r) * KP + d;
          const bool live = on && r0 + r < nrow;
          x[r] = live ? sm[L.r + at] * sm[L.gr + at] - sm[L.k + at] * sm[L.gk + at] -
                            sm[L.b + at] * sm[L.gb + at]
                      : 0.f;
          y[r] = live ? sm[L.a + at] * sm[L.ga + at] : 0.f;
          z[r] = live && sm[L.w + at] == 0.f;  // exp(w), set above
        }
#pragma unroll
        for (int r = 3; r >= 0; --r) cg = z[r] ? y[r] : cg + x[r] + y[r], keep = keep && !z[r];
        float acc = on ? sm[L.zeta + d] : 0.f;
#pragma unroll
        for (int q = 3; q >= 0; --q) {
          const float cq = __shfl_sync(0xffffffffu, cg, q, 4);
          const float kq = __shfl_sync(0xffffffffu, keep ? 1.f : 0.f, q, 4);
          if (q > part) acc = kq != 0.f ? acc + cq : cq;
        }
#pragma unroll
        for (int r = 3; r >= 0; --r) {
          acc += x[r];
          if (z[r]) acc = 0.f;
          if (on && r0 + r < nrow) atomicAdd(kg_at(kGradW, c.s.bos + t0 + r0 + r, d), acc);
          acc += y[r];
        }
      }
    }
    // One slab pointer per row; the four gradients sit kg_grad apart.
    for (int i = threadIdx.x / 64; i < nrow; i += NT / 64) {
      float* const row = kg_at(kGradR, c.s.bos + t0 + i, 0);
      const int64_t gk = (kGradK - kGradR) * p.kg_grad, ga = (kGradA - kGradR) * p.kg_grad;
      const int64_t gb = (kGradB - kGradR) * p.kg_grad;
      for (int d = threadIdx.x % 64; d < K; d += 64) {
        float* const g = row + d * p.kg.sd;
        const int at = i * KP + d;
        atomicAdd(g, sm[L.gr + at]), atomicAdd(g + gk, sm[L.gk + at]);
        atomicAdd(g + ga, sm[L.ga + at]), atomicAdd(g + gb, sm[L.gb + at]);
      }
    }
  }
}

}  // namespace dplr_chunk_detail
}  // namespace fla
