// Issue 28's backward kernel for the chunked RWKV7 engine, under construction (benchmarks/NOTES.md
// c67): one CTA of four warps per (sequence, head) walks the chunks latest first, warp w owning
// the value columns 16w .. 16w + 15, each warp's quantities held transposed in registers (D^T:
// m = its columns, n = the channels) so that every warp-local product reads the previous one's
// accumulators as its left operand, all products on fp16 tensor cores with a power-of-two scale
// per operand (tile_mma.cuh: a_from_acc, ldmatrix loads; TF32's rounding, docs/algorithms.md
// §2.8). The chunk's own steps (decays, pair matrices, X) are the fused reverse pass's.
//
// Built so far (docs/algorithms.md §6.4):
//   1. the warp-local chain dU = rho A_rb^T dO + B^ D, dM = X^T dU, dV = rho A_rk^T dO + K^ D +
//      A_ak^T dM, D <- gamma D + rho R^^T dO + Â^T dM: dv and dh0, no state read;
//   2. with every chunk-start state given (hst, fp32, as the two-kernel forward stores it): U^T,
//      the sums over the value columns (dR^, dK^, dB^, dW; dA_rk, dA_rb, dA_ak, dU M^T; zeta's
//      rowsum(S * dS+)) from each warp's partials in a fixed order, then the chunk-wide rest in
//      fp32 (dÂ, dX, dA_ab, the K-vector gradients in the factored forms, the dw scan).
// Chunks past the factoring bound take exact pair walks (SIMT) for the K-vector gradients.
// Not yet: the states made in the kernel, the chunk-wide products on tensor cores, the shared
// memory diet. Run by the emulator's tests only; the op's backward does not launch it yet.
#pragma once
#include <cuda_fp16.h>

#include "dplr_chunk_fused_steps.cuh"

