// The chunk engine's out kernel (chunk.cuh has the overview): the forward's o for K > 128 and the
// backward's dv.
#pragma once
#include "chunk.cuh"

namespace fla {
namespace chunk_detail {

// Forward (DV = false): o = ρ (Q̂ S + A V). Backward (DV): dv = K̂ dS+ + ρ Aᵀ dO. A comes from
// p.amat (chunk_intra_kernel, or kept from the forward).
// NV V tiles per CTA (2 when V > 64): Q̂ or K̂ is then built once for both. dv builds K̂ from
// registers (SubChunkRows: λ never goes to shared memory, no Decays); o keeps the walks over
// shared tiles, whose registers fit its three CTAs per SM without spills.
//
// Row strides follow how the tensor-core products read each tile (tile_mma.cuh): W is only ever
// a B operand (rows stored whole), so LDB; A is read as stored (LD) for o and transposed (LDB)
// for dv. X stays LD: transposed K̂ is stored column-wise, where LDB would double the store
// conflicts that it saves on the reads.
template <bool DV>
using OutPairTile = std::conditional_t<DV, TileB, Tile>;
template <typename T, Reader RD, bool DV, int NV>
__global__ void __launch_bounds__(NTH, DV ? 2 : 3) chunk_out_kernel(ChunkPass p) {
  extern __shared__ float4 smem4[];
  Tile* X = reinterpret_cast<Tile*>(smem4);        // Q̂, or K̂ transposed [ch][j]
  TileB* W = reinterpret_cast<TileB*>(X + C);      // (o) λ, then the state tile, then V / dO
  OutPairTile<DV>* A = reinterpret_cast<OutPairTile<DV>*>(W + C);
  Decays& d = *reinterpret_cast<Decays*>(A + C);   // (dv) only d.tau is allocated: out_smem
  float(*tau)[DT] = d.tau;

  Pos pos;
  if (!locate(p, blockIdx.x, pos)) return;
  const int h = blockIdx.y, v0 = blockIdx.z * NV * DT;
  const int nv = min(NV, (p.V - v0 + DT - 1) / DT);
  const int m = threadIdx.x / DT, ch = threadIdx.x % DT;
  const int64_t KV = int64_t(p.K) * p.V;
  const float* st = static_cast<const float*>(DV ? p.dhst : p.hst) + (pos.slot * p.H + h) * KV;
  Acc<T> acc[NV];
  for (int k0 = 0; k0 < p.K; k0 += DT) {
    __syncthreads();  // the previous K tile's X, W and tau are consumed
    // Q̂ = q ⊙ exp2(G or E) = q ⊙ exp2(reader exponent) before[m];  K̂ = k ⊙ exp2(Qex) after[m].
    if constexpr (DV) {
      SubChunkRows rows;
      rows.fetch<T>(p.k, p.g, pos.b, pos.t0, pos.L, h, k0, p.K);
      rows.put_scaled<false, RD>(X, tau);
    } else {
      RowFetch fx, fl;
      fx.fetch<T>(p.q, pos.b, pos.t0, pos.L, h, k0, p.K, 1.f);
      fl.fetch<T>(p.g, pos.b, pos.t0, pos.L, h, k0, p.K, kLog2e);
      fx.store<false>(X), fl.store<false>(W);
      __syncthreads();
      chunk_decays(d, W);
      scale_reader<RD>(X, W, m, ch, d.before[m][ch]);
      __syncthreads();  // λ (W) is consumed before the state tile lands there
    }
#pragma unroll
    for (int vt = 0; vt < NV; ++vt) {
      if (vt >= nv) break;
      if (vt > 0) __syncthreads();  // the previous V tile's product has read W
      load_mat<false>(W, st, p.K, p.V, k0, v0 + vt * DT);
      __syncthreads();
      if (DV) acc[vt].template mma<true>(X, W, DT);
      else acc[vt].template mma<false>(X, W, DT);
    }
  }
  __syncthreads();
  load_mat<false>(A, static_cast<const float*>(p.amat) + (blockIdx.x * p.H + h) * int64_t(C) * C, C, C, 0, 0);
  const float rho = float(p.scale);
  if (DV) {  // dv = K̂ dS+ + ρ Aᵀ dO: fold ρ into A
    __syncthreads();
    for (int e = threadIdx.x; e < C * C; e += NTH) A[e / C][e % C] *= rho;
  }
#pragma unroll
  for (int vt = 0; vt < NV; ++vt) {
    if (vt >= nv) break;
    if (vt > 0) __syncthreads();
    load_rows<T, false>(W, DV ? p.dout : p.v, pos.b, pos.t0, pos.L, h, v0 + vt * DT, p.V, 1.f);
    __syncthreads();
    // A is lower triangular: row i of A V needs j <= i, row j of Aᵀ dO needs i >= j.
    if (DV) acc[vt].template mma<true, Tri::KFromRow>(A, W, C);
    else acc[vt].template mma<false, Tri::KUpToRow>(A, W, C);
    if (!DV && p.o_acc) store_frag<float>(acc[vt], p.o, pos.b, pos.t0, pos.L, h, v0 + vt * DT, p.V, rho);
    else store_frag<T>(acc[vt], DV ? p.dv : p.o, pos.b, pos.t0, pos.L, h, v0 + vt * DT, p.V, DV ? 1.f : rho,
                       DV && p.dv_adds);
  }
}

constexpr size_t out_smem(bool dv) {
  const size_t decays = dv ? sizeof(float) * NSC * DT : sizeof(Decays);  // dv: the totals alone
  return sizeof(float) * C * (LD + tile::LDB + (dv ? tile::LDB : LD)) + decays;
}

}  // namespace chunk_detail
}  // namespace fla
