// Issue 28's backward kernel for the chunked RWKV7 engine, under construction (benchmarks/NOTES.md
// c67): one CTA of four warps per (sequence, head) walks the chunks latest first, warp w owning
// the value columns 16w .. 16w + 15, each warp's quantities held transposed in registers (D^T:
// m = its columns, n = the channels) so that every warp-local product reads the previous one's
// accumulators as its left operand, all products on fp16 tensor cores with a power-of-two scale
// per operand (tile_mma.cuh: a_from_acc, ldmatrix loads; TF32's rounding, docs/algorithms.md
// §2.8). The chunk's own steps (decays, pair matrices, X) are the fused reverse pass's.
//
// This step: the warp-local chain (docs/algorithms.md §6.4)
//   dU = rho A_rb^T dO + B^ D,  dM = X^T dU,  dV = rho A_rk^T dO + K^ D + A_ak^T dM,
//   D <- gamma D + rho R^^T dO + Â^T dM,
// which gives dv and dh0 and reads no state. It is run by the emulator's tests only; the op's
// backward does not launch it yet.
#pragma once
#include <cuda_fp16.h>

#include "dplr_chunk_fused_steps.cuh"

namespace fla {
namespace dplr_fused_detail {

// The chunk's operand tiles as scaled fp16 (row strides in halves: 16-byte rows, conflict-free
// ldmatrix), after FusedSmem<1>'s floats: R^, Â, K^, B^ and rho dO [C][kF16Row], the pair
// matrices A_rk, A_rb, A_ak and X [C][kF16Mat], and each tile's scale.
constexpr int kF16Row = K + 8, kF16Mat = C + 8;
struct ChainTiles {
  enum { kRhat, kAhat, kKhat, kBhat, kDout, kArk, kArb, kAak, kX, kTiles };
  __half* rows;  // [5][C][kF16Row]
  __half* mats;  // [4][C][kF16Mat]
  float* scale;  // [kTiles]
  __device__ explicit ChainTiles(float* sm)
      : rows(reinterpret_cast<__half*>(sm + FusedSmem<1>::total)),
        mats(rows + 5 * C * kF16Row),
        scale(reinterpret_cast<float*>(mats + 4 * C * kF16Mat)) {}
  __device__ const __half* tile(int t) const {
    return t < kArk ? rows + t * C * kF16Row : mats + (t - kArk) * C * kF16Mat;
  }
  __device__ static int ld(int t) { return t < kArk ? kF16Row : kF16Mat; }
  static constexpr size_t bytes() {
    return size_t(FusedSmem<1>::total) * 4 + (5 * C * kF16Row + 4 * C * kF16Mat) * 2 + kTiles * 4;
  }
};

// The fp32 source of chain tile t in the chunk's block, its row stride and columns.
__device__ inline const float* chain_source(const float* blk, int t, int& ld, int& cols) {
  using B = ChunkBlock;
  const int at[] = {B::rhat, B::ahat, B::khat, B::bhat, B::crow};
  const int mat[] = {kMatArk, kMatArb, kMatAak, kMatX};
  if (t < ChainTiles::kArk) {
    ld = t < ChainTiles::kKhat ? LA : LB, cols = K;
    return blk + at[t];
  }
  ld = LM, cols = C;
  return blk + B::mats + mat[t - ChainTiles::kArk] * C * LM;
}

// Every chain tile's scale (a warp per tile in turn: its largest magnitude), a barrier, then the
// tiles times their scales as fp16. After X is made; ends synchronised.
__device__ inline void make_chain_tiles(const float* blk, const ChainTiles& ct, int tid) {
  const int warp = tid / 32, lane = tid % 32;
  for (int t = warp; t < ChainTiles::kTiles; t += NTF / 32) {
    int ld, cols;
    const float* const src = chain_source(blk, t, ld, cols);
    float m = 0.f;
    for (int e = lane; e < C * cols; e += 32) m = fmaxf(m, fabsf(src[e / cols * ld + e % cols]));
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) ct.scale[t] = tile::pow2_down_scale(m);
  }
  __syncthreads();
  for (int t = 0; t < ChainTiles::kTiles; ++t) {
    int ld, cols;
    const float* const src = chain_source(blk, t, ld, cols);
    const float s = ct.scale[t];
    __half* const dst = const_cast<__half*>(ct.tile(t));
    for (int e = tid; e < C * cols; e += NTF)
      dst[e / cols * ChainTiles::ld(t) + e % cols] = __float2half_rn(s * src[e / cols * ld + e % cols]);
  }
  __syncthreads();
}

// The largest magnitude of a warp's accumulator tiles x[t][0..4) (every lane returns it).
template <int n>
__device__ inline float warp_amax(const float (&x)[n][4]) {
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < n; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) m = fmaxf(m, fabsf(x[i][e]));
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// x * (1 / sa) * (1 / sb): a product's scales taken out one at a time (their product may overflow).
__device__ __forceinline__ float unscale(float x, float sa, float sb) { return x * (1.f / sa) * (1.f / sb); }

}  // namespace dplr_fused_detail

