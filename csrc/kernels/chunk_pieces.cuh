// The chunk engine's tile loads in 16-byte pieces (kernels/chunk.cuh has the overview): a 64 x 64
// tile of an activation, fetched into registers as loaded and converted at the store to shared
// memory. Per-element loads (a 2-byte load per row and thread) need more registers than a tile's
// worth of pieces, so at a kernel's register cap the compiler issued them in small batches, each
// waiting on memory before the next went out (docs/design.md §5.2); a tile's pieces are two
// to four 16-byte loads a thread, all in flight at once.
#pragma once
#include <cstring>
#include <type_traits>

#include "elements.cuh"
#include "sequence.h"
#include "tile_mma.cuh"

namespace fla {
namespace chunk_detail {
using namespace elements;
using tile::DT, tile::NTH;

// A 64 x 64 tile of an activation in 16-byte pieces of P elements, NP a thread, in one of two
// thread orders:
//   by rows (BY_COLUMN false): thread x owns the pieces at row x / PR + RS j, columns P (x % PR)
//     .. + P. A row's PR pieces are consecutive threads: coalesced loads, and row-major stores
//     of whole pieces (store / put).
//   by columns (BY_COLUMN true): thread x owns row x % DT, the pieces at columns P (x / DT + CS j).
//     For a transposed store (store_transposed: s[column][row]) a warp's 32 lanes then write 32
//     consecutive rows of one column: at the tiles' row stride LD (4 mod 32 banks) that is
//     conflict-free, where by rows eight lanes of a row would share a bank.
// Loads are held raw in registers and converted at the store, so a kernel can fetch the next tile
// while it works on the current one (a conversion right after its load would wait for it there).
// With `vec` (the rows are whole aligned pieces: rows_in_pieces) a piece is one 16-byte access,
// else P element accesses (per-element loads and stores, each with its 64-bit address arithmetic,
// would be the bulk of the state kernel's instructions).
template <typename T, bool BY_COLUMN = false>
struct RowPieces {
  static constexpr int P = 16 / int(sizeof(T)), PR = DT / P, RS = NTH / PR, CS = NTH / DT;
  static constexpr int NP = DT * PR / NTH;
  uint4 x[NP];
  __device__ static int row0() { return BY_COLUMN ? int(threadIdx.x) % DT : int(threadIdx.x) / PR; }
  __device__ static int col0() { return BY_COLUMN ? P * (int(threadIdx.x) / DT) : P * (int(threadIdx.x) % PR); }
  // Piece j's offset from piece 0: rows (by rows) or columns (by columns).
  static constexpr int kRowStep = BY_COLUMN ? 0 : RS, kColStep = BY_COLUMN ? P * CS : 0;

  // p: this thread's first element (row row0(), column col0() of the tile); rows from L on and
  // columns from `cols` on (counted from col0()) read as zeros.
  __device__ __forceinline__ void fetch(const T* p, int64_t st, int64_t sd, int L, int cols, bool vec) {
#pragma unroll
    for (int j = 0; j < NP; ++j, p += kRowStep * st + kColStep * sd) {
      const int left = cols - kColStep * j;  // columns of piece j inside the tile
      const bool on = row0() + kRowStep * j < L && left > 0;
      if (vec) {
        x[j] = on ? *reinterpret_cast<const uint4*>(p) : make_uint4(0, 0, 0, 0);
      } else {
        T e[P];
#pragma unroll
        for (int i = 0; i < P; ++i) e[i] = on && i < left ? p[i * sd] : from_f<T>(0.f);
        memcpy(&x[j], e, sizeof e);
      }
    }
  }
  // The tile at rows [t0, t0 + L) x channels [d0, d0 + D) of a, at this thread's pieces: zeros
  // past L and D, and everywhere for an off argument (no decay reads as λ = 0), so padded rows
  // and channels contribute exactly 0 (algorithms.md §2.4).
  __device__ __forceinline__ void fetch(const VecArg& a, int64_t b, int64_t t0, int L, int h, int d0, int D,
                                        bool vec) {
    if (!a.on()) return fetch(nullptr, 0, 1, 0, 0, vec);
    fetch(vptr<T>(a, b, t0 + row0(), h, d0 + col0()), a.st, a.sd, L, D - d0 - col0(), vec);
  }

  // Rows [r0, r0 + 64) x columns [c0, c0 + 64) of a row-major fp32 [R, Cn] matrix (a state
  // slot), zero outside; vec: Cn % 4 == 0 and m 16-byte aligned.
  __device__ __forceinline__ void fetch_mat(const float* m, int R, int Cn, int r0, int c0, bool vec) {
    static_assert(std::is_same_v<T, float>, "matrices are fp32");
    fetch(m + int64_t(r0 + row0()) * Cn + c0 + col0(), Cn, 1, R - r0, Cn - c0 - col0(), vec);
  }

