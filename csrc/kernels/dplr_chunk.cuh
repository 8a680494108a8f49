// CUDA engine for the chunked RWKV7 algebra of kernels/dplr_chunk.h (the steps of
// cpu/dplr_chunk.cpp in fp32). Exact SIMT FMA everywhere for fp32 inputs; for bf16 / fp16 inputs
// every product with a state, a 16 x 16 matrix or across the columns runs on TF32 tensor cores
// (fp32 accumulators and states; X and every exponent stay SIMT fp32, the pair matrices too
// unless a chunk's decays allow their fp32-accurate 3xTF32 form). The launch compiles K = 64
// and 128 as constants (launch_k).
//
// Forward, two kernels:
//   prep   (chunk slot, H)  everything of a chunk that does not depend on the state: the pair
//          matrices (every thread pair (i, j) of the 16 x 16 grid adds its exponent
//          sum_{j < s < i} w_s elementwise: never a difference, never positive, so any w in
//          [-inf, 0] is exact; for bf16 / fp16, a chunk whose every channel's total decay is
//          >= -60 takes 3xTF32 products of factored rows instead, pair_matrices_tc), X =
//          (I - A_ab)^-1 by forward substitution, then W, Q~, K^, B^, gamma, U0, O0 into the
//          workspace (DplrWs).
//   state  (N, H, V / 32)   the sequential pass over chunks with the K x 32 state slice in shared
//          memory: U = U0 + W S, o = O0 + scale Q~ S, S+ = gamma S + K^^T V + B^^T U. The next
//          chunk's workspace block is copied asynchronously while this one is used, so a step
//          costs its arithmetic, not a memory latency. Writes the chunk-start states (`hst`)
//          when asked: the training forward keeps them, and its workspace with the pair
//          matrices and X, for its backward (DplrChunkPass::kept).
// (prep here; the sweeps in dplr_chunk_sweep.cuh, the grad kernel in dplr_chunk_grad.cuh.)
// Backward: unless the training forward kept its states and workspace, prep and the forward
// sweep for them; the reverse sweep (dS+ at every chunk end); then one CTA of 256 threads per
// (chunk slot, head, tile of dplr_chunk_cols(K) columns) makes that chunk's gradients with the
// rows, pair matrices and the K x cols state and its gradient in shared memory. With V in one tile its K-vector gradients go
// straight to the outputs; else they are per-tile partial sums, added into zero-filled slabs two
// tiles per slab (DplrArgs::kg_pair). No host synchronisation: CUDA-graph safe.
#pragma once
#include <cstring>
#include <type_traits>

#include "dplr_chunk.h"
#include "async_copy.cuh"
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
using elements::voff;
using tile::acc_col;
using tile::acc_row;
using tile::warp_mma;
using tile::mma_tf32;
using tile::tf32_if;
using tile::tf32_round;
using tile::warp_mma_ld;
using tile::warp_mma_nt;
using tile::nt_col;
using tile::nt_row;
using tile::kp_row;

constexpr int C = kDplrChunk, CP = kDplrMatStride, NT = 256;
static_assert(NT == C * C, "one thread per pair (i, j) of a chunk");

// Pair matrices by 4-row micro-blocks, channels in slabs of PS (ALGORITHMS.md §1.2 references one
// level down). Pair workspace rows [C][PSP]: r~ = r exp(Rin), a~ = a exp(Rex) (exponents from
// the micro-block start, inclusive / exclusive), k~ = k exp(L), b~ = b exp(L) (to the micro-block
// end), and P1, P2, P3: the products of the last 1, 2, 3 exp(w) of the micro-block up to the row;
// then rows [PSP]: the gap factors of micro-block pairs (2,0), (3,1), (3,0) (exp of the totals
// strictly between), ones and zeros. Every exponent is a sum of w's, never a difference.
constexpr int MB = 4, PS = 24, PSP = PS + 4;  // PSP: 16-byte aligned rows
constexpr int kPairRows = 7, kPairWs = kPairRows * C * PSP + 5 * PSP;

// Shared memory of one CTA, in floats. K-rows [C][KP] (KP: 16-byte aligned rows with 4 floats of
// padding, 0, so rows read as float4 and 16 rows' same channel spread over 8 banks), tile rows
// [C][BP], 16 x 16 matrices [C][CP], states [K][BP]; every array starts 16-byte aligned. The
// prep kernel (bwd = false) has no state; the backward kernel has no exp(G) / exp(Omega) rows
// (it multiplies them up from exp(w) where it needs them) and keeps M + P in M, so that at K = 64
// its 64-column tiles fit two CTAs per SM (109 KB).
struct Smem {
  int K, KP, cols, lc, BP;  // lc = log2(cols); BP: row stride of tile rows and states
  int r, w, k, a, b, eG, eO, S, v, U, M, Ark, Arb, Aak, Aab, X;
  // Backward. dA: the four pair-matrix gradients interleaved, [C][C][4] = (dA_rk, dA_rb, dA_ak,
  // dA_ab) per pair, so that the K-vector gradients' pair walks read one float4 per pair.
  // zeta = rowsum(S+ * dS+) in parts (grad_kernel): rowsum(S * dS+) at zeta, gamma at zgam, the
  // state-part sums at zparts ([2][K] TC, [8][K] SIMT).
  int dS, dO, dU, dM, gr, gk, ga, gb, dA, dX, Y, zeta, zgam, zparts;
  int pw, pwn;  // pair workspace (pwn floats), 16-byte aligned; -1 (0) in the backward
  int stage;  // raw rows of the asynchronous loads: over pw (prep) or from gk on (backward)
  int total;

  // Prep's column tiles stay at 32 (K <= 128): its U0 / O0 loop gains nothing from wider ones,
  // and 64 would cost it its third CTA per SM.
  __host__ __device__ Smem(int K_, bool bwd)
      : K(K_), KP((K_ + 3) / 4 * 4 + 4), cols(bwd ? dplr_chunk_cols(K_) : K_ <= 128 ? 32 : 8) {
    lc = 0;
    while ((1 << lc) < cols) ++lc;
    // cols + 4: 16-byte aligned rows (a thread's walk along a row reads float4), and the
    // K-vector gradients' float4 reads down a state column (lanes on channels) put the 8 lanes
    // of a 16-byte phase on different banks (cols apart: 32-way conflicts).
    BP = cols + 4;
    int o = 0;
    auto take = [&](int n) { const int at = o; o += (n + 3) / 4 * 4; return at; };
    r = take(C * KP), w = take(C * KP), k = take(C * KP), a = take(C * KP), b = take(C * KP);
    eG = bwd ? -1 : take(C * KP), eO = bwd ? -1 : take(C * KP), S = bwd ? take(K * BP) : 0;
    v = take(C * BP), U = take(C * BP), M = take(C * BP);
    Ark = take(C * CP), Arb = take(C * CP), Aak = take(C * CP), Aab = take(C * CP);
    X = take(C * CP);  // the five are consecutive (C * CP is a multiple of 4): DplrWs::mats()
    static_assert(CP % 4 == 0 && CP > C, "16-byte aligned rows of the 16 x 16 matrices");
    dS = dO = dU = dM = gr = gk = ga = gb = dA = dX = Y = zeta = zgam = zparts = 0;
    if (bwd) {
      dS = take(K * BP), dO = take(C * BP), dU = take(C * BP), dM = take(C * BP);
      zeta = take(K), zgam = take(K), zparts = take(8 * K);
      gr = take(C * KP), gk = take(C * KP), ga = take(C * KP), gb = take(C * KP);
      dA = take(4 * C * C);
      dX = take(C * CP), Y = take(C * CP);
    }
    // only prepare() (prep) uses the pair workspace: the pair walks' rows, or pair_matrices_tc's
    // two K-row arrays, and the stage (raw rows and v: 16-bit rows with V <= K + 8 fit)
    pwn = bwd ? 0 : kPairWs > 3 * C * KP ? kPairWs : 3 * C * KP;
    pw = bwd ? -1 : take(pwn);
    total = o;
    stage = bwd ? gk : pw;
  }
  __host__ __device__ size_t bytes() const { return size_t(total) * sizeof(float); }
};

