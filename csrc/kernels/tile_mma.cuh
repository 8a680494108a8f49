// Products of 64 x 64 fp32 shared-memory tiles for a 256-thread CTA, accumulated in fp32
// registers: acc(row, col) += Σ_k a(row, k) b(k, col), a stored [row][k] or (TA) [k][row],
// b stored [k][col]. Two implementations with one interface, picked per kernel dtype:
//   Frag<false>  SIMT FMA, thread (ty, tx) owns a 4 x 4 block: exact fp32 (fp32 inputs).
//   Frag<true>   TF32 tensor cores (mma.sync m16n8k8, operands rounded to nearest): for bf16/fp16
//                inputs, whose operands carry 8-11 significant bits anyway; 10-bit TF32 keeps the
//                product error below the input rounding. Warp w owns rows 16(w%4)..+16 and
//                columns 32(w/4)..+32 as four m16n8 tiles.
// Epilogues address elements through row(i) / col(i), so kernels do not know the layout.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

namespace fla {
namespace tile {

constexpr int NTH = 256;  // threads per CTA
constexpr int DT = 64;    // tile edge
constexpr int LD = DT + 4;  // row stride: 16-byte aligned rows, conflict-free SIMT 4x4 reads
using Tile = float[LD];     // a tile is Tile[64]
// Frag<true> lanes (g, q) read a[row g][k q] of an A operand stored [row][k] (bank 4g + q at
// stride LD: conflict-free) but b[k q][col g] of a B operand [k][col] or a transposed A [k][row]
// (bank 4q + g at LD: two-way conflicts). Those tiles take stride LDB, bank 8q + g.
constexpr int LDB = DT + 8;
using TileB = float[LDB];

// Triangular operands: which k a row needs (the rest of the product is known to be zero).
enum class Tri {
  Full,      // every k
  KUpToRow,  // k <= row (a lower triangular: A V)
  KFromRow,  // k >= row (a stored transposed, upper in k: Aᵀ dO)
};

template <bool TC>
struct Frag;

template <>
struct Frag<false> {
  float v[16] = {};
  __device__ static int row(int i) { return 4 * (int(threadIdx.x) / 16) + i / 4; }
  __device__ static int col(int i) { return 4 * (int(threadIdx.x) % 16) + i % 4; }
  // A thread's elements lie in kRowsPer rows (element i in its row_slot(i)) and one 32-column
  // group, shared with the kGroupLanes lanes that differ in the low lane bits.
  static constexpr int kRowsPer = 4, kGroupLanes = 8;
  __device__ static int row_slot(int i) { return i / 4; }
  __device__ static int slot_row(int r) { return row(4 * r); }  // the row of slot r

  template <bool TA, Tri TR = Tri::Full, bool RAW = false, int NA, int NB>  // RAW: see Frag<true>
  __device__ __forceinline__ void mma(const float (*a)[NA], const float (*b)[NB], int K) {
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const int k0 = TR == Tri::KFromRow ? 4 * ty : 0;
    const int k1 = TR == Tri::KUpToRow ? min(K, 4 * ty + 4) : K;
#pragma unroll 4
    for (int k = k0; k < k1; ++k) {
      float av[4];
      if (TA) {
        const float4 t = *reinterpret_cast<const float4*>(&a[k][4 * ty]);
        av[0] = t.x, av[1] = t.y, av[2] = t.z, av[3] = t.w;
      } else {
#pragma unroll
        for (int r = 0; r < 4; ++r) av[r] = a[4 * ty + r][k];
      }
      const float4 bv = *reinterpret_cast<const float4*>(&b[k][4 * tx]);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        v[4 * r + 0] += av[r] * bv.x, v[4 * r + 1] += av[r] * bv.y;
        v[4 * r + 2] += av[r] * bv.z, v[4 * r + 3] += av[r] * bv.w;
      }
    }
  }
  // Blockwise product with a scaled b: acc(row, col) += Σ_{k in [kb(rb), ke(rb))} a(row, k)
  // b(k, col) s(k, col, rb) over the 16 x 16 output blocks (rb, cb) = (row / 16, col / 16) with
  // live(rb, cb); the other blocks stay 0. k bounds are multiples of 16.
  template <bool TA, class KB, class KE, class S, class Live>
  __device__ __forceinline__ void mma_blocks(const Tile* a, const Tile* b, KB kb, KE ke, S s,
                                             Live live) {
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16, rb = ty / 4;
    if (!live(rb, tx / 4)) return;
    for (int k = kb(rb); k < ke(rb); ++k) {
      const float4 bv = *reinterpret_cast<const float4*>(&b[k][4 * tx]);
      const float bs[4] = {bv.x * s(k, 4 * tx, rb), bv.y * s(k, 4 * tx + 1, rb),
                           bv.z * s(k, 4 * tx + 2, rb), bv.w * s(k, 4 * tx + 3, rb)};
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float ar = TA ? a[k][4 * ty + r] : a[4 * ty + r][k];
#pragma unroll
        for (int c = 0; c < 4; ++c) v[4 * r + c] += ar * bs[c];
      }
    }
  }
};

