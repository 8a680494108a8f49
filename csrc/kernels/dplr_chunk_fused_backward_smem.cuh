// The shared memory and the small parts of the RWKV7 single-pass backward
// (dplr_chunk_fused_backward.cuh): the chunk's operand tiles as scaled fp16, the fp32 buffers of
// the sums over the value columns, and the small products and sums the kernel's steps share.
#pragma once
#include <cuda_fp16.h>

#include "dplr_f16_states.cuh"

namespace fla {
namespace dplr_fused_detail {

// The chunk's operand tiles as scaled fp16 (row strides in halves: 16-byte rows, conflict-free
// ldmatrix), after FusedSmem<1>'s block, its steps' scratch and the chunk's v rows (the first C
// of FusedSmem<1>'s state rows: D is in registers here, and the rest of them unused): R^, Â, K^,
// B^, rho dO and v [C][kF16Row], the pair matrices A_rk, A_rb, A_ak and X [C][kF16Mat], and each
// tile's scale.
constexpr int kF16Row = K + 8, kF16Mat = C + 8;
constexpr int kVRows = FusedSmem<1>::state, kChainTilesAt = kVRows + C * LB;  // (floats)
struct ChainTiles {
  enum { kRhat, kAhat, kKhat, kBhat, kDout, kV, kArk, kArb, kAak, kX, kTiles };
  __half* rows;  // [6][C][kF16Row]
  __half* mats;  // [4][C][kF16Mat]
  float* scale;  // [kTiles]
  __device__ explicit ChainTiles(float* sm)
      : rows(reinterpret_cast<__half*>(sm + kChainTilesAt)),
        mats(rows + 6 * C * kF16Row),
        scale(reinterpret_cast<float*>(mats + 4 * C * kF16Mat)) {}
  __device__ const __half* tile(int t) const {
    return t < kArk ? rows + t * C * kF16Row : mats + (t - kArk) * C * kF16Mat;
  }
  __device__ static int ld(int t) { return t < kArk ? kF16Row : kF16Mat; }
  static constexpr size_t bytes() {  // (with everything before it)
    return size_t(kChainTilesAt) * 4 + (6 * C * kF16Row + 4 * C * kF16Mat) * 2 + kTiles * 4;
  }
};

// The fp32 source of chain tile t in the chunk's block, its row stride and columns.
__device__ inline const float* chain_source(const float* blk, int t, int& ld, int& cols) {
  using B = ChunkBlock;
  const int at[] = {B::rhat, B::ahat, B::khat, B::bhat, B::crow};
  const int mat[] = {kMatArk, kMatArb, kMatAak, kMatX};
  if (t == ChainTiles::kV) {
    ld = LB, cols = V;
    return blk - FusedSmem<1>::block(0) + kVRows;
  }
  if (t < ChainTiles::kArk) {
    ld = t < ChainTiles::kKhat ? LA : LB, cols = K;
    return blk + at[t];
  }
  ld = LM, cols = C;
  return blk + B::mats + mat[t - ChainTiles::kArk] * C * LM;
}

// One warp: a [C][kCols] fp32 tile (row stride ld, rows 16-byte aligned) as scaled fp16 into dst
// (row stride dld halves); returns the scale (every lane). The tile is read once, as float4s.
template <int kCols>
__device__ inline float warp_tile_to_f16(const float* src, int ld, __half* dst, int dld, int lane) {
  constexpr int kRowPieces = kCols / 4, kPieces = C * kRowPieces / 32;
  static_assert(kCols % 4 == 0 && (C * kRowPieces) % 32 == 0, "float4 pieces, as many a lane");
  float4 x[kPieces];
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < kPieces; ++i) {
    const int e = lane + 32 * i, row = e / kRowPieces, col = 4 * (e % kRowPieces);
    x[i] = *reinterpret_cast<const float4*>(src + row * ld + col);
    m = fmaxf(m, fmaxf(fmaxf(fabsf(x[i].x), fabsf(x[i].y)), fmaxf(fabsf(x[i].z), fabsf(x[i].w))));
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float s = tile::pow2_down_scale(m);
#pragma unroll
  for (int i = 0; i < kPieces; ++i) {
    const int e = lane + 32 * i, row = e / kRowPieces, col = 4 * (e % kRowPieces);
    *reinterpret_cast<uint2*>(dst + row * dld + col) =
        make_uint2(tile::f16_pair(s * x[i].x, s * x[i].y), tile::f16_pair(s * x[i].z, s * x[i].w));
  }
  return s;
}

// Every chain tile as scaled fp16, a warp a tile (its largest magnitude, its scale, its halves),
// then one barrier. After X is made; ends synchronised.
__device__ inline void make_chain_tiles(const float* blk, const ChainTiles& ct, int tid) {
  static_assert(K == V, "the row tiles share one shape");
  const int warp = tid / 32, lane = tid % 32;
  for (int t = warp; t < ChainTiles::kTiles; t += NTF / 32) {
    int ld, cols;
    const float* const src = chain_source(blk, t, ld, cols);
    __half* const dst = const_cast<__half*>(ct.tile(t));
    const float s = t < ChainTiles::kArk ? warp_tile_to_f16<K>(src, ld, dst, kF16Row, lane)
                                         : warp_tile_to_f16<C>(src, ld, dst, kF16Mat, lane);
    if (lane == 0) ct.scale[t] = s;
  }
  __syncthreads();
}

// A product's scales sa, sb taken out of its results: x (1 / sa) (1 / sb), one factor at a time
// (their product may overflow), the reciprocals formed once.
struct Unscale {
  float ia, ib;
  __device__ Unscale(float sa, float sb) : ia(tile::inverse_pow2(sa)), ib(tile::inverse_pow2(sb)) {}
  __device__ float operator()(float x) const { return x * ia * ib; }
};
__device__ __forceinline__ float unscale(float x, float sa, float sb) { return Unscale(sa, sb)(x); }

// A [K][V] fp32 state (hst's layout) at this warp's columns, held transposed.
__device__ inline void load_held(float (&ht)[K / 8][4], const float* S, const HeldLane& ln) {
#pragma unroll
  for (int t = 0; t < K / 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) ht[t][e] = S[ln.chan(t, e) * V + ln.col(e)];
}
// Step 2's buffers, after the chain tiles, sized for two CTAs an SM (c68): part (the column
// blocks of the 16 x 64 sums, column_sum's, then each warp's four 16 x 16 partials and zeta's);
// the sums (big: dR^, dK^, dB^, dW, then dr, dk, db in place and dw over dW; small: dA_rk, dA_rb,
// dA_ak, dU M^T, then zeta_s: rowsum(S * dS+)); the chunk's raw rows r, w, k, a, b as they came
// (16-bit). Once the sums are taken, part's space holds the chunk-wide matrices and the decay
// factors: dÂ, e^G, e^Omega [C][K] (then the dw scan's group maps), dX, dA_ab, Y [C][C]. Their
// rows are padded to 8 mod 32 floats (kRow, kMatRow; the partials stay dense): then a half warp's
// 8-byte accesses at accumulator positions (rows g, columns 2q, 2q + 1) and the TF32 fragment
// loads with k along the rows (B, transposed A) fall on distinct banks, where rows of K or C
// floats put four or eight rows on one bank (benchmarks/NOTES.md c70).
struct GradSmem {
  static constexpr int kRow = K + 8, kMatRow = C + 8;
  static constexpr int kPart = 4 * C * C + K;  // a warp's partials
  static_assert(kPart % 4 == 0, "sum_partials reads float4s");
  enum { kDR, kDK, kDB, kDW };
  enum { kDArk, kDArb, kDAak, kDX1 };
  enum { kEG, kEO };
  enum { kR, kW, kK, kA, kB };
  static constexpr int kChunkFloats = 3 * C * kRow + 3 * C * kMatRow;
  static constexpr int kPartSpace = 4 * kPart > kChunkFloats ? 4 * kPart : kChunkFloats;  // (floats)
  float *part, *big, *small, *zeta_s, *dahat, *fac, *dx, *daab, *y;
  uint16_t* raw;  // [5][C][K], the inputs' 16-bit elements
  __device__ explicit GradSmem(float* sm) {
    part = sm + (ChainTiles::bytes() + 15) / 16 * 4;
    big = part + kPartSpace;
    small = big + 4 * C * kRow;
    zeta_s = small + 4 * C * kMatRow;
    raw = reinterpret_cast<uint16_t*>(zeta_s + K);
    dahat = part;
    fac = dahat + C * kRow;
    dx = fac + 2 * C * kRow;
    daab = dx + C * kMatRow;
    y = daab + C * kMatRow;
  }
  static constexpr size_t bytes() {
    return (ChainTiles::bytes() + 15) / 16 * 16 + 4 * (kPartSpace + 4 * C * kRow + 4 * C * kMatRow + K) + 2 * 5 * C * K;
  }
  // raw row i, channel d of input m (kR ..) as fp32
  template <typename T>
  __device__ float in(int m, int i, int d) const {
    T x;
    memcpy(&x, raw + m * C * K + i * K + d, sizeof x);
    return to_f(x);
  }
};
static_assert(2 * (GradSmem::bytes() + 1024) <= 228 * 1024, "two CTAs an SM");

// The 16 x 64 sums over the value columns without partials: each warp puts its column block of
// the column-side operands into shared memory as the fp16 values its products would read (a
// held H^T as a [V][kF16Row] tile, H^T's columns as its rows; an A operand of the chunk's rows by
// its columns into a [C][kF16Row] tile), with its scale; then each warp takes every warp's block
// for its own 16 channels (column_sum). The same products, scales and order of the sum as each
// warp's partial summed in warp order, so the same bits, with fewer barriers and no partials.
__device__ inline void put_held_f16(const float (&ht)[K / 8][4], float s, __half* tile, const HeldLane& ln) {
#pragma unroll
  for (int t = 0; t < K / 8; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h)  // (elements 2h, 2h + 1: one column, two channels)
      *reinterpret_cast<uint32_t*>(tile + ln.col(2 * h) * kF16Row + ln.chan(t, 0)) =
          tile::f16_pair(s * ht[t][2 * h], s * ht[t][2 * h + 1]);
}
__device__ inline void put_a_f16(const tile::F16A& a, __half* tile, const HeldLane& ln) {
  __half* const at = tile + ln.g * kF16Row + ln.x0 + 2 * ln.q;  // (mma_f16's A lane layout)
  *reinterpret_cast<uint32_t*>(at) = a.r[0];
  *reinterpret_cast<uint32_t*>(at + 8 * kF16Row) = a.r[1];
  *reinterpret_cast<uint32_t*>(at + 8) = a.r[2];
  *reinterpret_cast<uint32_t*>(at + 8 * kF16Row + 8) = a.r[3];
}
// out (the chunk's rows by channels d0 .. d0 + 15, rows of GradSmem::kRow) = sum over the column
// blocks w = 0..3, in order, of A_w B_w / (sa[w] sb[w]): A_w columns 16w .. of a [C][kF16Row]
// tile, B_w rows 16w .. of a [V][kF16Row] tile.
__device__ inline void column_sum(const __half* a_tile, const float* sa, const __half* b_tile, const float* sb, int d0,
                                  float* out) {
  const HeldLane ln(threadIdx.x);
  float acc[2][4] = {};
#pragma unroll
  for (int w = 0; w < NTF / 32; ++w) {
    const tile::F16A a = tile::a_from_mk(a_tile + 16 * w, kF16Row);
    tile::F16B b[2];
    tile::b_from_kn(b, b_tile + 16 * w * kF16Row + d0, kF16Row);
    const Unscale un(sa[w], sb[w]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float part[4] = {};
      tile::mma_f16(part, a, b[nt]);
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] = w ? acc[nt][e] + un(part[e]) : un(part[e]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h)  // (rows g, g + 8; two channels each)
      *reinterpret_cast<float2*>(out + (ln.g + 8 * h) * GradSmem::kRow + d0 + 8 * nt + 2 * ln.q) =
          make_float2(acc[nt][2 * h], acc[nt][2 * h + 1]);
}

// A warp's accumulator partial (m: 16 rows, n: 16 x nt columns, element e of tile t at row
// g + 8 (e / 2), column 8t + 2q + e % 2) into its part at off, row-major with row stride ld. Not
// synchronised.
template <int nt>
__device__ inline void put_partial(const GradSmem& gs, const float (&acc)[nt][4], int off, int ld, int tid) {
  const HeldLane ln(tid);
  float* const mine = gs.part + tid / 32 * GradSmem::kPart + off;
#pragma unroll
  for (int t = 0; t < nt; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) mine[(ln.g + 8 * (e / 2)) * ld + ln.chan(t, e)] = acc[t][e];
}
// A barrier, the four warps' partials (the four [C][C] matrices dense, then zeta's K) summed in
// warp order (so the sums are the same bits whatever the schedule) into small's matrices (rows
// of kMatRow) and zeta_s, a barrier.
__device__ inline void sum_partials(const GradSmem& gs, int tid) {
  constexpr int kMats = 4 * C * C;
  __syncthreads();
  auto at = [&](int w, int e) { return *reinterpret_cast<const float4*>(gs.part + w * GradSmem::kPart + e); };
  for (int e = 4 * tid; e < kMats + K; e += 4 * NTF) {  // (the part's stride a multiple of 4)
    const float4 a = at(0, e), b = at(1, e), c = at(2, e), d = at(3, e);
    float* const out = e < kMats ? gs.small + e / C * GradSmem::kMatRow + e % C : gs.zeta_s + (e - kMats);
    *reinterpret_cast<float4*>(out) = make_float4(((a.x + b.x) + c.x) + d.x, ((a.y + b.y) + c.y) + d.y,
                                                  ((a.z + b.z) + c.z) + d.z, ((a.w + b.w) + c.w) + d.w);
  }
  __syncthreads();
}

// acc (this warp's 16 columns x the chunk's 16 rows) += H^T R^T for a held H^T (ht, scale sh:
// the columns by the channels) and a [C][K] chain tile R (t): a product over the channels, its
// scales left in acc.
__device__ inline void held_by_rows(const ChainTiles& ct, int t, const float (&ht)[K / 8][4], float sh,
                                    float (&acc)[2][4]) {
  tile::F16B b[2];
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    tile::b_from_nk(b, ct.tile(t) + 16 * kk, kF16Row);
    const tile::F16A a = tile::a_from_acc(ht[2 * kk], ht[2 * kk + 1], sh);
    tile::mma_f16(acc[0], a, b[0]), tile::mma_f16(acc[1], a, b[1]);
  }
}

// ht (this warp's columns by the channels) <- ht gamma + A1 R1 + A2 R2 for two A operands (the
// columns by the chunk's rows; scales s1, s2) and two [C][K] chain tiles R1, R2 (t1, t2; read as
// [row][channel]): the form of both state updates, S+ = gamma S + K^^T V + B^^T U forward and
// D <- gamma D + rho R^^T dO + Â^T dM in reverse, held transposed. gamma S exact.
__device__ inline void update_held(const ChainTiles& ct, const float* gamma, float (&ht)[K / 8][4],
                                   const tile::F16A& a1, float s1, int t1, const tile::F16A& a2, float s2, int t2) {
  const HeldLane ln(threadIdx.x);
  const Unscale un1(s1, ct.scale[t1]), un2(s2, ct.scale[t2]);
#pragma unroll
  for (int kt = 0; kt < K / 16; ++kt) {
    float p1[2][4] = {}, p2[2][4] = {};
    tile::F16B b[2];
    tile::b_from_kn(b, ct.tile(t1) + 16 * kt, kF16Row);
    tile::mma_f16(p1[0], a1, b[0]), tile::mma_f16(p1[1], a1, b[1]);
    tile::b_from_kn(b, ct.tile(t2) + 16 * kt, kF16Row);
    tile::mma_f16(p2[0], a2, b[0]), tile::mma_f16(p2[1], a2, b[1]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 2 * kt + nt;
        ht[t][e] = ht[t][e] * gamma[ln.chan(t, e)] + un1(p1[nt][e]) + un2(p2[nt][e]);
      }
  }
}

// A staged chunk's steps (chunk_steps' decays, factored keys where bounded and pair matrices,
// then X), returning whether the chunk is bounded. The pair matrices on single TF32 for 16-bit
// inputs, as the fused forward's (the chain reads them as scaled fp16 tiles; the gradients' errors
// on the stress cases were the same to three digits as on 3xTF32's: benchmarks/NOTES.md c69),
// 3xTF32 for fp32. After the staging; ends synchronised.
template <typename T>
__device__ inline bool steps_with_x(const ChunkSteps& at, const DplrChunkPass& p, const SeqSpan& s, int h, int64_t ci,
                                    int tid) {
  __syncthreads();  // the staged rows
  const bool bounded = __syncthreads_and(decay_scan(at, tid));
  if (bounded) factor_keys(at, tid);
  __syncthreads();
  pair_matrices<T, std::is_same<T, float>::value, 4, false>(at, bounded, p, s, h, ci, tid);
  __syncthreads();
  if (tid < 32) solve_x(at.blk, tid);
  __syncthreads();  // X
  return bounded;
}

// U^T = (S^T Â^T + M^T) X^T with M^T = V^T A_ak^T, at this warp's columns (m) by the chunk's rows
// (n): S^T held (scale ss), V^T the A operand va (its tile's scale sv). mt gets M^T, ut U^T.
__device__ inline void state_products(const ChainTiles& ct, const tile::F16A& va, float sv, const float (&st)[K / 8][4],
                                      float ss, float (&mt)[2][4], float (&ut)[2][4]) {
  using CT = ChainTiles;
  float yt[2][4] = {};
  tile::F16B b[2];
  tile::b_from_nk(b, ct.tile(CT::kAak), kF16Mat);
  tile::mma_f16(mt[0], va, b[0]), tile::mma_f16(mt[1], va, b[1]);
  held_by_rows(ct, CT::kAhat, st, ss, yt);
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      mt[t][e] = unscale(mt[t][e], sv, ct.scale[CT::kAak]), yt[t][e] = unscale(yt[t][e], ss, ct.scale[CT::kAhat]) + mt[t][e];
  const float sy = tile::pow2_down_scale(warp_amax(yt));
  tile::b_from_nk(b, ct.tile(CT::kX), kF16Mat);
  const tile::F16A ya = tile::a_from_acc(yt[0], yt[1], sy);
  tile::mma_f16(ut[0], ya, b[0]), tile::mma_f16(ut[1], ya, b[1]);
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) ut[t][e] = unscale(ut[t][e], sy, ct.scale[CT::kX]);
}

}  // namespace dplr_fused_detail
}  // namespace fla