struct Cta {
  int n, h, tile, x0, nc;
  SeqSpan s;
};

// 16-byte shared reads: rows of K-vectors and tiles and the state rows start 16-byte aligned
// (Smem), so a reduction along a row reads 4 terms per load instead of 1.
__device__ __forceinline__ float4 ld4(const float* q) { return *reinterpret_cast<const float4*>(q); }
__device__ __forceinline__ float dot4(const float4& a, const float4& b, float acc) {
  acc += a.x * b.x, acc += a.y * b.y, acc += a.z * b.z, acc += a.w * b.w;
  return acc;
}
__device__ __forceinline__ void st4(float* q, const float4& v) { *reinterpret_cast<float4*>(q) = v; }
__device__ __forceinline__ float4 mul4(const float4& a, const float4& b) {
  return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
}

// exp(E_i) = exp(G_{i-1}), 1 on the first row.
__device__ __forceinline__ float eE(const float* sm, const Smem& L, int i, int d) {
  return i ? sm[L.eG + (i - 1) * L.KP + d] : 1.f;
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
// [C][stage_pitch(ncol)] of v and, with dO, of dO.
template <typename T>
FLA_HD int64_t stage_cols_at(int K) { return kRawRows<T> ? int64_t(5) * C * K : 0; }
// Column rows are one 16-byte piece longer than ncol: rows of 64 bf16 are 128 bytes, so prep's
// tensor-core reads of rows 2q, 2q + 1 (one column per lane g) all fell on the same banks (ncu:
// 4-way conflicts); at 144 bytes they are 8 banks apart.
template <typename T>
FLA_HD int stage_pitch(int ncol) { return ncol + kPiece<T>; }
template <typename T>
FLA_HD size_t stage_bytes(int K, int ncol, int ncolmats) {
  return size_t(stage_cols_at<T>(K) + int64_t(ncolmats) * C * stage_pitch<T>(ncol)) * sizeof(T);
}

// DplrChunkPass::rows16 for these inputs: every activation row in whole 16-byte pieces at 16-byte
// aligned addresses, and the stages of prep (raw K-rows, then all of v, over the pair workspace)
// and of grad (raw K-rows, v and dO tile rows, from gk on) within the space they overlay.

template <typename T>
inline bool rows16(const DplrChunkPass& p) {
  constexpr int E = kPiece<T>;
  auto ok = [](const VecArg& v, int n) { return elements::rows_in_pieces(v, n, E); };
  if (!(ok(p.r, p.K) && ok(p.w, p.K) && ok(p.k, p.K) && ok(p.a, p.K) && ok(p.b, p.K) && ok(p.v, p.V)))
    return false;
  if (stage_bytes<T>(p.K, p.V, 1) > size_t(Smem(p.K, false).pwn) * sizeof(float)) return false;
  if (!p.backward()) return true;
  const Smem g(p.K, true);
  return ok(p.dout, p.V) && stage_bytes<T>(p.K, g.cols, 2) <= size_t(g.total - g.stage) * sizeof(float) &&
         elements::aligned16(p.hst) && elements::aligned16(p.dhst);
}

// DplrChunkPass::kg16 for these outputs.
template <typename T>
inline bool kg16(const DplrChunkPass& p) {
  bool ok = p.backward() && p.kg_pair == 0;
  for (int g = 0; g < kNumKGrads; ++g) ok = ok && elements::rows_in_pieces(p.kgd[g], p.K, kPiece<T>);
  return ok;
}
// The launch's choices of load and store paths for these arguments (the CUDA emulator's too).
template <typename T>
inline void pick_paths(DplrChunkPass& p) {
  p.rows16 = rows16<T>(p);
  p.kg16 = kg16<T>(p);
  auto same = [](const VecArg& u, const VecArg& v) { return u.sb == v.sb && u.st == v.st && u.sh == v.sh && u.sd == v.sd; };
  p.krows_same = same(p.w, p.r) && same(p.k, p.r) && same(p.a, p.r) && same(p.b, p.r);
  p.kg_same = true;
  for (int g = 1; g < kNumKGrads; ++g) p.kg_same = p.kg_same && same(p.kgd[g], p.kgd[0]);
}

// Issues the copies of rows [t0, t0 + nrow) of r, w, k, a, b (rows past nrow zero-filled).
template <typename T>
__device__ void copy_rows_async(float* sm, const Smem& L, const DplrChunkPass& p, const SeqSpan& s,
                                int h, int64_t t0, int nrow) {
  constexpr int E = kPiece<T>;
  const Split pk(L.K / E);
  T* const stage = reinterpret_cast<T*>(sm + L.stage);
  // A piece's row, column and (with krows_same: strides shared, the usual case) its element
  // offset once for all five arrays: loops per array, each forming its own row pointer and
  // 64-bit offsets, cost ~55 instructions per array and thread (ncu: a quarter of grad's load
  // issue).
  const VecArg* const arrays[5] = {&p.r, &p.w, &p.k, &p.a, &p.b};
  for (int e = threadIdx.x; e < C * pk.n; e += NT) {
    const int i = pk.quot(e), c = (e - i * pk.n) * E;
    const bool on = i < nrow;
    const int64_t t = s.bos + t0 + (on ? i : 0);  // a valid address where zero-filled
    const int64_t off = voff(p.r, s.b, t, h, c);
#pragma unroll
    for (int q = 0; q < 5; ++q) {
      const VecArg& v = *arrays[q];
      const T* const src = static_cast<const T*>(v.ptr) + (p.krows_same ? off : voff(v, s.b, t, h, c));
      if (kRawRows<T>) copy16(stage + (q * C + i) * L.K + c, src, on);
      else copy16(sm + L.r + (q * C + i) * L.KP + c, src, on);
    }
  }
}
// Issues the copies of columns [x0, x0 + ncol) of rows [t0, t0 + nrow) of x into stage matrix m
// (columns at or past x0 + nvalid and rows past nrow zero-filled; ncol and nvalid whole pieces).
template <typename T>
__device__ void copy_cols_async(float* sm, const Smem& L, const VecArg& x, int m, const SeqSpan& s,
                                int h, int64_t t0, int nrow, int x0, int ncol, int nvalid) {
  constexpr int E = kPiece<T>;
  const Split pc(ncol / E);
  const int pitch = stage_pitch<T>(ncol);
  T* const stage = reinterpret_cast<T*>(sm + L.stage) + stage_cols_at<T>(L.K) + m * C * pitch;
  const T* const row0 = vptr<T>(x, s.b, s.bos + t0, h, x0);  // rows16: x.sd == 1
  for (int e = threadIdx.x; e < C * pc.n; e += NT) {
    const int i = pc.quot(e), c = (e - i * pc.n) * E;
    const bool on = i < nrow && c < nvalid;
    copy16(stage + i * pitch + c, on ? row0 + i * x.st + c : row0, on);
  }
}
// Widens 4 elements of T to 4 floats at dst (16-byte aligned); zeros if !on. Four, not a 16-byte
// piece of 8: a warp's 16-byte stores of consecutive quads are conflict-free, where two stores
// per lane at 32-byte steps cost twice the wavefronts (ncu: 50 % excessive).
template <typename T>
__device__ __forceinline__ void widen_quad(float* dst, const T* src, bool on) {
  float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
  if constexpr (std::is_same<T, float>::value) {
    if (on) f = *reinterpret_cast<const float4*>(src);
  } else {
    uint2 raw = make_uint2(0u, 0u);
    if (on) raw = *reinterpret_cast<const uint2*>(src);
    T v[4];
    memcpy(v, &raw, sizeof(v));  // not a pointer cast: that would break strict aliasing
    f = make_float4(to_f(v[0]), to_f(v[1]), to_f(v[2]), to_f(v[3]));
  }
  *reinterpret_cast<float4*>(dst) = f;
}
// After the wait and a barrier: raw K-rows to fp32, a quad per thread and step. Every dtype:
// the channel padding [K, KP) of the five row arrays to 0 (fp32 rows are in place already; no
// copy goes to the padding, so this may also run before the wait).
template <typename T>
__device__ void widen_rows(float* sm, const Smem& L) {
  if (kRawRows<T>) {
    const T* const stage = reinterpret_cast<const T*>(sm + L.stage);
    const Split pk(L.K / 4);
    for (int e = threadIdx.x; e < 5 * C * pk.n; e += NT) {  // arrays r..b are C * KP apart
      const int qi = pk.quot(e), c = (e - qi * pk.n) * 4;
      widen_quad<T>(sm + L.r + qi * L.KP + c, stage + qi * L.K + c, true);
    }
  }
  const int pad = L.KP - L.K;
  for (int e = threadIdx.x; e < 5 * C * pad; e += NT) sm[L.r + e / pad * L.KP + L.K + e % pad] = 0.f;
}
// Columns [x0, x0 + cols) of stage matrix m (ncol columns per row) to a tile array [C][BP]
// (columns at or past ncol: 0).
template <typename T>
__device__ void widen_cols(float* sm, const Smem& L, int m, int ncol, int x0, int dst) {
  const int pitch = stage_pitch<T>(ncol);
  const T* const stage = reinterpret_cast<const T*>(sm + L.stage) + stage_cols_at<T>(L.K) + m * C * pitch;
  const Split pc(L.cols / 4);
  for (int e = threadIdx.x; e < C * pc.n; e += NT) {
    const int i = pc.quot(e), c = (e - i * pc.n) * 4;
    widen_quad<T>(sm + dst + i * L.BP + c, stage + i * pitch + x0 + c, x0 + c < ncol);
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

// The pair (i, j) of this thread: the 136 pairs j <= i on threads 0..135 (packed, so that warps 5..7
// hold only pairs above the diagonal, whose entries are 0 and skip the channel loop: a thread per
// (i, j) in row order left ~47 % of every warp's lanes multiplying by zeros), the 120 pairs j > i
// on the rest.
__device__ __forceinline__ void pair_of_thread(int& i, int& j) {
  constexpr int kLower = C * (C + 1) / 2;
  const int t = threadIdx.x;
  const int e = t < kLower ? t : t - kLower;  // index among the pairs j <= i, or j < i
  const int off = t < kLower ? 1 : -1;        // row r of index e: r (r + off) / 2 <= e
  int r = int((sqrtf(8.f * float(e) + 1.f) - float(off)) * 0.5f);
  while (r * (r + off) / 2 > e) --r;
  while ((r + 1) * (r + 1 + off) / 2 <= e) ++r;
  const int c = e - r * (r + off) / 2;
  if (t < kLower) i = r, j = c;
  else i = c, j = r;  // the strictly lower pair (r, c) mirrored
}

// The four pair-matrix entries of thread (i, j) = pair_of_thread() over all channels (0 for
// j > i): A_rk, A_rb with
// exp(sum_{j<s<=i} w_s), A_ak, A_ab (j < i) with exp(sum_{j<s<i} w_s), as
//   rk = sum_c (R F_in)(K), rb = sum_c (R F_in)(B), ak = sum_c (A F_ex)(K), ab = sum_c (A F_ex)(B)
// with rows picked per pair so that every thread runs the same instructions: different
// micro-blocks take the prescaled rows and the gap factor (no exponential per pair); one
// micro-block the raw rows and the products P of at most three exp(w) (each <= 1; a few ulp);
// the diagonal raw rows, F_in = 1, F_ex = 0. The per-pair exponent walk this replaced put
// ~15 x K additions on the thread of pair (15, 0), and divergent paths serialised the warps.
__device__ inline void pair_matrices(float* sm, const Smem& L, int i, int j, float& rk, float& rb,
                                     float& ak, float& ab) {
  float* const pw = sm + L.pw;
  auto row = [&](int q, int i) { return pw + (q * C + i) * PSP; };  // q: 0 r~ 1 a~ 2 k~ 3 b~ 4.. P
  float* const gap = pw + kPairRows * C * PSP;
  float *const ones = gap + 3 * PSP, *const zeros = ones + PSP;
  const int K = L.K, KP = L.KP;
  const int mi = i / MB, mj = j / MB, dl = i - j;
  rk = rb = ak = ab = 0.f;
  for (int d0 = 0; d0 < K; d0 += PS) {
    const int nd = min(PS, K - d0);
    __syncthreads();
    static_assert(C / MB * PS <= NT, "a thread per micro-block and slab channel");
    if (threadIdx.x < C / MB * PS) {  // thread (micro-block m, slab channel c): its four rows
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
    // Raw rows: no reads past the row's padding. Above the diagonal: nothing to add.
    const int n4 = j > i ? 0 : mi != mj ? PS : (nd + 3) / 4 * 4;
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

// The four-row walks of chunk_decays and grad's dw scan (four threads per channel, rows 4 part
// + r) touch the rows of parts 2, 3 in the order r ^ 2: rows 8 apart share banks (8 KP = 0 mod
// 32), so parts p, p + 2 at row r of their groups at once were two-way conflicts. This maps four
// values between that access order and row order (both ways: an involution), with selects, not a
// runtime register index.
template <class X>
__device__ __forceinline__ void swap_halves_if(X (&v)[4], bool sw) {
  const X t0 = v[0], t1 = v[1];
  if (sw) v[0] = v[2], v[1] = v[3], v[2] = t0, v[3] = t1;
}

// exp(G) at `eg` and exp(Omega) at `eo` (rows [C][KP]; eg < 0: not stored) of a loaded chunk and,
// at `ah` when >= 0, Â = a exp(E).
// Four threads per channel, four rows each (all 256 threads: one thread per channel walking all
// 16 rows kept three warps in four at the next barrier, ~10 % of grad's stall samples). Every
// exponent is a sum of w's (the other rows' totals through shuffles), never a difference. Not
// synchronised. Returns whether every channel this thread saw has a chunk total Gamma >=
// -kFactorBound (pair_matrices_tc; NaN: false). gm >= 0: gamma = exp(Gamma) [K] there.
constexpr float kFactorBound = 60.f;
__device__ inline bool chunk_decays(float* sm, const Smem& L, int eg, int eo, int ah = -1, int gm = -1) {
  static_assert(C == 16, "four rows per thread, four threads per channel");
  const int K = L.K, KP = L.KP, part = threadIdx.x % 4, r0 = 4 * part;
  bool bounded = true;
  for (int d0 = 0; d0 < K; d0 += NT / 4) {  // the same trip count on every lane: shuffles below
    const int d = d0 + threadIdx.x / 4;
    const bool on = d < K;
    const int sw = part & 2;  // rows in the order r ^ 2 (swap_halves_if)
    float wl[4], al[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int at = (r0 + (r ^ sw)) * KP + d;
      wl[r] = on ? sm[L.w + at] : 0.f;
      al[r] = on && ah >= 0 ? sm[L.a + at] : 0.f;
    }
    swap_halves_if(wl, sw), swap_halves_if(al, sw);
    const float tot = wl[0] + wl[1] + wl[2] + wl[3];
    float before = 0.f, after = 0.f;  // totals of the rows before and after this thread's four
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float t = __shfl_sync(0xffffffffu, tot, q, 4);
      if (q < part) before += t;
      if (q > part) after += t;
    }
    if (!on) continue;
    bounded = bounded && before + tot + after >= -kFactorBound;
    if (gm >= 0 && part == 0) sm[gm + d] = expf(tot + after);
    float run = before, prev = part ? expf(before) : 1.f;  // prev = exp(E_i) = exp(G_{i-1})
    float hv[4], gv[4], ov[4];  // Â, exp(G), exp(Omega) of the four rows
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      hv[r] = al[r] * prev;
      prev = expf(run += wl[r]);
      gv[r] = prev;
    }
    run = after;
#pragma unroll
    for (int r = 3; r >= 0; --r) {
      ov[r] = expf(run);
      run += wl[r];
    }
    swap_halves_if(hv, sw), swap_halves_if(gv, sw), swap_halves_if(ov, sw);  // to the access order
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int at = (r0 + (r ^ sw)) * KP + d;
      if (ah >= 0) sm[ah + at] = hv[r];
      if (eg >= 0) sm[eg + at] = gv[r];
      sm[eo + at] = ov[r];
    }
  }
  return bounded;
}

// The four pair matrices on tensor cores, for a chunk with every channel's total decay Gamma >=
// -kFactorBound (checked by chunk_decays: a bound relied on, never assumed). Then exp(G_i - G_j)
// = exp(G_i) exp(-G_j) with both factors in [e^-60, e^60] (normal floats: nothing overflows or
// underflows; ALGORITHMS.md §2.2 scheme 2 at C = 16), and each matrix is one 16 x 16 x K
// product of rows R^ = r exp(G_i) or Â = a exp(E_i) with rows k exp(-G_j) or b exp(-G_j),
// masked to j <= i (rk, rb) or j < i (ak, ab); exp(-G_j) = exp(Omega_j) / gamma. R^ and Â
// replace the r and a rows (kwide_rows_tc reads them scaled: `factored`); the key rows go to
// the pair workspace. 3xTF32: fp32-accurate, since X = (I - A_ab)^-1 amplifies the errors of
// A_ab. The exponent is a prefix difference, its error ~2^-24 * 60 relative: far below bf16 /
// fp16 input rounding (fp32 inputs keep the exact pair_matrices). After the flag's barrier;
// not synchronised at the end.
__device__ __forceinline__ bool factorable(const Smem& L) { return 2 * C * L.KP <= L.pwn; }
__device__ inline void pair_matrices_tc(float* sm, const Smem& L) {
  const int K = L.K, KP = L.KP, kn = (K + 7) / 8 * 8;
  float *const kf = sm + L.pw, *const bf = kf + C * KP;  // k exp(-G), b exp(-G): [C][KP]
  // Four channels a thread (16-byte accesses: one per element cost a third more of prep's
  // instructions here, ncu); a quad that reaches past K element by element.
  const int kq = kn / 4;
  for (int e = threadIdx.x; e < C * kq; e += NT) {
    const int i = e / kq, c = 4 * (e - i * kq), at = i * KP + c;
    if (c + 4 <= K) {
      const float4 eg = ld4(sm + L.eG + at), eo = ld4(sm + L.eO + at), gt = ld4(sm + L.eG + (C - 1) * KP + c);
      const float4 ee = i ? ld4(sm + L.eG + at - KP) : make_float4(1.f, 1.f, 1.f, 1.f);  // exp(E)
      const float4 f = make_float4(__fdividef(eo.x, gt.x), __fdividef(eo.y, gt.y), __fdividef(eo.z, gt.z),
                                   __fdividef(eo.w, gt.w));
      st4(sm + L.a + at, mul4(ld4(sm + L.a + at), ee));
      st4(sm + L.r + at, mul4(ld4(sm + L.r + at), eg));
      st4(kf + at, mul4(ld4(sm + L.k + at), f)), st4(bf + at, mul4(ld4(sm + L.b + at), f));
      continue;
    }
    for (int d = c; d < c + 4; ++d) {
      const int ad = i * KP + d;
      if (d >= K) {  // read by the products' last k-step: exp(G) is unset there
        kf[ad] = bf[ad] = 0.f;
        continue;
      }
      const float eg = sm[L.eG + ad], f = __fdividef(sm[L.eO + ad], sm[L.eG + (C - 1) * KP + d]);
      sm[L.a + ad] *= eE(sm, L, i, d);
      sm[L.r + ad] *= eg;
      kf[ad] = sm[L.k + ad] * f, bf[ad] = sm[L.b + ad] * f;
    }
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
  const int m = warp / 2, j0 = 8 * (warp % 2);
  const bool inc = m < 2;  // A_rk, A_rb: j <= i; A_ak, A_ab: j < i
  const float* pa = sm + (inc ? L.r : L.a) + g * KP + q;
  const float* pb = (m % 2 ? bf : kf) + (j0 + g) * KP + q;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int c0 = 0; c0 < kn; c0 += 8, pa += 8, pb += 8) {
    const float av[4] = {pa[0], pa[8 * KP], pa[4], pa[8 * KP + 4]}, bv[2] = {pb[0], pb[4]};
    tile::mma_tf32x3(acc, av, bv);
  }
  float* const M = sm + L.Ark + m * C * CP;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int i = acc_row(0, e), j = acc_col(j0, e);
    M[i * CP + j] = (inc ? j <= i : j < i) ? acc[e] : 0.f;
  }
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

// CW consecutive channels of a K-row, read as one 8- or 16-byte load.
template <int CW>
struct Chans {
  float v[CW] = {};
  __device__ __forceinline__ static Chans ld(const float* p) {
    Chans r;
    if constexpr (CW == 4) {
      const float4 t = *reinterpret_cast<const float4*>(p);
      r.v[0] = t.x, r.v[1] = t.y, r.v[2] = t.z, r.v[3] = t.w;
    } else if constexpr (CW == 2) {
      const float2 t = *reinterpret_cast<const float2*>(p);
      r.v[0] = t.x, r.v[1] = t.y;
    } else {
#pragma unroll
      for (int c = 0; c < CW; ++c) r.v[c] = p[c];
    }
    return r;
  }
  __device__ __forceinline__ void st(float* p) const {
#pragma unroll
    for (int c = 0; c < CW; ++c) p[c] = v[c];  // adjacent: merged into one vector store
  }
};

// The K-vector gradients of row i, channels [d, d + CW), into the gradient rows gr, ga, gk, gb:
// the pair parts walk the rows below i (i as the query: r, a) and above it (i as the key: k,
// b), multiplying the decay factors up from exp(w) (in the w rows: products of <= 15 factors
// <= 1, a few ulp; no exponential per pair), then the state parts sr, sa, sk, sb take their row
// factors, exp(G_i) = exp(E_i) exp(w_i) and exp(Omega_i): the products the walks end with.
// The query walk leaves its common factor exp(w_i) to the end. zp += zeta's state-part sum of
// this row, K^_i sk + B^_i sb (the SIMT path's; TC's comes from its state-part products).
template <int CW>
__device__ __forceinline__ void pair_walks(float* sm, const Smem& L, int i, int d, float rho,
                                           const Chans<CW>& sr, const Chans<CW>& sa,
                                           const Chans<CW>& sk, const Chans<CW>& sb, Chans<CW>& zp) {
  using V = Chans<CW>;
  const int KP = L.KP;
  const float *ew = sm + L.w + d, *kr = sm + L.k + d, *br = sm + L.b + d;  // ew: exp(w)
  const float *rr = sm + L.r + d, *ar = sm + L.a + d, *dA = sm + L.dA;
  const float4 di = ld4(dA + 4 * (i * C + i));
  const V ki = V::ld(kr + i * KP), bi = V::ld(br + i * KP);
  V wr, da, fex;  // wr: the query walk's part of dr over exp(w_i); fex: exp(sum of w_s, j < s < i)
#pragma unroll
  for (int c = 0; c < CW; ++c) fex.v[c] = 1.f;
  for (int j = i - 1; j >= 0; --j) {
    const float4 a = ld4(dA + 4 * (i * C + j));
    const V kj = V::ld(kr + j * KP), bj = V::ld(br + j * KP), ej = V::ld(ew + j * KP);
#pragma unroll
    for (int c = 0; c < CW; ++c) {
      wr.v[c] += (a.x * kj.v[c] + a.y * bj.v[c]) * fex.v[c];
      da.v[c] += (a.z * kj.v[c] + a.w * bj.v[c]) * fex.v[c];
      fex.v[c] *= ej.v[c];
    }
  }
  const V ewi = V::ld(ew + i * KP), ri = V::ld(rr + i * KP);
  V dr;
#pragma unroll
  for (int c = 0; c < CW; ++c) {  // fex = exp(E_i) now
    dr.v[c] = di.x * ki.v[c] + di.y * bi.v[c] + ewi.v[c] * (wr.v[c] + sr.v[c] * (rho * fex.v[c]));
    da.v[c] += sa.v[c] * fex.v[c];
  }
  dr.st(sm + L.gr + i * KP + d), da.st(sm + L.ga + i * KP + d);
  V dk, db;
#pragma unroll
  for (int c = 0; c < CW; ++c) dk.v[c] = di.x * ri.v[c], db.v[c] = di.y * ri.v[c], fex.v[c] = 1.f;
  for (int i2 = i + 1; i2 < C; ++i2) {
    const float4 a = ld4(dA + 4 * (i2 * C + i));
    const V e2 = V::ld(ew + i2 * KP), r2 = V::ld(rr + i2 * KP), a2 = V::ld(ar + i2 * KP);
#pragma unroll
    for (int c = 0; c < CW; ++c) {
      const float re = r2.v[c] * e2.v[c];
      dk.v[c] += (a.x * re + a.z * a2.v[c]) * fex.v[c];
      db.v[c] += (a.y * re + a.w * a2.v[c]) * fex.v[c];
      fex.v[c] *= e2.v[c];
    }
  }
#pragma unroll
  for (int c = 0; c < CW; ++c) {  // fex = exp(Omega_i) now
    dk.v[c] += sk.v[c] * fex.v[c], db.v[c] += sb.v[c] * fex.v[c];
    zp.v[c] += (ki.v[c] * sk.v[c] + bi.v[c] * sb.v[c]) * fex.v[c];
  }
  dk.st(sm + L.gk + i * KP + d), db.st(sm + L.gb + i * KP + d);
}

// Everything of a loaded chunk that does not depend on the state: exp(G), exp(Omega), the pair
// matrices (TC: on tensor cores where the chunk's decays allow, pair_matrices_tc) and X. Ends
// synchronised. Returns whether the pair matrices were factored (then the r and a rows hold R^
// and Â).
template <bool TC>
__device__ inline bool prepare(float* sm, const Smem& L) {
  const bool bounded = chunk_decays(sm, L, L.eG, L.eO);
  // X = (I - N)^-1 for the strictly lower N = A_ab by 4 x 4 blocks (ALGORITHMS.md §6.2), the
  // blocked inverse by doubling: each diagonal block by forward substitution down its columns;
  // the blocks (1, 0), (3, 2) as X_II N_IJ X_JJ; then the lower left 8 x 8 block as X_hi
  // (N_hi,lo X_lo), the inner product staged in the pair workspace (free by then). Every thread
  // makes its own entry, so all warps work where a 15-step substitution on one warp kept seven
  // waiting (22 % of prep's stall samples), and every stage is a fixed chain of at most 16
  // terms: a stage per block distance (X_IJ = X_II sum_L N_IL X_LJ, L = J..I-1) ran chains of up
  // to 48 terms under runtime bounds (ncu: a third of prep's stall samples at its barriers). Not
  // the product
  // (I + N)(I + N^2)(I + N^4)(I + N^8): for repeated keys with iclr = 1 the entries of N^k grow
  // like C(14, k - 1) while |X| <= 1, and the cancellation cost ~1e-4 in fp32 (tests: the
  // "repeated" low-rank regime). Every entry is written: the upper triangle is explicit zeros.
  const int i = threadIdx.x / C, j = threadIdx.x % C, at = i * CP + j;
  const int I = i / 4, J = j / 4;
  const float* const N = sm + L.Aab;
  float* const X = sm + L.X;
  const bool factored = __syncthreads_and(TC && bounded && factorable(L));  // CTA-uniform
  if (factored) {
    pair_matrices_tc(sm, L);
  } else {
    int pi, pj;
    pair_of_thread(pi, pj);
    float rk, rb, ak, ab;
    pair_matrices(sm, L, pi, pj, rk, rb, ak, ab);
    const int pat = pi * CP + pj;
    sm[L.Ark + pat] = rk, sm[L.Arb + pat] = rb, sm[L.Aak + pat] = ak, sm[L.Aab + pat] = ab;
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
  static_assert(C == 16, "the doubling below is written for four 4 x 4 blocks");
  if ((I == 1 && J == 0) || (I == 3 && J == 2)) {  // X_II N_IJ X_JJ (their upper parts are 0)
    float acc = 0.f;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int rp = 4 * I + m;
      float t = 0.f;
#pragma unroll
      for (int l = 0; l < 4; ++l) t += N[rp * CP + 4 * J + l] * X[(4 * J + l) * CP + j];
      acc += X[i * CP + rp] * t;
    }
    X[at] = acc;
  }
  __syncthreads();
  float* const T = sm + L.pw;  // [8][8]: N_hi,lo X_lo
  const bool low = i >= 8 && j < 8;
  if (low) {
    float t = 0.f;
#pragma unroll
    for (int l = 0; l < 8; ++l) t += N[i * CP + l] * X[l * CP + j];
    T[(i - 8) * 8 + j] = t;
  }
  __syncthreads();
  if (low) {
    float acc = 0.f;
#pragma unroll
    for (int m = 8; m < 16; ++m) acc += X[i * CP + m] * T[(m - 8) * 8 + j];
    X[at] = acc;
  }
  __syncthreads();
  return factored;
}

// acc (this lane's m16n8 tile, columns n0..n0 + 8 of a tile) += R St on TF32 tensor cores: R a
// K-row array [C][KP] at offset `rows`, St a state array [K][BP] at offset `st` holding TF32
// values (grad rounds its states once). bf16 / fp16 inputs only, as warp_mma. The k of lane q in
// a k-step are 2q, 2q + 1 (not q, q + 4): its A fragment is one 8-byte load per row, and its B
// rows are 2 apart, at banks 8 apart for BP = 4 mod 32 (q, q + 4 were 4 apart: two-way
// conflicts). Lane g takes rows tile::kp_perm(g) and + 8 (accumulator rows at kp_row, columns
// at acc_col). With K % 8 != 0, channels past K are masked (the row padding may be unset).
__device__ __forceinline__ void rows_state_mma(const float* sm, const Smem& L, int rows, int st,
                                               int n0, float (&acc)[4]) {
  const int K = L.K, KP = L.KP, BP = L.BP;
  const int g = threadIdx.x % 32 / 4, q = threadIdx.x % 4, pg = tile::kp_perm(g);
  using tile::to_tf32;
  if (K % 8 == 0) {
    const float* pa = sm + rows + pg * KP + 2 * q;
    const float* pb = sm + st + 2 * q * BP + n0 + g;
    for (int k = 0; k < K; k += 8, pa += 8, pb += 8 * BP) {
      const float2 lo = *reinterpret_cast<const float2*>(pa), hi = *reinterpret_cast<const float2*>(pa + 8 * KP);
      mma_tf32(acc, to_tf32(lo.x), to_tf32(hi.x), to_tf32(lo.y), to_tf32(hi.y), __float_as_uint(pb[0]),
               __float_as_uint(pb[BP]));
    }
    return;
  }
  for (int k = 0; k < K; k += 8) {
    auto a = [&](int r, int kk) { return kk < K ? to_tf32(sm[rows + r * KP + kk]) : 0u; };
    auto b = [&](int kk) { return kk < K ? __float_as_uint(sm[st + kk * BP + n0 + g]) : 0u; };
    const int k0 = k + 2 * q;
    mma_tf32(acc, a(pg, k0), a(pg + 8, k0), a(pg, k0 + 1), a(pg + 8, k0 + 1), b(k0), b(k0 + 1));
  }
}

// M + P into M (M = A_ak V, P = Â S: the backward needs only their sum), then U = X (M + P) (Â at
// `ah`, the 16 x 16 matrices zero-filled: fixed 16-term sums), exact SIMT (fp32 inputs; the
// tensor-core path is grad's column chain): thread (column x, rows i and i + 8), so that each
// state or tile element read serves two rows. Ends synchronised.
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
    sm[L.M + i * BP + x] = m0 + p0, sm[L.M + (i + C / 2) * BP + x] = m1 + p1;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < (C / 2) * L.cols; e += NT) {
    const int i = e >> L.lc, x = e & (L.cols - 1);
    const float *x0 = sm + L.X + i * CP, *x1 = x0 + (C / 2) * CP;
    float u0 = 0.f, u1 = 0.f;
#pragma unroll
    for (int l = 0; l < C; ++l) {
      const float mp = sm[L.M + l * BP + x];
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

// The CTA's column tile of chunk ci's slot in a state workspace laid out as hst [slots, H, K, V]
// (hst, or dhst), at row 0.
__device__ __forceinline__ float* slot_state(const DplrChunkPass& p, void* base, const Cta& c,
                                             int64_t ci) {
  const int64_t slot = chunk_slot<kDplrChunk>(p.cu_seqlens, c.n, p.T, ci);
  return static_cast<float*>(base) + (slot * p.H + c.h) * p.K * int64_t(p.V) + c.x0;
}

// A fragments (tile_mma.cuh's mma_tf32 layout) of a 16 x 16 matrix M [C][CP] at offset m, or
// of its transpose (tr), both k-steps, with lane q's k in a k-step taken as 2q, 2q + 1 (as
// rows_state_mma: the B operand's rows 2 apart, conflict-free at strides 4 mod 32) and lane g's
// rows as tile::kp_perm(g) and + 8 (accumulator rows at kp_row): f[ks] = (A(p, k), A(p + 8, k),
// A(p, k + 1), A(p + 8, k + 1)), k = 8 ks + 2q, p = kp_perm(g), A = M or M^T. At CP = 20 both
// the 8-byte row reads and the transposed column reads are conflict-free. scale: the fragments
// of scale * A.
struct MatFrag {
  uint32_t f[2][4];
  __device__ __forceinline__ MatFrag(const float* sm, int m, bool tr = false, float scale = 1.f) {
    const int q = threadIdx.x % 4, g = tile::kp_perm(threadIdx.x % 32 / 4);
    const int r8 = tr ? 8 : 8 * CP, k1 = tr ? CP : 1, k8 = tr ? 8 * CP : 8;  // row + 8, k + 1, k + 8
    const float* a = sm + m + (tr ? 2 * q * CP + g : g * CP + 2 * q);
    auto cv = [&](float x) { return tile::to_tf32(scale * x); };
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      if (tr) {
        f[ks][0] = cv(a[ks * k8]), f[ks][1] = cv(a[ks * k8 + r8]), f[ks][2] = cv(a[ks * k8 + k1]),
        f[ks][3] = cv(a[ks * k8 + r8 + k1]);
      } else {  // k, k + 1 adjacent: one 8-byte load per row (CP even)
        const float2 lo = *reinterpret_cast<const float2*>(a + ks * k8), hi = *reinterpret_cast<const float2*>(a + ks * k8 + r8);
        f[ks][0] = cv(lo.x), f[ks][1] = cv(hi.x), f[ks][2] = cv(lo.y), f[ks][3] = cv(hi.y);
      }
    }
  }
  // acc += this (16 x 16) B (16 x 8) with B(k, n) = b(k, n) (lane (g, q) asks for (2q, g),
  // (2q + 1, g), (2q + 8, g), (2q + 9, g)); RB: b gives TF32 values.
  template <bool RB = false, class B>
  __device__ __forceinline__ void mma(float (&acc)[4], B b) const {
    const int g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
    auto cb = [](float x) { return RB ? __float_as_uint(x) : tile::to_tf32(x); };
#pragma unroll
    for (int ks = 0; ks < 2; ++ks)
      tile::mma_tf32(acc, f[ks][0], f[ks][1], f[ks][2], f[ks][3], cb(b(8 * ks + 2 * q, g)),
                     cb(b(8 * ks + 2 * q + 1, g)));
  }
};

// Prep's products with the 16 x 16 matrices on TF32 tensor cores (bf16 / fp16 inputs; the
// matrices themselves stay exact fp32 SIMT, as do all exponents). A warp owns 8 channels (or
// columns) at a time and chains its products through a warp-private 16 x 8 scratch with
// __syncwarp only: the SIMT forms (a thread per channel and row group) needed a CTA barrier
// between each product and the next (NOTES c13: these products were ~36 % of prep's samples).
// K-wide rows: W = X Â, Q~ = R^ + A_rb W, K^ and B^ into shared memory over the
// w, r, k, b rows (each lane overwrites only elements it has read), for store_kwide_rows; gamma
// straight to the workspace. `factored`: the a and r rows hold Â and R^ already (prepare).
// Not synchronised.
__device__ inline void kwide_rows_tc(float* sm, const Smem& L, const DplrWs& ws, float* out, bool factored) {
  const int K = L.K, KP = L.KP, warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
  const MatFrag X(sm, L.X), Arb(sm, L.Arb);
  for (int n0 = 8 * warp; n0 < ws.KP4; n0 += NT / 4) {
    const int d = n0 + g;  // the B fragments' channel
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    X.mma(acc, [&](int l, int) {
      return d >= K ? 0.f : factored ? sm[L.a + l * KP + d] : sm[L.a + l * KP + d] * eE(sm, L, l, d);
    });
#pragma unroll
    for (int h = 0; h < 2; ++h)  // 8-byte stores: conflict-free on kp_row's rows
      *reinterpret_cast<float2*>(sm + L.w + kp_row(0, 2 * h) * KP + acc_col(n0, 0)) = make_float2(acc[2 * h], acc[2 * h + 1]);
    __syncwarp();
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = kp_row(0, e), x = acc_col(n0, e);
      acc[e] = x >= K ? 0.f : factored ? sm[L.r + i * KP + x] : sm[L.r + i * KP + x] * sm[L.eG + i * KP + x];
    }
    Arb.mma(acc, [&](int j, int) { return sm[L.w + j * KP + d]; });
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int at = kp_row(0, e) * KP + acc_col(n0, e);
      const float eo = acc_col(n0, e) < K ? sm[L.eO + at] : 0.f;
      sm[L.r + at] = acc[e];
      sm[L.k + at] *= eo;
      sm[L.b + at] *= eo;
    }
    if (threadIdx.x % 32 < 8 && n0 + threadIdx.x % 32 < ws.KP4) {
      const int x = n0 + threadIdx.x % 32;
      out[ws.gam() + x] = x < K ? sm[L.eG + (C - 1) * KP + x] : 0.f;
    }
  }
}
// kwide_rows_tc's rows to the workspace as 16-byte pieces (after a barrier): the lanes of its
// fragments hold 8-byte pairs on 8 rows, and stored from there, prep's backward was 5 % slower
// than with the SIMT rows (1.23 against 1.16 ms). Rounded to TF32 (tf32_round): the sweeps read
// them only as tensor-core operands, now without a rounding add per read (the same values).
__device__ inline void store_kwide_rows(const float* sm, const Smem& L, const DplrWs& ws, float* out) {
  // A thread's row i and piece c once for all four arrays (one piece per thread at K = 64): the
  // kat swizzle has period C, so array m's piece sits m C KS further. Per piece, the form that
  // picked the array and swizzled per element cost ~40 instructions (ncu: a third of prep's
  // last region).
  const Split q4(ws.KP4 / 4);
  const int src[4] = {L.w, L.r, L.k, L.b};  // W, Q~, K^, B^ in ws order
  for (int e = threadIdx.x; e < C * q4.n; e += NT) {
    const int i = q4.quot(e), c = 4 * (e - i * q4.n);
    float* const dst = out + ws.W() + ws.kat(i, c);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const float4 x = *reinterpret_cast<const float4*>(sm + src[m] + i * L.KP + c);
      *reinterpret_cast<float4*>(dst + m * C * ws.KS) =
          make_float4(tile::tf32_round(x.x), tile::tf32_round(x.y), tile::tf32_round(x.z), tile::tf32_round(x.w));
    }
  }
}