// Round to nearest (ties away) at TF32's 10 mantissa bits: add half a TF32 ulp to the bits; the
// mma ignores the 13 low bits. cvt.rna.tf32.f32 does the same plus an inf/NaN guard (3
// instructions per operand element instead of 1); operands here are finite.
__device__ __forceinline__ uint32_t to_tf32(float x) { return __float_as_uint(x) + 0x1000u; }
// The same rounding as a float that is a TF32 value (low 13 bits clear): an operand stored this
// way once is read by an mma with RAW = true without a rounding per read (each element of a tile
// is read by 2-4 warps). Widened bf16 and fp16 values are TF32 values already.
__device__ __forceinline__ float tf32_round(float x) { return __uint_as_float(to_tf32(x) & 0xffffe000u); }
// tf32_round where the products run on tensor cores (TC), x itself otherwise.
template <bool TC>
__device__ __forceinline__ float tf32_if(float x) { return TC ? tf32_round(x) : x; }

#ifndef __CUDA_ARCH__
// The host branch's warp collective (tests/cuda_emu/emu.h defines it; nothing else calls it).
void emu_mma_tf32(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                  uint32_t b1);
#endif

// d (an m16n8 fp32 accumulator) += a (m16k8) b (k8n8), TF32 operands. Lane (g, q) = (lane / 4,
// lane % 4) holds a0 = a(g, q), a1 = a(g + 8, q), a2 = a(g, q + 4), a3 = a(g + 8, q + 4),
// b0 = b(q, g), b1 = b(q + 4, g) and d(g, 2q), d(g, 2q + 1), d(g + 8, 2q), d(g + 8, 2q + 1).
__device__ __forceinline__ void mma_tf32(float* d, uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
#ifdef __CUDA_ARCH__
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  emu_mma_tf32(d, a0, a1, a2, a3, b0, b1);
#endif
}

#ifndef __CUDA_ARCH__
void emu_mma_f16(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                 uint32_t b1);
#endif

// d (an m16n8 fp32 accumulator) += a (m16k16) b (k16n8), fp16 operands two to a register (the
// lower k in the low half): lane (g, q) holds a0 = a(g, 2q .. 2q+1), a1 = a(g + 8, 2q .. 2q+1),
// a2 = a(g, 2q+8 .. 2q+9), a3 = a(g + 8, 2q+8 .. 2q+9), b0 = b(2q .. 2q+1, g),
// b1 = b(2q+8 .. 2q+9, g); d as mma_tf32's. Twice mma_tf32's multiply-adds an instruction on half
// its operand bytes; with operands scaled by pow2_down_scale, TF32's rounding (below).
__device__ __forceinline__ void mma_f16(float* d, uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
#ifdef __CUDA_ARCH__
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  emu_mma_f16(d, a0, a1, a2, a3, b0, b1);
#endif
}

// Two floats as an fp16 pair (round to nearest even; lo in the low half).
__device__ __forceinline__ uint32_t f16_pair(float lo, float hi) {
  return uint32_t(__half_as_ushort(__float2half_rn(lo))) | (uint32_t(__half_as_ushort(__float2half_rn(hi))) << 16);
}

#ifndef __CUDA_ARCH__
uint32_t emu_movmatrix_trans(uint32_t x);
#endif

// The warp's 8 x 8 matrix of 16-bit values M transposed: lane (g, q) gives row g, columns 2q and
// 2q + 1 of M (the lower column in the low half: the layout of an m16n8 accumulator's 8-row half,
// packed) and gets the same elements of M^T, (M[2q][g], M[2q + 1][g]). One instruction, no shared
// memory.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
#ifdef __CUDA_ARCH__
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
#else
  return emu_movmatrix_trans(x);