namespace fla {
namespace dplr_fused_detail {

// The chunk's operand tiles as scaled fp16 (row strides in halves: 16-byte rows, conflict-free
// ldmatrix), after FusedSmem<1>'s floats: R^, Â, K^, B^ and rho dO [C][kF16Row], the pair
// matrices A_rk, A_rb, A_ak and X [C][kF16Mat], and each tile's scale. v comes from FusedSmem's
// state rows, which this kernel does not use otherwise (D is in registers).
constexpr int kF16Row = K + 8, kF16Mat = C + 8;
struct ChainTiles {
  enum { kRhat, kAhat, kKhat, kBhat, kDout, kV, kArk, kArb, kAak, kX, kTiles };
  __half* rows;  // [6][C][kF16Row]
  __half* mats;  // [4][C][kF16Mat]
  float* scale;  // [kTiles]
  __device__ explicit ChainTiles(float* sm)
      : rows(reinterpret_cast<__half*>(sm + FusedSmem<1>::total)),
        mats(rows + 6 * C * kF16Row),
        scale(reinterpret_cast<float*>(mats + 4 * C * kF16Mat)) {}
  __device__ const __half* tile(int t) const {
    return t < kArk ? rows + t * C * kF16Row : mats + (t - kArk) * C * kF16Mat;
  }
  __device__ static int ld(int t) { return t < kArk ? kF16Row : kF16Mat; }
  static constexpr size_t bytes() {
    return size_t(FusedSmem<1>::total) * 4 + (6 * C * kF16Row + 4 * C * kF16Mat) * 2 + kTiles * 4;
  }
};

// The fp32 source of chain tile t in the chunk's block, its row stride and columns.
__device__ inline const float* chain_source(const float* blk, int t, int& ld, int& cols) {
  using B = ChunkBlock;
  const int at[] = {B::rhat, B::ahat, B::khat, B::bhat, B::crow};
  const int mat[] = {kMatArk, kMatArb, kMatAak, kMatX};
  if (t == ChainTiles::kV) {
    ld = LB, cols = V;
    return blk - FusedSmem<1>::block(0) + FusedSmem<1>::state;
  }
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

// Step 2's fp32 buffers (floats), after the chain tiles: each warp's partial sums over its
// columns (part: the 16 x 64 one of the moment, or the four 16 x 16 ones and zeta's), their sums
// (big: dR^, dK^, dB^, dW, then dr, dk, db in place; small: dA_rk, dA_rb, dA_ak, dU M^T,
// rowsum(S * dS+)), the chunk-wide matrices, the decay factors and the raw rows.
struct GradSmem {
  static constexpr int kPart = 4 * C * C + K;  // a warp's partials
  enum { kDR, kDK, kDB, kDW };
  enum { kDArk, kDArb, kDAak, kDX1 };
  enum { kEG, kEE, kEO, kEGinv };
  enum { kR, kW, kK, kA, kB };
  float *part, *big, *small, *zeta_s, *dahat, *dx, *daab, *y, *fac, *raw;
  __device__ explicit GradSmem(float* sm) {
    part = sm + (ChainTiles::bytes() + 15) / 16 * 4;
    big = part + 4 * kPart;
    small = big + 4 * C * K;
    zeta_s = small + 4 * C * C;
    dahat = zeta_s + K;
    dx = dahat + C * K;
    daab = dx + C * C;
    y = daab + C * C;
    fac = y + C * C;
    raw = fac + 4 * C * K;
  }
  static constexpr size_t bytes() {
    return (ChainTiles::bytes() + 15) / 16 * 16 + 4 * (4 * kPart + 4 * C * K + 4 * C * C + K + C * K + 3 * C * C +
                                                       4 * C * K + 5 * C * K);
  }
};

// The chunk's raw rows r, w, k, a, b (fp32, 0 past the sequence) into gs.raw. Not synchronised.
template <typename T>
__device__ inline void load_raw_rows(const GradSmem& gs, const DplrChunkPass& p, const SeqSpan& s, int h, int64_t t0,
                                     int tid) {
  const VecArg* src[5] = {&p.r, &p.w, &p.k, &p.a, &p.b};
  for (int m = 0; m < 5; ++m)
    for (int e = tid; e < C * K; e += NTF) {
      const int i = e / K, d = e % K;
      gs.raw[m * C * K + e] = t0 + i < s.len ? to_f(*vptr<T>(*src[m], s.b, s.bos + t0 + i, h, d)) : 0.f;
    }
}

// Every warp's accumulator partial (m: 16 rows, n: 16 x nt columns, element e of tile t at row
// g + 8 (e / 2), column 8t + 2q + e % 2) into its part row-major with row stride ld, a barrier,
// then the four warps' sums in warp order into out (n floats), a barrier.
template <int nt>
__device__ inline void sum_partials(const GradSmem& gs, const float (&acc)[nt][4], int off, int ld, float* out,
                                    int n, int tid) {
  const int warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
  float* const mine = gs.part + warp * GradSmem::kPart + off;
#pragma unroll
  for (int t = 0; t < nt; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) mine[(g + 8 * (e / 2)) * ld + 8 * t + 2 * q + e % 2] = acc[t][e];
  if (out == nullptr) return;  // (more partials to come before the sum)
  __syncthreads();
  const float* const pt = gs.part + off;
  for (int e = tid; e < n; e += NTF)
    out[e] = ((pt[e] + pt[GradSmem::kPart + e]) + pt[2 * GradSmem::kPart + e]) + pt[3 * GradSmem::kPart + e];
  __syncthreads();
}

// Step 2 for chunk ci: the state-side products and the sums over the value columns, then the
// chunk-wide rest (fp32) and the five K-vector gradients to their outputs. dt: dS+ (before this
// chunk's update), du, dm: dU^T, dM^T, each with its fp16 scale. Ends synchronised.
template <typename T>
__device__ inline void kvector_grads(const DplrChunkPass& p, const SeqSpan& s, int n, int h, int64_t ci,
                                     const ChunkSteps& at, const ChainTiles& ct, const GradSmem& gs, const tile::F16A& dot,
                                     const float (&dt)[K / 8][4], float sd, const float (&du)[2][4], float sdu,
                                     const float (&dm)[2][4], float sdm, bool bounded, int tid) {
  using tile::F16A;
  using tile::F16B;
  using CT = ChainTiles;
  using B = ChunkBlock;
  const int g = tid % 32 / 4, q = tid % 4, x0 = 16 * (tid / 32);
  auto sc = [&](int t) { return ct.scale[t]; };
  auto col = [&](int e) { return x0 + g + 8 * (e / 2); };
  auto chan = [&](int t, int e) { return 8 * t + 2 * q + e % 2; };
  // S^T at this warp's columns (as dt), from hst
  float st[K / 8][4];
  const float* const S = static_cast<const float*>(p.hst) + (chunk_slot<C>(p.cu_seqlens, n, p.T, ci) * p.H + h) * int64_t(K * V);
#pragma unroll
  for (int t = 0; t < K / 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) st[t][e] = S[chan(t, e) * V + col(e)];
  const float ss = tile::pow2_down_scale(warp_amax(st));
  // M^T = V^T A_ak^T, Y^T = S^T Â^T + M^T, U^T = Y^T X^T (m: the columns, n: the rows)
  float mt[2][4] = {}, yt[2][4] = {}, ut[2][4] = {};
  {
    F16B b[2];
    tile::b_from_nk(b, ct.tile(CT::kAak), kF16Mat);
    const F16A va = tile::a_from_km(ct.tile(CT::kV) + x0, kF16Row);
    tile::mma_f16(mt[0], va, b[0]), tile::mma_f16(mt[1], va, b[1]);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      tile::b_from_nk(b, ct.tile(CT::kAhat) + 16 * kk, kF16Row);
      const F16A a = tile::a_from_acc(st[2 * kk], st[2 * kk + 1], ss);
      tile::mma_f16(yt[0], a, b[0]), tile::mma_f16(yt[1], a, b[1]);
    }
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        mt[t][e] = unscale(mt[t][e], sc(CT::kV), sc(CT::kAak)), yt[t][e] = unscale(yt[t][e], ss, sc(CT::kAhat)) + mt[t][e];
    const float sy = tile::pow2_down_scale(warp_amax(yt));
    tile::b_from_nk(b, ct.tile(CT::kX), kF16Mat);
    const F16A a = tile::a_from_acc(yt[0], yt[1], sy);
    tile::mma_f16(ut[0], a, b[0]), tile::mma_f16(ut[1], a, b[1]);
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) ut[t][e] = unscale(ut[t][e], sy, sc(CT::kX));
  }
  const float su = tile::pow2_down_scale(warp_amax(ut)), smt = tile::pow2_down_scale(warp_amax(mt));
  // The 16 x 64 sums: A (16 rows x this warp's columns) times B (its columns x the channels).
  const F16A va = tile::a_from_mk(ct.tile(CT::kV) + x0, kF16Row), doa = tile::a_from_mk(ct.tile(CT::kDout) + x0, kF16Row);
  const F16A ua = tile::a_from_acc_t(ut[0], ut[1], su), dua = tile::a_from_acc_t(du[0], du[1], sdu);
  const F16A dma = tile::a_from_acc_t(dm[0], dm[1], sdm);
  auto big = [&](const F16A& a, float sa, const float (&bt)[K / 8][4], float sb, int which) {
    float acc[K / 8][4] = {};
#pragma unroll
    for (int t = 0; t < K / 8; ++t) {
      tile::mma_f16(acc[t], a, tile::b_from_acc(bt[t], sb));
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][e] = unscale(acc[t][e], sa, sb);
    }
    sum_partials(gs, acc, 0, K, gs.big + which * C * K, C * K, tid);
  };
  big(doa, sc(CT::kDout), st, ss, GradSmem::kDR);  // dR^ = rho dO S^T
  big(va, sc(CT::kV), dt, sd, GradSmem::kDK);      // dK^ = V dS+^T
  big(ua, su, dt, sd, GradSmem::kDB);              // dB^ = U dS+^T
  big(dua, sdu, st, ss, GradSmem::kDW);            // dW = dU S^T
  // The 16 x 16 sums and zeta's rowsum(S * dS+), all four warps' partials, then one sum.
  {
    F16B vb[2];
    tile::b_from_nk(vb, ct.tile(CT::kV) + x0, kF16Row);  // B(k = column, n = row j) = v[j][column]
    float m4[4][2][4] = {};
    for (int t = 0; t < 2; ++t) {
      tile::mma_f16(m4[GradSmem::kDArk][t], doa, vb[t]);
      tile::mma_f16(m4[GradSmem::kDArb][t], doa, tile::b_from_acc(ut[t], su));
      tile::mma_f16(m4[GradSmem::kDAak][t], dma, vb[t]);
      tile::mma_f16(m4[GradSmem::kDX1][t], dua, tile::b_from_acc(mt[t], smt));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        m4[GradSmem::kDArk][t][e] = unscale(m4[GradSmem::kDArk][t][e], sc(CT::kDout), sc(CT::kV));
        m4[GradSmem::kDArb][t][e] = unscale(m4[GradSmem::kDArb][t][e], sc(CT::kDout), su);
        m4[GradSmem::kDAak][t][e] = unscale(m4[GradSmem::kDAak][t][e], sdm, sc(CT::kV));
        m4[GradSmem::kDX1][t][e] = unscale(m4[GradSmem::kDX1][t][e], sdu, smt);
      }
    }
    for (int m = 0; m < 4; ++m) sum_partials(gs, m4[m], m * C * C, C, nullptr, 0, tid);
    // rowsum(S * dS+) over this warp's columns: rows g and g + 8 of a lane share a channel, then
    // the lanes of one q (g = 0..7) are summed
    float* const mine = gs.part + tid / 32 * GradSmem::kPart + 4 * C * C;
#pragma unroll
    for (int t = 0; t < K / 8; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float z = st[t][e] * dt[t][e] + st[t][e + 2] * dt[t][e + 2];
#pragma unroll
        for (int o = 4; o < 32; o *= 2) z += __shfl_xor_sync(0xffffffffu, z, o);
        if (g == 0) mine[chan(t, e)] = z;
      }
    __syncthreads();
    for (int e = tid; e < 4 * C * C + K; e += NTF)
      gs.small[e] = ((gs.part[e] + gs.part[GradSmem::kPart + e]) + gs.part[2 * GradSmem::kPart + e]) +
                    gs.part[3 * GradSmem::kPart + e];
    __syncthreads();
  }
  // Chunk-wide, fp32: the masks, dÂ = X^T dW, dX = dU M^T + dW Â^T, dA_ab = stril(X^T dX X^T)
  const float* const X = at.blk + B::mats + kMatX * C * LM;
  float* const dArk = gs.small + GradSmem::kDArk * C * C;
  float* const dArb = gs.small + GradSmem::kDArb * C * C;
  float* const dAak = gs.small + GradSmem::kDAak * C * C;
  const float* const dX1 = gs.small + GradSmem::kDX1 * C * C;
  const float* const dW = gs.big + GradSmem::kDW * C * K;
  for (int e = tid; e < C * C; e += NTF) {
    const int i = e / C, j = e % C;
    if (j > i) dArk[e] = 0.f, dArb[e] = 0.f;
    if (j >= i) dAak[e] = 0.f;
    float x = dX1[e];
    for (int d = 0; d < K; ++d) x += dW[i * K + d] * at.blk[B::ahat + j * LA + d];
    gs.dx[e] = x;
  }
  for (int e = tid; e < C * K; e += NTF) {
    const int i = e / K, d = e % K;
    float x = 0.f;
    for (int j = 0; j < C; ++j) x += X[j * LM + i] * dW[j * K + d];
    gs.dahat[e] = x;
  }
  __syncthreads();
  for (int e = tid; e < C * C; e += NTF) {
    const int i = e / C, j = e % C;
    float y = 0.f;
    for (int pp = 0; pp < C; ++pp) y += X[pp * LM + i] * gs.dx[pp * C + j];
    gs.y[e] = y;
  }
  __syncthreads();
  for (int e = tid; e < C * C; e += NTF) {
    const int i = e / C, j = e % C;
    float z = 0.f;
    if (j < i)
      for (int qq = 0; qq < C; ++qq) z += gs.y[i * C + qq] * X[j * LM + qq];
    gs.daab[e] = z;
  }
  // The decay factors per channel: e^G (inclusive), e^E (exclusive), e^Omega (the rows after)
  // and e^-G = e^Omega / gamma (factor_keys' factor), every exponent an added-up sum.
  if (tid < K) {
    const int d = tid;
    const float* const w = gs.raw + GradSmem::kW * C * K;
    float ge = 0.f, oe = 0.f;
    for (int i = 0; i < C; ++i) {
      gs.fac[GradSmem::kEE * C * K + i * K + d] = expf(ge);
      ge += w[i * K + d];
      gs.fac[GradSmem::kEG * C * K + i * K + d] = expf(ge);
    }
    for (int i = C - 1; i >= 0; --i) {
      const float eo = expf(oe);
      gs.fac[GradSmem::kEO * C * K + i * K + d] = eo;
      gs.fac[GradSmem::kEGinv * C * K + i * K + d] = eo * at.blk[B::ginv + d];
      oe += w[i * K + d];
    }
    // zeta = rowsum(S+ * dS+) = gamma rowsum(S * dS+) + sum_j (K^ dK^ + B^ dB^) (dK^, dB^ before
    // the K-vector gradients take their place below)
    float z = at.blk[B::gam + d] * gs.zeta_s[d];
    for (int j = 0; j < C; ++j)
      z += at.blk[B::khat + j * LB + d] * gs.big[GradSmem::kDK * C * K + j * K + d] +
           at.blk[B::bhat + j * LB + d] * gs.big[GradSmem::kDB * C * K + j * K + d];
    gs.zeta_s[d] = z;
  }
  __syncthreads();
  // The K-vector gradients (docs/algorithms.md §6.4), in the factored forms where the chunk is
  // bounded (the pair factors e^(G_i - G_j) = e^G_i e^-G_j through K~ = k e^-G, B~ = b e^-G):
  // dr, da, dk, db over dR^, dÂ, dK^, dB^ in place (each thread reads only its own elements).
  const float* const kt = at.wrow;  // K~ [C][LA]
  const float* const bt = at.btil;  // B~ [C][LA]
  const float* const fac = gs.fac;
  float* const dR = gs.big + GradSmem::kDR * C * K;
  float* const dK = gs.big + GradSmem::kDK * C * K;
  float* const dB = gs.big + GradSmem::kDB * C * K;
  const float* const raw = gs.raw;
  auto in = [&](int m, int i, int d) { return raw[m * C * K + i * K + d]; };
  for (int e = tid; e < C * K; e += NTF) {
    const int i = e / K, d = e % K;
    const float eo = fac[GradSmem::kEO * C * K + e];
    float r = 0.f, a = 0.f, k = 0.f, b = 0.f;
    if (bounded) {
      for (int j = 0; j < C; ++j) {
        r += dArk[i * C + j] * kt[j * LA + d] + dArb[i * C + j] * bt[j * LA + d];
        a += dAak[i * C + j] * kt[j * LA + d] + gs.daab[i * C + j] * bt[j * LA + d];
        k += dArk[j * C + i] * at.blk[B::rhat + j * LA + d] + dAak[j * C + i] * at.blk[B::ahat + j * LA + d];
        b += dArb[j * C + i] * at.blk[B::rhat + j * LA + d] + gs.daab[j * C + i] * at.blk[B::ahat + j * LA + d];
      }
      const float egi = fac[GradSmem::kEGinv * C * K + e];
      r = fac[GradSmem::kEG * C * K + e] * (dR[e] + r), a = fac[GradSmem::kEE * C * K + e] * (gs.dahat[e] + a);
      k = dK[e] * eo + egi * k, b = dB[e] * eo + egi * b;
    } else {
      // Past the bound: each pair's factor from its own segment sum of w (never positive; any w
      // in [-inf, 0]), walked from the row outwards. e^(G_i - G_j) for j <= i and e^(E_i - G_j)
      // = e^(G_(i-1) - G_j) for j < i (query-type rows), and the same pairs from the key side.
      float seg = 0.f;  // G_i - G_j, then for j < i: E_i - G_j is the step before's
      for (int j = i; j >= 0; --j) {
        const float f = expf(seg);
        r += f * (dArk[i * C + j] * in(GradSmem::kK, j, d) + dArb[i * C + j] * in(GradSmem::kB, j, d));
        seg += in(GradSmem::kW, j, d);
      }
      seg = 0.f;  // E_i - G_j = sum of w over rows j + 1 .. i - 1
      for (int j = i - 1; j >= 0; --j) {
        const float f = expf(seg);
        a += f * (dAak[i * C + j] * in(GradSmem::kK, j, d) + gs.daab[i * C + j] * in(GradSmem::kB, j, d));
        seg += in(GradSmem::kW, j, d);
      }
      seg = 0.f;  // G_i' - G_i for i' >= i (and E_i' - G_i = G_(i'-1) - G_i: the step before's)
      float prev = 0.f;
      for (int i2 = i; i2 < C; ++i2) {
        if (i2 > i) seg += in(GradSmem::kW, i2, d);
        const float f = expf(seg);
        k += f * dArk[i2 * C + i] * in(GradSmem::kR, i2, d);
        b += f * dArb[i2 * C + i] * in(GradSmem::kR, i2, d);
        if (i2 > i) {
          k += prev * dAak[i2 * C + i] * in(GradSmem::kA, i2, d);
          b += prev * gs.daab[i2 * C + i] * in(GradSmem::kA, i2, d);
        }
        prev = f;
      }
      r += fac[GradSmem::kEG * C * K + e] * dR[e], a += fac[GradSmem::kEE * C * K + e] * gs.dahat[e];
      k += dK[e] * eo, b += dB[e] * eo;
    }
    dR[e] = r, gs.dahat[e] = a, dK[e] = k, dB[e] = b;
  }
  __syncthreads();
  // dw by the reverse scan (docs/algorithms.md §6.4; exactly 0 where exp(w) == 0), a thread a
  // channel, then all five to their outputs (rows of the sequence only).
  const int64_t t0 = ci * C;
  if (tid < K) {
    const int d = tid;
    float acc = gs.zeta_s[d];
    for (int i = C - 1; i >= 0; --i) {
      const int e = i * K + d;
      const float x = raw[GradSmem::kR * C * K + e] * dR[e] - raw[GradSmem::kK * C * K + e] * dK[e] -
                      raw[GradSmem::kB * C * K + e] * dB[e];
      acc += x;
      if (expf(raw[GradSmem::kW * C * K + e]) == 0.f) acc = 0.f;
      const float y = raw[GradSmem::kA * C * K + e] * gs.dahat[e];
      gs.raw[GradSmem::kW * C * K + e] = acc;
      acc += y;
    }
  }
  __syncthreads();
  const float* const src[kNumKGrads] = {dR, gs.raw + GradSmem::kW * C * K, dK, gs.dahat, dB};
  static_assert(kGradR == 0 && kGradW == 1 && kGradK == 2 && kGradA == 3 && kGradB == 4, "kGrad order");
  for (int e = tid; e < C * K; e += NTF) {
    const int i = e / K, d = e % K;
    if (t0 + i >= s.len) continue;
    for (int gi = 0; gi < kNumKGrads; ++gi)
      *vptr<T>(p.kgd[gi], s.b, s.bos + t0 + i, h, d) = from_f<T>(src[gi][e]);
  }
  __syncthreads();
}

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
  const GradSmem gs(sm);
  const bool full = p.hst != nullptr;  // step 2: the K-vector gradients too
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
    const int64_t t0 = ci * C;
    for (int e = tid; e < C * V; e += NTF) {  // v rows (the chain tiles' v), 0 past the sequence
      const int i = e / V, x = e % V;
      sm[L::state + i * LB + x] = t0 + i < s.len ? to_f(*vptr<T>(p.v, s.b, s.bos + t0 + i, h, x)) : 0.f;
    }
    if (full) load_raw_rows<T>(gs, p, s, h, t0, tid);
    __syncthreads();
    if (ci > 0) rows.fetch(ci - 1);
    // the chunk's steps (chunk_steps, keeping whether the chunk is bounded)
    const bool bounded = __syncthreads_and(decay_scan(at, tid));
    if (bounded) factor_keys(at, tid);
    __syncthreads();
    pair_matrices<T, true, 4>(at, bounded, p, s, h, ci, tid);
    __syncthreads();
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
    if (full) kvector_grads<T>(p, s, n, h, ci, at, ct, gs, dot, dt, sd, du, sdu, dm, sdm, bounded, tid);
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
