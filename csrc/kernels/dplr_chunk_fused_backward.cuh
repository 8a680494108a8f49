// The single-pass backward of the chunked RWKV7 engine (benchmarks/NOTES.md c67-c70): one CTA
// of four warps per (sequence, head) walks the chunks latest first, warp w owning the value
// columns 16w .. 16w + 15, each warp's quantities held transposed in registers (D^T:
// m = its columns, n = the channels) so that every warp-local product reads the previous one's
// accumulators as its left operand, all products on fp16 tensor cores with a power-of-two scale
// per operand (tile_mma.cuh: a_from_acc, ldmatrix loads; TF32's rounding, docs/algorithms.md
// §2.8). The chunk's own steps (decays, pair matrices, X) are the fused reverse pass's, the pair
// matrices on single TF32 for 16-bit inputs (steps_with_x).
//
// Steps (docs/algorithms.md §6.4):
//   1. the warp-local chain dU = rho A_rb^T dO + B^ D, dM = X^T dU, dV = rho A_rk^T dO + K^ D +
//      A_ak^T dM, D <- gamma D + rho R^^T dO + Â^T dM: dv and dh0, no state read;
//   2. given each chunk's start state: U^T, the sums over the value columns (dR^, dK^, dB^, dW;
//      dA_rk, dA_rb, dA_ak, dU M^T; zeta's rowsum(S * dS+)) from each warp's partials in a fixed
//      order, then the chunk-wide rest on TF32 tensor cores (dÂ, dX, dA_ab, the K-vector
//      gradients in the factored forms; exact fp32 pair walks past the factoring bound) and the
//      dw scan (dplr_chunk_fused_backward_grads.cuh);
//   3. the states: every chunk's as the fused forward stored them in fp16 (DplrKept::f16_states,
//      dplr_f16_states.cuh), read straight into registers; the tests may also give every chunk's
//      fp32 (hst, no kept kind). (Its first form walked the fused forward's fp32 states of every
//      fourth chunk, making each group's states again first: slower, removed; NOTES c69.)
// 113.7 KB of shared memory, two CTAs an SM. The faster backward wherever the fused training
// forward runs (it reads no workspace and makes no state again; benchmarks/NOTES.md c70), so the
// op's default there (DplrChunkPass::single_pass_backward).
#pragma once
#include "dplr_chunk_fused_backward_grads.cuh"

namespace fla {

// The backward over the chunks, latest first: dv and dh0, and with the chunk-start states (hst:
// the fused forward's kept ones, or in the tests every chunk's) dr, dw, dk, da, db too.
template <typename T>
__global__ void __launch_bounds__(kDplrFusedThreads) single_pass_backward_kernel(const DplrChunkPass p) {
  using namespace dplr_fused_detail;
  using tile::F16A;
  using tile::F16B;
  using L = FusedSmem<1>;
  float* const sm = fused_smem();
  const auto [h, n, s, nch] = FusedTask(p);
  const int tid = threadIdx.x;
  const HeldLane ln(tid);
  const int x0 = ln.x0;
  const ChunkSteps at = ChunkSteps::at<L>(sm, 0);
  const ChainTiles ct(sm);
  const GradSmem gs(sm);
  const bool full = p.hst != nullptr;  // step 2: the K-vector gradients too
  ChunkRows<T, false> rows(p, p.dout, s, h, tid);
  T* const dv0 = vptr<T>(p.dv, s.b, s.bos, h, ln.col(0));  // (this lane's dv: rows t, columns col(e))
  using CT = ChainTiles;
  // D^T at this warp's columns (HeldLane), dht or 0
  float dt[K / 8][4];
#pragma unroll
  for (int t = 0; t < K / 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) dt[t][e] = p.dht.on() ? *mptr(p.dht, n, h, ln.chan(t, e), ln.col(e)) : 0.f;
  // the chunk-start states: DplrKept::f16_states' records, or the tests' fp32 hst
  const bool f16_states = p.kept == DplrKept::f16_states;
  ChunkRows<T, false> vrows(p, p.v, s, h, tid);
  if (nch > 0) rows.fetch(nch - 1), vrows.fetch_one(kColumnRows, nch - 1);
  for (int64_t ci = nch - 1; ci >= 0; --ci) {
    rows.stage(at, float(p.scale));
    const int64_t t0 = ci * C;
    vrows.stage_one(kColumnRows, sm + kVRows, LB);  // the chain tiles' v, 0 past the sequence
    if (full) rows.stage_raw(gs.raw);
    if (ci > 0) rows.fetch(ci - 1), vrows.fetch_one(kColumnRows, ci - 1);  // (the staged rows are in shared memory)
    if (full && f16_states && ci > 0)  // (the next chunk's state record into L2)
      prefetch_f16_state(static_cast<const float*>(p.hst) +
                             (chunk_slot<C>(p.cu_seqlens, n, p.T, ci - 1) * p.H + h) * DplrF16States::kFloats,
                         tid);
    const bool bounded = steps_with_x<T>(at, p, s, h, ci, tid);
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
      held_by_rows(ct, CT::kBhat, dt, sd, part);
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
      held_by_rows(ct, CT::kKhat, dt, sd, v2);
      tile::b_from_kn(b, ct.tile(CT::kAak), kF16Mat);
      tile::mma_f16(v3[0], dma, b[0]), tile::mma_f16(v3[1], dma, b[1]);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = ln.chan(nt, e);  // (the row: n is the chunk's rows here)
          if (t0 + j >= s.len) continue;
          const float v = unscale(v1[nt][e], sc(CT::kDout), sc(CT::kArk)) + unscale(v2[nt][e], sd, sc(CT::kKhat)) +
                          unscale(v3[nt][e], sdm, sc(CT::kAak));
          dv0[(t0 + j) * p.dv.st + e / 2 * 8 * p.dv.sd] = from_f<T>(v);
        }
    }
    if (full) {
      float st[K / 8][4];  // S^T at this warp's columns (as dt)
      const int64_t slot = chunk_slot<C>(p.cu_seqlens, n, p.T, ci) * p.H + h;
      if (f16_states) load_f16_state(st, static_cast<const float*>(p.hst) + slot * DplrF16States::kFloats, tid);
      else load_held(st, static_cast<const float*>(p.hst) + slot * int64_t(K * V), ln);
      kvector_grads<T>(p, s, st, h, ci, at, ct, gs, dot, dt, sd, du, sdu, dm, sdm, bounded, tid);
    }
    // D^T <- D^T gamma + rho dO^T R^ + dM^T Â
    update_held(ct, at.blk + ChunkBlock::gam, dt, dot, sc(CT::kDout), CT::kRhat, dma, sdm, CT::kAhat);
    __syncthreads();  // the block and the tiles, before the next chunk's staging
  }
  if (p.dh0.on())
#pragma unroll
    for (int t = 0; t < K / 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) *mptr(p.dh0, n, h, ln.chan(t, e), ln.col(e)) = dt[t][e];
}

}  // namespace fla