#endif
}

// A warp's mma_f16 operands in its lanes' registers (the layouts at mma_f16).
struct F16A {
  uint32_t r[4];
};
struct F16B {
  uint32_t r[2];
};

#ifndef __CUDA_ARCH__
template <bool TRANS>
void emu_ldmatrix_x4(uint32_t (&r)[4], const void* row);
#endif

// Four 8 x 8 matrices of 16-bit values from shared memory: lane l gives the address of row l % 8
// of matrix l / 8 (16 bytes, 16-byte aligned); lane (g, q) gets in r[i] matrix i's elements
// (g, 2q), (g, 2q + 1), or with TRANS those of its transpose, (2q, g), (2q + 1, g): the lane
// layout of mma_f16's operand registers.
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#ifdef __CUDA_ARCH__
  const unsigned a = unsigned(__cvta_generic_to_shared(row));
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
#else
  emu_ldmatrix_x4<TRANS>(r, row);
#endif
}

// mma_f16 operands from fp16 tiles in shared memory (row stride ld halves, a multiple of 8), by
// ldmatrix: the A operand (m16k16) of rows [0, 16) x columns [0, 16) of a row-major [m][k] tile,
// or (a_from_km) of a tile stored transposed, [k][m]; the B operands (k16n8) of two 8-column
// tiles n = [0, 8), [8, 16) of a tile stored [n][k] (b_from_nk: B(k, n) = t[n][k]) or [k][n]
// (b_from_kn).
__device__ __forceinline__ F16A a_from_mk(const __half* t, int ld) {
  const int l = int(threadIdx.x) % 32;
  F16A a;
  ldmatrix_x4<false>(a.r, t + (l % 8 + 8 * (l / 8 % 2)) * ld + 8 * (l / 16));
  return a;
}
__device__ __forceinline__ F16A a_from_km(const __half* t, int ld) {
  const int l = int(threadIdx.x) % 32;  // matrix i: k block i / 2, m block i % 2
  F16A a;
  ldmatrix_x4<true>(a.r, t + (l % 8 + 8 * (l / 16)) * ld + 8 * (l / 8 % 2));
  return a;
}
__device__ __forceinline__ void b_from_nk(F16B (&b)[2], const __half* t, int ld) {
  const int l = int(threadIdx.x) % 32;  // matrix i: n block i / 2, k block i % 2
  uint32_t r[4];
  ldmatrix_x4<false>(r, t + (l % 8 + 8 * (l / 16)) * ld + 8 * (l / 8 % 2));
  b[0] = {{r[0], r[1]}}, b[1] = {{r[2], r[3]}};
}
__device__ __forceinline__ void b_from_kn(F16B (&b)[2], const __half* t, int ld) {
  const int l = int(threadIdx.x) % 32;  // matrix i: k block i % 2, n block i / 2
  uint32_t r[4];
  ldmatrix_x4<true>(r, t + (l % 8 + 8 * (l / 8 % 2)) * ld + 8 * (l / 16));
  b[0] = {{r[0], r[1]}}, b[1] = {{r[2], r[3]}};
}