// Column tiles: U0 = X A_ak V and, forward, O0 = scale (A_rk V + A_rb U0), with v raw in the
// stage ([C][stage_pitch(V)] of T, copy_cols_async; landed and synchronised, exp(G), exp(Omega) no longer
// read). Columns [V, VP4) are written (0). Not synchronised.
template <typename T>
__device__ inline void col_tiles_tc(float* sm, const Smem& L, const DplrWs& ws, float* uout, int V,
                                    float rho, bool o0) {
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
  uout = static_cast<float*>(__builtin_assume_aligned(uout, 16));  // (else its float2 stores split)
  const T* const vs = reinterpret_cast<const T*>(sm + L.stage) + stage_cols_at<T>(L.K);
  const int vp = stage_pitch<T>(V);
  // [C][8] per warp over exp(G), exp(Omega), v, U, M (contiguous, unused here: 2 C KP + 3 C BP
  // floats, >= 1728 for K <= 128 (BP = 36), >= 4352 beyond (KP >= 136); the 8 warps take 1024).
  // Scratch row k sits at srow(k): MatFrag's B rows 2q (+ 1) of a k-step, 8 floats apart, would
  // share banks for q, q + 2; rotating each 4-row block by its index spreads them over all 32.
  float* const scr = sm + L.eG + warp * C * 8;
  const MatFrag Aak(sm, L.Aak), X(sm, L.X);
  auto srow = [](int k) { return (k & ~3) | ((k + (k >> 2)) & 3); };
  auto put = [&](float (&acc)[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<float2*>(scr + srow(kp_row(0, 2 * h)) * 8 + acc_col(0, 0)) = make_float2(acc[2 * h], acc[2 * h + 1]);
  };
  auto from_scr = [&](int k, int n) { return scr[srow(k) * 8 + n]; };
  for (int x0 = 8 * warp; x0 < ws.VP4; x0 += NT / 4) {
    const int xb = x0 + g;
    auto vb = [&](int k, int) { return xb < V ? to_f(vs[k * vp + xb]) : 0.f; };
    float m[4] = {0.f, 0.f, 0.f, 0.f}, u[4] = {0.f, 0.f, 0.f, 0.f};
    Aak.mma(m, vb);
    __syncwarp();  // the previous column slab's last scratch reads
    put(m);
    __syncwarp();
    X.mma(u, from_scr);
    const int c = x0 + 2 * q;
    if (c < ws.VP4)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(uout + ws.uo(0, kp_row(0, 2 * h), c)) = make_float2(u[2 * h], u[2 * h + 1]);
    if (!o0) continue;
    __syncwarp();
    put(u);
    __syncwarp();
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    MatFrag(sm, L.Ark).mma(o, vb);
    MatFrag(sm, L.Arb).mma(o, from_scr);
    if (c < ws.VP4)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(uout + ws.uo(1, kp_row(0, 2 * h), c)) =
            make_float2(rho * o[2 * h], rho * o[2 * h + 1]);
  }
}

// The workspaces' padding (DplrWs): the K-rows' columns [KP4, KS) in `out`, and U0 / O0 columns
// past VP4 (which the column tiles write, 0 in [V, VP4)) and past kDplrSweepCols of each tile in
// `uout`, 16 bytes at a time. The sweeps copy whole blocks: padding is never read, but left unset
// it would be undefined data in a kept workspace.
__device__ inline void zero_ws_pads(float* out, float* uout, const DplrWs& ws) {
  const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
  const int kpr = (ws.KS - ws.KP4) / 4;
  for (int e = threadIdx.x; e < 4 * C * kpr; e += NT) {
    const int row = e / kpr, c = ws.KP4 + 4 * (e - row * kpr);
    *reinterpret_cast<float4*>(out + ws.W() + ws.kat(row, c)) = z;
  }
  // Only the padding pieces are enumerated (a loop over every piece testing each cost more than
  // the stores): the UP / 4 - SP pieces past each row's kDplrSweepCols, then the last tile's
  // pieces in [VP4, its end).
  constexpr int upr = DplrWs::UP / 4, spr = kDplrSweepCols / 4, extra = upr - spr;
  uout = static_cast<float*>(__builtin_assume_aligned(uout, 16));
  for (int e = threadIdx.x; e < ws.tiles * 2 * C * extra; e += NT) {
    const int row = e / extra;
    *reinterpret_cast<float4*>(uout + row * DplrWs::UP + 4 * (spr + e - row * extra)) = z;
  }
  const int last = (ws.tiles - 1) * kDplrSweepCols, v0 = (ws.VP4 - last) / 4, tail = spr - v0;
  float* const ul = uout + ws.utile(ws.tiles - 1);
  for (int e = threadIdx.x; e < 2 * C * tail; e += NT) {
    const int row = e / tail;
    *reinterpret_cast<float4*>(ul + row * DplrWs::UP + 4 * (v0 + e - row * tail)) = z;
  }
}

// ---------------------------------------------------------------------------------------------
// Forward, parallel part: one CTA per (chunk slot, head). Slots without a chunk (final-state and
// gap slots) are never read; a training forward writes zeros there (its workspace is kept as an
// op output), any other call leaves them unwritten.
// KC: K as a compile-time constant (64 or 128; 0: p.K), so that the shared-memory layout and every index
// derived from K fold into immediates (launch_k).
template <typename T, int KC = 0>
__global__ void __launch_bounds__(NT, KC == 64 ? 4 : 3) prep_kernel(const DplrChunkPass p) {
  extern __shared__ float sm[];
  const Smem L(KC ? KC : p.K, false);
  const DplrWs ws(L.K, p.V);
  const int64_t slot = blockIdx.x;
  const int h = blockIdx.y, n = slot_sequence<C>(p.cu_seqlens, p.N, p.T, slot);
  const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
  const int64_t ci = slot - chunk_slot<C>(p.cu_seqlens, n, p.T, 0), t0 = ci * C;
  float* out = static_cast<float*>(p.ws) + (slot * p.H + h) * ws.per();
  // (formed where used: held across the kernel it cost prep 16 bytes more of spills)
  auto uout = [&] { return static_cast<float*>(p.uo) + (slot * p.H + h) * ws.uper(); };
  const bool train = !p.backward() && p.hst;
  if (ci < 0 || t0 >= s.len) {
    for (int e = threadIdx.x; e < (train ? ws.per() / 4 : 0); e += NT)  // per() is a multiple of 4
      reinterpret_cast<float4*>(out)[e] = make_float4(0.f, 0.f, 0.f, 0.f);
    return;
  }
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
  constexpr bool TC = !std::is_same<T, float>::value;
  const bool factored = prepare<TC>(sm, L);
  // All of v at once into the stage (over the pair workspace, free now), in flight during the
  // K-wide rows below; every column tile reads it.
  if (p.rows16) {
    copy_cols_async<T>(sm, L, p.v, 0, s, h, t0, nrow, 0, p.V, p.V);
    copy_commit();
  }
  // The pair matrices and X serve the backward's grad kernel alone: stored by a backward's prep
  // or a training forward's.
  for (int e = threadIdx.x; e < (p.backward() || train ? 5 * C * CP / 4 : 0); e += NT)  // as DplrWs::mats()
    *reinterpret_cast<float4*>(out + ws.mats() + 4 * e) = *reinterpret_cast<const float4*>(sm + L.Ark + 4 * e);
  zero_ws_pads(out, uout(), ws);
  // K-wide rows, then the column tiles: on tensor cores for bf16 / fp16 (kwide_rows_tc,
  // col_tiles_tc; the column tiles when v is in the stage), else exact SIMT below.
  const float rho = float(p.scale);
  if (TC) {
    kwide_rows_tc(sm, L, ws, out, factored);
  } else {
    // Thread (channel d, row group g) holds channel d of all 16 rows of an operand in registers
    // and makes rows g, g + 4, ..; the triangular matrices are zero-filled, so every product is
    // a fixed 16-term sum. W = X Â goes through the w rows (w is not read again).
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
        if (d < ws.KP4) sm[L.w + i * KP + d] = wv, out[ws.W() + ws.kat(i, d)] = wv;
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
          out[ws.W() + ws.kat(C + i, d)] = q;
          out[ws.W() + ws.kat(2 * C + i, d)] = eo * sm[L.k + i * KP + d];
          out[ws.W() + ws.kat(3 * C + i, d)] = eo * sm[L.b + i * KP + d];
        }
      }
      if (g == 0 && d < ws.KP4) out[ws.gam() + d] = on ? sm[L.eG + (C - 1) * KP + d] : 0.f;
      __syncthreads();
    }
  }
  if (TC) {
    if (p.rows16) copy_wait<0>();
    __syncthreads();
    store_kwide_rows(sm, L, ws, out);
    if (p.rows16) {
      col_tiles_tc<T>(sm, L, ws, uout(), p.V, rho, !p.backward());
      return;
    }
  }
  // V columns in tiles of `cols`: thread (column x, row group g). U0 = X A_ak V, O0 = scale
  // (A_rk V + A_rb U0) (forward only); columns in [V, VP4) are written (0: v reads 0 there).
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
      if (put) uout()[ws.uo(0, i, x0 + x)] = u;
    }
    __syncthreads();
    if (p.backward()) continue;  // O0 only serves the forward's o
#pragma unroll
    for (int l = 0; l < C; ++l) y[l] = sm[L.U + l * BP + x];
    for (int i = g; i < C; i += G) {
      float o = 0.f;
#pragma unroll
      for (int j = 0; j < C; ++j) o += sm[L.Ark + i * CP + j] * vc[j] + sm[L.Arb + i * CP + j] * y[j];
      if (put) uout()[ws.uo(1, i, x0 + x)] = rho * o;
    }
    __syncthreads();
  }
}

}  // namespace dplr_chunk_detail
}  // namespace fla
