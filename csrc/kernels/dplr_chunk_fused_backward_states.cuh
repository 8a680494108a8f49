// The RWKV7 single-pass backward's chunk-start states of a group of chunks, made forward from
// the kept one (dplr_chunk_fused_backward.cuh).
#pragma once
#include "dplr_chunk_fused_backward_smem.cuh"

namespace fla {
namespace dplr_fused_detail {

// The chunk-start states of chunks [g0, g1) into the group scratch (put_group_state: S_g0 from
// hst, DplrKept::states' kept one, then each next made forward: U = X (Â S + A_ak V), S+ = gamma S + K^^T V + B^^T U,
// each warp on its own columns, held transposed, products on scaled fp16, gamma S exact). Runs
// each chunk's steps on its v rows (vrows: cols = v); the reverse walk over the group makes them
// again on its dO rows. Ends synchronised.
template <typename T>
__device__ inline void make_group_states(const DplrChunkPass& p, const SeqSpan& s, int n, int h, int64_t g0, int64_t g1,
                                         const ChunkSteps& at, const ChainTiles& ct, ChunkRows<T, false>& vrows,
                                         int tid) {
  using tile::F16A;
  using CT = ChainTiles;
  const HeldLane ln(tid);
  const int x0 = ln.x0;
  const float* const kept =
      static_cast<const float*>(p.hst) + (dplr_kept_state_slot(p.cu_seqlens, n, p.T, g0 / kDplrStateStride) * p.H + h) * int64_t(K * V);
  float st[K / 8][4];
  load_held(st, kept, ln);
  put_group_state(st, p, 0, tid);
  for (int64_t c = g0; c + 1 < g1; ++c) {
    vrows.fetch(c);
    vrows.stage(at, 1.f);  // crow = v
    steps_with_x<T>(at, p, s, h, c, tid);
    make_chain_tiles(at.blk, ct, tid);  // (its dO tile holds v here)
    auto sc = [&](int t) { return ct.scale[t]; };
    const float ss = tile::pow2_down_scale(warp_amax(st)), sv = sc(CT::kDout);
    const F16A va = tile::a_from_km(ct.tile(CT::kDout) + x0, kF16Row);  // V^T
    float mt[2][4] = {}, ut[2][4] = {};
    state_products(ct, va, sv, st, ss, mt, ut);
    const float su = tile::pow2_down_scale(warp_amax(ut));
    const F16A ua = tile::a_from_acc(ut[0], ut[1], su);
    update_held(ct, at.blk + ChunkBlock::gam, st, va, sv, CT::kKhat, ua, su, CT::kBhat);
    put_group_state(st, p, c + 1 - g0, tid);
    __syncthreads();  // the block, before the next chunk's staging
  }
  __syncthreads();
}

}  // namespace dplr_fused_detail
}  // namespace fla