// fp16 operands of mma_f16 made from fp32 m16n8 accumulators held by the warp (lane (g, q):
// c[0], c[1] at row g, columns 2q, 2q + 1; c[2], c[3] at row g + 8), each value times s (a power
// of two: pow2_down_scale of the matrix's largest magnitude), so that a product can read a result
// where it was made instead of through shared memory (benchmarks/NOTES.md c67):
//   a_from_acc(c0, c1, s): the m16k16 A operand of the 16 x 16 matrix [c0 c1] (c0 its columns
//     0-7): the two layouts agree, so it is packing alone;
//   b_from_acc(c, s): the k16n8 B operand of c's 16 x 8 matrix (k its rows): two transposes;
//   a_from_acc_t(c0, c1, s): the A operand of [c0 c1]^T: four transposes.
__device__ __forceinline__ F16A a_from_acc(const float (&c0)[4], const float (&c1)[4], float s) {
  return {{f16_pair(s * c0[0], s * c0[1]), f16_pair(s * c0[2], s * c0[3]), f16_pair(s * c1[0], s * c1[1]),
           f16_pair(s * c1[2], s * c1[3])}};
}
__device__ __forceinline__ F16B b_from_acc(const float (&c)[4], float s) {
  return {{movmatrix_trans(f16_pair(s * c[0], s * c[1])), movmatrix_trans(f16_pair(s * c[2], s * c[3]))}};
}
__device__ __forceinline__ void mma_f16(float* d, const F16A& a, const F16B& b) {
  mma_f16(d, a.r[0], a.r[1], a.r[2], a.r[3], b.r[0], b.r[1]);
}
__device__ __forceinline__ F16A a_from_acc_t(const float (&c0)[4], const float (&c1)[4], float s) {
  // A(i, j) = [c0 c1](j, i): the 8 x 8 blocks (row block, column block) (0, 0), (1, 0) of the
  // transpose are blocks (0, 0), (0, 1) of [c0 c1] transposed; (0, 1), (1, 1) are (1, 0), (1, 1).
  return {{movmatrix_trans(f16_pair(s * c0[0], s * c0[1])), movmatrix_trans(f16_pair(s * c1[0], s * c1[1])),
           movmatrix_trans(f16_pair(s * c0[2], s * c0[3])), movmatrix_trans(f16_pair(s * c1[2], s * c1[3]))}};
}

// The power of two s that takes amax into [2^(kTop-1), 2^kTop) (1 where amax is 0, not finite,
// or below 2^-126), kept within 2^+-126 so that s and 1 / s stay normal: pow2_down_scale's with
// kTop = 0; the single pass's fp16 states' with kTop = 15 (dplr_f16_states.cuh).
template <int kTop>
__device__ __forceinline__ float pow2_scale(float amax) {
  if (!(amax >= 0x1p-126f) || !(amax <= 3.4028235e38f)) return 1.f;
  const int x = int(__float_as_uint(amax) >> 23) - 126;  // amax in [2^(x-1), 2^x), x >= -125
  int xc = x < kTop + 126 ? x : kTop + 126;               // s >= 2^-126
  if (kTop > 0 && xc < kTop - 126) xc = kTop - 126;       // s <= 2^126 (kTop <= 0: already)
  return __uint_as_float(uint32_t(127 + kTop - xc) << 23);  // s = 2^(kTop - xc)
}

// The power of two s that takes a tile whose largest magnitude is amax into [0.5, 1) (1 where
// amax is 0, not finite, or below 2^-126; 2^-126 from amax >= 2^126, into [1, 4), so that s and
// 1 / s stay normal). x s then rounds to fp16 as TF32 rounds x (the same 10 stored bits, to
// nearest; ties to even where to_tf32 rounds them away) for every x down to 2^-14 amax, keeps an
// absolute error under 2^-25 amax below that, and never overflows; a product of operands scaled
// by sa and sb is the fp32 result times sa sb exactly (benchmarks/NOTES.md c57: TF32's errors on
// the RWKV7 stress suite).
__device__ __forceinline__ float pow2_down_scale(float amax) { return pow2_scale<0>(amax); }
// 1 / s of a pow2_scale s, exactly, from its exponent bits (a division costs a dozen
// instructions where this is one).
__device__ __forceinline__ float inverse_pow2(float s) { return __uint_as_float(0x7f000000u - __float_as_uint(s)); }

// mma_tf32 with fp32-accurate products (3xTF32): each operand split into hi, its leading 11
// bits (truncated: one AND), and the exact remainder lo = x - hi (|lo| < 2^-10 |x|, passed raw:
// the tensor core keeps its leading 11 bits, an error below 2^-20 |x|), and the three products
// but lo * lo accumulated, small ones first. Rounding both parts (four operations a value, not
// two) bought a 2^-22 bound that nothing downstream can see (the sweeps' TF32 operands round at
// 2^-11) for 30 % of the pair products' instructions. a and b as mma_tf32's lane operands, in fp32.
__device__ __forceinline__ void mma_tf32x3(float* d, const float (&a)[4], const float (&b)[2]) {
  uint32_t ah[4], al[4], bh[2], bl[2];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float h = __uint_as_float(__float_as_uint(a[e]) & 0xffffe000u);
    ah[e] = __float_as_uint(h), al[e] = __float_as_uint(a[e] - h);
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float h = __uint_as_float(__float_as_uint(b[e]) & 0xffffe000u);
    bh[e] = __float_as_uint(h), bl[e] = __float_as_uint(b[e] - h);
  }
  mma_tf32(d, al[0], al[1], al[2], al[3], bh[0], bh[1]);
  mma_tf32(d, ah[0], ah[1], ah[2], ah[3], bl[0], bl[1]);
  mma_tf32(d, ah[0], ah[1], ah[2], ah[3], bh[0], bh[1]);
}