  // TF: rounded to TF32 values (tile::tf32_round), for products that read them RAW.
  template <bool TF = false>
  __device__ __forceinline__ void widen(int j, float (&f)[P], float mul) const {
    T e[P];
    memcpy(e, &x[j], sizeof e);
#pragma unroll
    for (int i = 0; i < P; ++i) f[i] = tile::tf32_if<TF>(to_f(e[i]) * mul);
  }
  template <bool TF = false, int N>
  __device__ __forceinline__ void store(float (*s)[N], float mul) const {
    static_assert(!BY_COLUMN, "row-major stores take the pieces by rows");
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      float v[P];
      widen<TF>(j, v, mul);
      float4 f[P / 4];
#pragma unroll
      for (int i = 0; i < P / 4; ++i) f[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
      float4* d = reinterpret_cast<float4*>(&s[row0() + RS * j][col0()]);
      if constexpr (P == 8) {
        const int sw = swapped();
        sts128(d + sw, sw ? f[1] : f[0]);
        sts128(d + (sw ^ 1), sw ? f[0] : f[1]);
      } else {
        d[0] = f[0];
      }
    }
  }
  // s[column][row], the tile transposed.
  template <bool TF = false, int N>
  __device__ __forceinline__ void store_transposed(float (*s)[N], float mul) const {
    static_assert(BY_COLUMN, "transposed stores take the pieces by columns (conflict-free)");
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      float v[P];
      widen<TF>(j, v, mul);
#pragma unroll
      for (int i = 0; i < P; ++i) s[col0() + kColStep * j + i][row0()] = v[i];
    }
  }
  // Two-float4 pieces (P = 8): the 8 threads of a row access 32-byte pieces, and the first halves
  // of pieces t and t + 4 share banks; threads 4..7 take their second half first (conflict-free).
  __device__ static int swapped() { return int(threadIdx.x) % 8 / 4; }
  // One 16-byte shared store / load as written: for a select between two addresses the compiler
  // emits a predicated pair of stores, each a full set of shared-memory wavefronts.
  __device__ static __forceinline__ void sts128(float4* d, float4 v) {
#ifdef __CUDA_ARCH__
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(unsigned(__cvta_generic_to_shared(d))),
                 "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w));  // volatile: ordered against the barriers
#else
    *d = v;
#endif
  }
  __device__ static __forceinline__ float4 lds128(const float4* s) {
#ifdef __CUDA_ARCH__
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(unsigned(__cvta_generic_to_shared(s))) : "memory");
    return v;
#else
    return *s;
#endif
  }
  // The other way: rows [0, L) x columns [0, cols) of a shared fp32 tile, times mul, out to p.
  template <int N>
  __device__ static __forceinline__ void put(const float (*s)[N], T* p, int64_t st, int64_t sd, int L,
                                             int cols, bool vec, float mul) {
    static_assert(!BY_COLUMN, "row-major puts take the pieces by rows");
#pragma unroll
    for (int j = 0; j < NP; ++j, p += RS * st) {
      const int r = row0() + RS * j;
      if (r >= L || cols <= 0) continue;
      float v[P];
      const float4* src = reinterpret_cast<const float4*>(&s[r][col0()]);
      if constexpr (P == 8) {
        const int sw = swapped();
        const float4 a = lds128(src + sw), b = lds128(src + (sw ^ 1));
        const float4 lo = sw ? b : a, hi = sw ? a : b;
        v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
      } else {
        const float4 a = src[0];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
      }
      T e[P];
#pragma unroll
      for (int i = 0; i < P; ++i) e[i] = from_f<T>(v[i] * mul);
      if (vec) {
        uint4 u;
        memcpy(&u, e, sizeof e);
        *reinterpret_cast<uint4*>(p) = u;
      } else {
#pragma unroll
        for (int i = 0; i < P; ++i)
          if (i < cols) p[i * sd] = e[i];
      }
    }
  }
};

// Whether a kernel that loads several tiles at once fetches them all before storing any (all their
// loads in flight: one memory latency) or stores each before fetching the next. A bf16 / fp16 tile
// is two pieces a thread, an fp32 tile four: three or four fp32 tiles in flight do not fit intra's
// and grad_qk's register caps (they spill), so fp32 takes one tile at a time.
template <typename T>
constexpr bool kTilesTogether = sizeof(T) < 4;

// This thread's first element of an activation's tile at chunk 0 (rows from the sequence start,
// columns from d0), null and no columns when the argument is off.
template <typename T>
struct PieceSrc {
  T* p = nullptr;
  int64_t st = 0, sd = 1;
  int cols = 0;
  __device__ PieceSrc(const VecArg& a, const SeqSpan& s, int h, int d0, int D) {
    if (!a.on()) return;
    p = vptr<T>(a, s.b, s.bos + RowPieces<T>::row0(), h, d0 + RowPieces<T>::col0());
    st = a.st, sd = a.sd, cols = D - d0 - RowPieces<T>::col0();
  }
};

}  // namespace chunk_detail
}  // namespace fla