// The chain over the chunks, latest first; dv and dh0 (and nothing else) written.
template <typename T>
__global__ void __launch_bounds__(kDplrFusedThreads) fused_backward_chain_kernel(const DplrChunkPass p) {
  using namespace dplr_fused_detail;
  using tile::F16A;
  using tile::F16B;
  using L = FusedSmem<1>;
  float* const sm = fused_smem();
  const auto [h, n, s, nch] = FusedTask(p);
  const int tid = threadIdx.x, g = tid % 32 / 4, q = tid % 4, x0 = 16 * (tid / 32);
  const ChunkSteps at = ChunkSteps::at<L>(sm, 0);
  const ChainTiles ct(sm);
  ChunkRows<T> rows(p, p.dout, s, h, tid);
  using CT = ChainTiles;
  // D^T at this warp's columns: tile t holds channels 8t .. 8t + 7; element e at column
  // x0 + g + 8 (e / 2), channel 8t + 2q + e % 2.
  float dt[K / 8][4];
  auto col = [&](int e) { return x0 + g + 8 * (e / 2); };
  auto chan = [&](int t, int e) { return 8 * t + 2 * q + e % 2; };
#pragma unroll
  for (int t = 0; t < K / 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) dt[t][e] = p.dht.on() ? *mptr(p.dht, n, h, chan(t, e), col(e)) : 0.f;
  if (nch > 0) rows.fetch(nch - 1);
  for (int64_t ci = nch - 1; ci >= 0; --ci) {
    rows.stage(at, float(p.scale));
    __syncthreads();
    if (ci > 0) rows.fetch(ci - 1);
    chunk_steps<T, true>(at, p, s, h, ci);
    if (tid < 32) solve_x(at.blk, tid);
    __syncthreads();  // X
    make_chain_tiles(at.blk, ct, tid);
    auto sc = [&](int t) { return ct.scale[t]; };
    const float sd = tile::pow2_down_scale(warp_amax(dt));
    // rho dO^T (m = this warp's columns, k = the rows), from the tile stored [row][column]
    const F16A dot = tile::a_from_km(ct.tile(CT::kDout) + x0, kF16Row);
    // dU^T = rho dO^T A_rb + D^T B^^T (16 columns x 16 rows: two n tiles)
    float du[2][4] = {}, part[2][4] = {};
    {
      F16B b[2];
      tile::b_from_kn(b, ct.tile(CT::kArb), kF16Mat);
      tile::mma_f16(du[0], dot, b[0]), tile::mma_f16(du[1], dot, b[1]);
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk) {
        tile::b_from_nk(b, ct.tile(CT::kBhat) + 16 * kk, kF16Row);
        const F16A a = tile::a_from_acc(dt[2 * kk], dt[2 * kk + 1], sd);
        tile::mma_f16(part[0], a, b[0]), tile::mma_f16(part[1], a, b[1]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          du[nt][e] = unscale(du[nt][e], sc(CT::kDout), sc(CT::kArb)) + unscale(part[nt][e], sd, sc(CT::kBhat));
    }
    // dM^T = dU^T X
    float dm[2][4] = {};
    const float sdu = tile::pow2_down_scale(warp_amax(du));
    {
      F16B b[2];
      tile::b_from_kn(b, ct.tile(CT::kX), kF16Mat);
      const F16A a = tile::a_from_acc(du[0], du[1], sdu);
      tile::mma_f16(dm[0], a, b[0]), tile::mma_f16(dm[1], a, b[1]);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dm[nt][e] = unscale(dm[nt][e], sdu, sc(CT::kX));
    }
    const float sdm = tile::pow2_down_scale(warp_amax(dm));
    const F16A dma = tile::a_from_acc(dm[0], dm[1], sdm);
    // dV^T = rho dO^T A_rk + D^T K^^T + dM^T A_ak, to dv (rows of the sequence only)
    {
      float v1[2][4] = {}, v2[2][4] = {}, v3[2][4] = {};
      F16B b[2];
      tile::b_from_kn(b, ct.tile(CT::kArk), kF16Mat);
      tile::mma_f16(v1[0], dot, b[0]), tile::mma_f16(v1[1], dot, b[1]);
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk) {
        tile::b_from_nk(b, ct.tile(CT::kKhat) + 16 * kk, kF16Row);
        const F16A a = tile::a_from_acc(dt[2 * kk], dt[2 * kk + 1], sd);
        tile::mma_f16(v2[0], a, b[0]), tile::mma_f16(v2[1], a, b[1]);
      }
      tile::b_from_kn(b, ct.tile(CT::kAak), kF16Mat);
      tile::mma_f16(v3[0], dma, b[0]), tile::mma_f16(v3[1], dma, b[1]);
      const int64_t t0 = ci * C;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = 8 * nt + 2 * q + e % 2;
          if (t0 + j >= s.len) continue;
          const float v = unscale(v1[nt][e], sc(CT::kDout), sc(CT::kArk)) + unscale(v2[nt][e], sd, sc(CT::kKhat)) +
                          unscale(v3[nt][e], sdm, sc(CT::kAak));
          *vptr<T>(p.dv, s.b, s.bos + t0 + j, h, col(e)) = from_f<T>(v);
        }
    }
    // D^T <- D^T gamma + rho dO^T R^ + dM^T Â (n: the channels, two 8-channel tiles a load)
#pragma unroll
    for (int kt = 0; kt < K / 16; ++kt) {
      float r2[2][4] = {}, a2[2][4] = {};
      F16B b[2];
      tile::b_from_kn(b, ct.tile(CT::kRhat) + 16 * kt, kF16Row);
      tile::mma_f16(r2[0], dot, b[0]), tile::mma_f16(r2[1], dot, b[1]);
      tile::b_from_kn(b, ct.tile(CT::kAhat) + 16 * kt, kF16Row);
      tile::mma_f16(a2[0], dma, b[0]), tile::mma_f16(a2[1], dma, b[1]);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = 2 * kt + nt;
          dt[t][e] = dt[t][e] * at.blk[ChunkBlock::gam + chan(t, e)] + unscale(r2[nt][e], sc(CT::kDout), sc(CT::kRhat)) +
                     unscale(a2[nt][e], sdm, sc(CT::kAhat));
        }
    }
    __syncthreads();  // the block and the tiles, before the next chunk's staging
  }
  if (p.dh0.on())
#pragma unroll
    for (int t = 0; t < K / 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) *mptr(p.dh0, n, h, chan(t, e), col(e)) = dt[t][e];
}

}  // namespace fla