// One m16n8k8 product on fp32 lane operands (mma_tf32's lane layout: A's four, B's two), the one
// place that picks its precision: with X3 fp32-accurate (mma_tf32x3, the values whole); else
// single TF32, each operand rounded unless it holds a TF32 value already (RA, RB: rounded where
// stored, widened bf16 / fp16, or fp32 values whose low bits the mma may ignore).
template <bool X3, bool RA = false, bool RB = false>
__device__ __forceinline__ void mma_lanes(float* d, float a0, float a1, float a2, float a3, float b0, float b1) {
  if constexpr (X3) {
    mma_tf32x3(d, {a0, a1, a2, a3}, {b0, b1});
  } else {
    auto ca = [](float x) { return RA ? __float_as_uint(x) : to_tf32(x); };
    auto cb = [](float x) { return RB ? __float_as_uint(x) : to_tf32(x); };
    mma_tf32(d, ca(a0), ca(a1), ca(a2), ca(a3), cb(b0), cb(b1));
  }
}
// mma_lanes on operands read as they stand (their bits; X3: whole).
template <bool X3>
__device__ __forceinline__ void mma_tf32_as(float* d, const float (&a)[4], const float (&b)[2]) {
  mma_lanes<X3, true, true>(d, a[0], a[1], a[2], a[3], b[0], b[1]);
}

// One warp's m16n8 product on TF32 tensor cores, for kernels whose tiles are not 64 x 64 (the
// RWKV7 chunk engine's 16-row chunks): acc (this lane's four m16n8 elements) += A[0..16, 0..kn)
// B[0..kn, 0..8) with A(r, k) and B(k, n) given as functions (the caller masks rows and k past the
// live range to 0; kn a multiple of 8). Operands rounded to TF32 (bf16 / fp16 inputs, as
// Frag<true>), or with X3 fp32-accurate (mma_tf32x3: fp32 inputs).
template <bool X3 = false, class A, class B>
__device__ __forceinline__ void warp_mma(float* acc, int kn, A a, B b) {
  const int g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
  for (int k = 0; k < kn; k += 8)
    mma_lanes<X3>(acc, a(g, k + q), a(g + 8, k + q), a(g, k + q + 4), a(g + 8, k + q + 4), b(k + q, g), b(k + q + 4, g));
}
// warp_mma on fp16 tensor cores: acc += (sa A)(sb B) for A [16][kn], B [kn][8] given as
// functions (kn a multiple of 16), each operand times its power of two (pow2_down_scale of its
// tile's largest magnitude) before the rounding; the caller takes 1 / (sa sb) out of acc, exactly.
template <class A, class B>
__device__ __forceinline__ void warp_mma_f16(float* acc, int kn, A a, B b, float sa, float sb) {
  const int g = threadIdx.x % 32 / 4, q2 = 2 * (threadIdx.x % 4);
  for (int k = 0; k < kn; k += 16)
    mma_f16(acc, f16_pair(sa * a(g, k + q2), sa * a(g, k + q2 + 1)),
            f16_pair(sa * a(g + 8, k + q2), sa * a(g + 8, k + q2 + 1)),
            f16_pair(sa * a(g, k + q2 + 8), sa * a(g, k + q2 + 9)),
            f16_pair(sa * a(g + 8, k + q2 + 8), sa * a(g + 8, k + q2 + 9)),
            f16_pair(sb * b(k + q2, g), sb * b(k + q2 + 1, g)), f16_pair(sb * b(k + q2 + 8, g), sb * b(k + q2 + 9, g)));
}
// warp_mma for operands in memory with row strides and nothing to mask: A(r, k) = a[r * lda + k]
// (TA: a[k * lda + r]), B(k, n) = b[k * ldb + n] (TB: b[n * ldb + k]), every element with k < kn
// (a multiple of 8) readable. The lane's addresses are formed once and stepped: the per-element
// index arithmetic and bounds selects of the functor form would be most of the instructions of
// a kernel like the RWKV7 sweep (integer multiply-adds, not mma).
// RA / RB: that operand holds TF32 values already (tf32_round, or widened bf16 / fp16), read
// without the rounding add.
// X3: fp32-accurate (mma_tf32x3; RA, RB are then ignored).
template <bool TA = false, bool TB = false, bool RA = false, bool RB = false, bool X3 = false>
__device__ __forceinline__ void warp_mma_ld(float* acc, int kn, const float* a, int lda,
                                            const float* b, int ldb) {
  const int g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
  const float* pa = TA ? a + q * lda + g : a + g * lda + q;
  const float* pb = TB ? b + g * ldb + q : b + q * ldb + g;
  const int a8 = TA ? 8 : 8 * lda, ak4 = TA ? 4 * lda : 4, ak8 = TA ? 8 * lda : 8;  // a8: row + 8
  const int bk4 = TB ? 4 : 4 * ldb, bk8 = TB ? 8 : 8 * ldb;
  for (int k = 0; k < kn; k += 8, pa += ak8, pb += bk8)
    mma_lanes<X3, RA, RB>(acc, pa[0], pa[a8], pa[ak4], pa[a8 + ak4], pb[0], pb[bk4]);
}

