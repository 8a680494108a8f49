// The chunked RWKV7 engine's chunk loads (dplr_chunk_launch.cuh has the overview): the choice of
// load and store paths (pick_paths), the asynchronous 16-byte row copies into a stage and their
// widening to fp32, and the element-by-element loads for any strides.
#pragma once
#include <cstring>
#include <type_traits>

#include "async_copy.cuh"
#include "dplr_chunk_layout.cuh"

namespace fla {
namespace dplr_chunk_detail {

// Asynchronous chunk loads (DplrChunkPaths::rows_16byte): every activation row goes to shared
// memory by cp.async, 16 bytes at a time, so that all of a CTA's loads are in flight together and
// no thread waits on one before it issues the next (the element-wise loads below convert each
// element right after it arrives, so every thread waits on each of its loads in turn). fp32 K-rows
// land in place; bf16 / fp16 K-rows, and the column rows of every dtype, land raw in a stage (at
// L.stage, over arrays not live yet) that widen_rows / widen_cols convert.
template <typename T>
constexpr int kPiece = 16 / int(sizeof(T));  // elements per 16-byte copy
template <typename T>
constexpr bool kRawRows = !std::is_same<T, float>::value;

// The copy loops split a flat piece index e into (e / n, e % n); n is usually a power of two
// (K, V or the tile width over the piece size), and a runtime division costs ~20 instructions per
// piece where a shift costs one: in a copy loop the division would outweigh the copy.
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
// tensor-core reads of rows 2q, 2q + 1 (one column per lane g) would all fall on the same banks
// (4-way conflicts); at 144 bytes they are 8 banks apart.
template <typename T>
FLA_HD constexpr int stage_pitch(int ncol) { return ncol + kPiece<T>; }
// The column rows' stage: after the raw K-rows of the stage, or at float offset `at` of shared
// memory where a caller gives one (at >= 0).
template <typename T>
__device__ __forceinline__ T* col_stage(float* sm, const Smem& L, int at) {
  return at >= 0 ? reinterpret_cast<T*>(sm + at) : reinterpret_cast<T*>(sm + L.stage) + stage_cols_at<T>(L.K);
}
template <typename T>
FLA_HD size_t stage_bytes(int K, int ncol, int ncolmats) {
  return size_t(stage_cols_at<T>(K) + int64_t(ncolmats) * C * stage_pitch<T>(ncol)) * sizeof(T);
}

// Whether every row of r, w, k, a, b and the column side `cols` (v; the fused reverse pass
// reads dO in its place) is whole 16-byte pieces at 16-byte aligned addresses (the fused
// kernels' rows_16byte; the other kernels also need their stages to fit: rows_16byte_ok).
template <typename T>
inline bool input_rows_in_pieces(const DplrChunkPass& p, const VecArg& cols) {
  auto ok = [](const VecArg& v, int n) { return elements::rows_in_pieces(v, n, kPiece<T>); };
  return ok(p.r, p.K) && ok(p.w, p.K) && ok(p.k, p.K) && ok(p.a, p.K) && ok(p.b, p.K) && ok(cols, p.V);
}

// DplrChunkPaths::rows_16byte for these inputs: every activation row in whole 16-byte pieces at
// 16-byte aligned addresses, and the stages of prep (raw K-rows, then all of v, over the pair
// workspace) and of grad (raw K-rows, v and dO tile rows, from dk_rows on) within the space they
// overlay.
template <typename T>
inline bool rows_16byte_ok(const DplrChunkPass& p) {
  if (!input_rows_in_pieces<T>(p, p.v)) return false;
  if (stage_bytes<T>(p.K, p.V, 1) > size_t(Smem(p.K, false).pwn) * sizeof(float)) return false;
  if (!p.backward()) return true;
  const Smem g(p.K, true);
  return elements::rows_in_pieces(p.dout, p.V, kPiece<T>) &&
         stage_bytes<T>(p.K, g.cols, 2) <= size_t(g.total - g.stage) * sizeof(float) &&
         elements::aligned16(p.hst) && elements::aligned16(p.dhst);
}

// DplrChunkPaths::grads_16byte for these outputs.
template <typename T>
inline bool grads_16byte_ok(const DplrChunkPass& p) {
  bool ok = p.backward() && p.kg_pair == 0;
  for (int g = 0; g < kNumKGrads; ++g) ok = ok && elements::rows_in_pieces(p.kgd[g], p.K, kPiece<T>);
  return ok;
}
// The launch's choices of load and store paths for these arguments (the CUDA emulator's too).
template <typename T>
inline void pick_paths(DplrChunkPass& p) {
  p.paths.rows_16byte = rows_16byte_ok<T>(p);
  p.paths.grads_16byte = grads_16byte_ok<T>(p);
  p.paths.dv_pairs = sizeof(T) == 2 && p.backward() && elements::rows_in_pieces(p.dv, p.V, 2);
  auto same = [](const VecArg& u, const VecArg& v) { return u.sb == v.sb && u.st == v.st && u.sh == v.sh && u.sd == v.sd; };
  p.paths.rows_share_offsets = same(p.w, p.r) && same(p.k, p.r) && same(p.a, p.r) && same(p.b, p.r);
  p.paths.grads_share_offsets = true;
  for (int g = 1; g < kNumKGrads; ++g) p.paths.grads_share_offsets = p.paths.grads_share_offsets && same(p.kgd[g], p.kgd[0]);
}

// Issues the copies of rows [t0, t0 + nrow) of r, w, k, a, b (rows past nrow zero-filled).
template <typename T>
__device__ void copy_rows_async(float* sm, const Smem& L, const DplrChunkPass& p, const SeqSpan& s,
                                int h, int64_t t0, int nrow) {
  constexpr int E = kPiece<T>;
  const Split pk(L.K / E);
  T* const stage = reinterpret_cast<T*>(sm + L.stage);
  // A piece's row, column and (with rows_share_offsets: strides shared, the usual case) its element
  // offset once for all five arrays: loops per array, each forming its own row pointer and
  // 64-bit offsets, cost ~55 instructions per array and thread, more than the copies they issue.
  const VecArg* const arrays[5] = {&p.r, &p.w, &p.k, &p.a, &p.b};
  for (int e = threadIdx.x; e < C * pk.n; e += NT) {
    const int i = pk.quot(e), c = (e - i * pk.n) * E;
    const bool on = i < nrow;
    const int64_t t = s.bos + t0 + (on ? i : 0);  // a valid address where zero-filled
    const int64_t off = voff(p.r, s.b, t, h, c);
#pragma unroll
    for (int q = 0; q < 5; ++q) {
      const VecArg& v = *arrays[q];
      const T* const src = static_cast<const T*>(v.ptr) + (p.paths.rows_share_offsets ? off : voff(v, s.b, t, h, c));
      if (kRawRows<T>) copy16(stage + (q * C + i) * L.K + c, src, on);
      else copy16(sm + L.r + (q * C + i) * L.KP + c, src, on);
    }
  }
}
// Issues the copies of columns [x0, x0 + ncol) of rows [t0, t0 + nrow) of x into stage matrix m
// (columns at or past x0 + nvalid and rows past nrow zero-filled; ncol and nvalid whole pieces).
// at: col_stage's.
template <typename T>
__device__ void copy_cols_async(float* sm, const Smem& L, const VecArg& x, int m, const SeqSpan& s,
                                int h, int64_t t0, int nrow, int x0, int ncol, int nvalid, int at = -1) {
  constexpr int E = kPiece<T>;
  const Split pc(ncol / E);
  const int pitch = stage_pitch<T>(ncol);
  T* const stage = col_stage<T>(sm, L, at) + m * C * pitch;
  const T* const row0 = vptr<T>(x, s.b, s.bos + t0, h, x0);  // rows_16byte: x.sd == 1
  for (int e = threadIdx.x; e < C * pc.n; e += NT) {
    const int i = pc.quot(e), c = (e - i * pc.n) * E;
    const bool on = i < nrow && c < nvalid;
    copy16(stage + i * pitch + c, on ? row0 + i * x.st + c : row0, on);
  }
}
// Widens 4 elements of T to 4 floats at dst (16-byte aligned); zeros if !on. Four, not a 16-byte
// piece of 8: a warp's 16-byte stores of consecutive quads are conflict-free, where two stores
// per lane at 32-byte steps would cost twice the shared-memory wavefronts.
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
// (columns at or past ncol: 0). at: col_stage's.
template <typename T>
__device__ void widen_cols(float* sm, const Smem& L, int m, int ncol, int x0, int dst, int at = -1) {
  const int pitch = stage_pitch<T>(ncol);
  const T* const stage = col_stage<T>(sm, L, at) + m * C * pitch;
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

}  // namespace dplr_chunk_detail
}  // namespace fla