// acc += A B^T for row-major A [16][kn] and B [8][kn] (both k-contiguous: A(r, k) = a[r * lda + k],
// B(k, n) = b[n * ldb + k]), kn a multiple of 16, rows 16-byte aligned. The sum over k is taken
// in a lane-friendly order: lane q's k of a 16-wide step are 4q .. 4q + 3 on both operands, so
// each row's fragment for two mma k-steps is one 16-byte load (3 loads per two mma instead of
// 12). Lane g takes row nt_perm(g) (and nt_perm(g) + 8) of A and row nt_perm(g) of B, so that
// the two rows of a load phase (g = 2p, 2p + 1) are 4 apart: conflict-free for strides that are
// 4 mod 32 floats. The accumulator elements are at nt_row / nt_col.
__device__ __forceinline__ int nt_perm(int g) { return (g >> 1) + 4 * (g & 1); }
// warp_mma_nt_tiles: the same for nb <= NB n-tiles of B at once (tile t's rows at b + 8 t ldb,
// into acc[t]): each A fragment is loaded once for all of them (shared-memory bytes, not
// instructions, bound the RWKV7 gradient kernel).
// X3: fp32-accurate (mma_tf32x3; RA, RB are then ignored).
template <bool RA = false, bool RB = false, int NB = 1, bool X3 = false>
__device__ __forceinline__ void warp_mma_nt_tiles(float (*acc)[4], int nb, int kn, const float* a, int lda,
                                                  const float* b, int ldb) {
  const int g = threadIdx.x % 32 / 4, q = threadIdx.x % 4, pg = nt_perm(g);
  const float* pa = a + pg * lda + 4 * q;
  const float* pb = b + pg * ldb + 4 * q;
  for (int k = 0; k < kn; k += 16, pa += 16, pb += 16) {
    const float4 lo = *reinterpret_cast<const float4*>(pa), hi = *reinterpret_cast<const float4*>(pa + 8 * lda);
#pragma unroll
    for (int t = 0; t < NB; ++t) {
      if (t >= nb) break;
      const float4 bb = *reinterpret_cast<const float4*>(pb + 8 * t * ldb);
      mma_lanes<X3, RA, RB>(acc[t], lo.x, hi.x, lo.y, hi.y, bb.x, bb.y);
      mma_lanes<X3, RA, RB>(acc[t], lo.z, hi.z, lo.w, hi.w, bb.z, bb.w);
    }
  }
}
template <bool RA = false, bool RB = false, bool X3 = false>
__device__ __forceinline__ void warp_mma_nt(float* acc, int kn, const float* a, int lda, const float* b, int ldb) {
  warp_mma_nt_tiles<RA, RB, 1, X3>(reinterpret_cast<float(*)[4]>(acc), 1, kn, a, lda, b, ldb);
}
__device__ __forceinline__ int nt_row(int m0, int e) { return m0 + nt_perm(threadIdx.x % 32 / 4) + 8 * (e / 2); }
__device__ __forceinline__ int nt_col(int n0, int e) { return n0 + threadIdx.x % 4 + 4 * (e % 2); }

// For 8-byte fragment loads (a warp's LDS.64 goes in two phases of 16 lanes, g = 0..3 and 4..7):
// lane g takes row kp_perm(g) (and + 8), so that a phase's four rows are 2 apart, at banks 8
// apart for strides that are 4 mod 32 floats. The accumulator rows are at kp_row.
__device__ __forceinline__ int kp_perm(int g) { return 2 * (g & 3) + (g >> 2); }
__device__ __forceinline__ int kp_row(int m0, int e) { return m0 + kp_perm(threadIdx.x % 32 / 4) + 8 * (e / 2); }

// Row and column of this lane's accumulator element e (0..3) in an m16n8 tile at (m0, n0).
__device__ __forceinline__ int acc_row(int m0, int e) { return m0 + threadIdx.x % 32 / 4 + 8 * (e / 2); }
__device__ __forceinline__ int acc_col(int n0, int e) { return n0 + 2 * (threadIdx.x % 4) + e % 2; }

template <>
struct Frag<true> {
  float v[16] = {};  // v[4 j + e]: n-tile j, element e of the m16n8 accumulator
  __device__ static int row(int i) {
    return 16 * (int(threadIdx.x) / 32 % 4) + int(threadIdx.x) % 32 / 4 + 8 * (i / 2 % 2);
  }
  __device__ static int col(int i) {
    return 32 * (int(threadIdx.x) / 128) + 8 * (i / 4) + 2 * (int(threadIdx.x) % 4) + i % 2;
  }
  static constexpr int kRowsPer = 2, kGroupLanes = 4;  // as Frag<false>
  __device__ static int row_slot(int i) { return i / 2 % 2; }
  __device__ static int slot_row(int r) { return row(2 * r); }

  // RAW: both operands hold TF32 values already (tf32_round, or widened bf16 / fp16 inputs).
  template <bool TA, Tri TR = Tri::Full, bool RAW = false, int NA, int NB>
  __device__ __forceinline__ void mma(const float (*a)[NA], const float (*b)[NB], int K) {
    const int w = threadIdx.x / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
    const int r0 = 16 * (w % 4), c0 = 32 * (w / 4);
    const int k0 = TR == Tri::KFromRow ? r0 : 0;
    const int k1 = TR == Tri::KUpToRow ? min(K, r0 + 16) : K;
    auto cv = [](float x) { return RAW ? __float_as_uint(x) : to_tf32(x); };
    auto A = [&](int r, int k) { return cv(TA ? a[k][r] : a[r][k]); };
#pragma unroll 2
    for (int k = k0; k < k1; k += 8) {
      const uint32_t a0 = A(r0 + g, k + q), a1 = A(r0 + g + 8, k + q);
      const uint32_t a2 = A(r0 + g, k + q + 4), a3 = A(r0 + g + 8, k + q + 4);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t b0 = cv(b[k + q][c0 + 8 * j + g]);
        const uint32_t b1 = cv(b[k + q + 4][c0 + 8 * j + g]);
        mma_tf32(v + 4 * j, a0, a1, a2, a3, b0, b1);
      }
    }
  }
  template <bool TA, class KB, class KE, class S, class Live>
  __device__ __forceinline__ void mma_blocks(const Tile* a, const Tile* b, KB kb, KE ke, S s,
                                             Live live) {
    const int w = threadIdx.x / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
    const int rb = w % 4, r0 = 16 * rb, c0 = 32 * (w / 4);
    const bool on0 = live(rb, c0 / 16), on1 = live(rb, c0 / 16 + 1);  // warp-uniform
    if (!on0 && !on1) return;
    auto A = [&](int r, int k) { return to_tf32(TA ? a[k][r] : a[r][k]); };
    for (int k = kb(rb); k < ke(rb); k += 8) {
      const uint32_t a0 = A(r0 + g, k + q), a1 = A(r0 + g + 8, k + q);
      const uint32_t a2 = A(r0 + g, k + q + 4), a3 = A(r0 + g + 8, k + q + 4);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (!(j < 2 ? on0 : on1)) continue;
        const int col = c0 + 8 * j + g;
        const uint32_t b0 = to_tf32(b[k + q][col] * s(k + q, col, rb));
        const uint32_t b1 = to_tf32(b[k + q + 4][col] * s(k + q + 4, col, rb));
        mma_tf32(v + 4 * j, a0, a1, a2, a3, b0, b1);
      }
    }
  }
};

}  // namespace tile
}  // namespace fla
