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
// shared tiles (with SubChunkRows it spilled).
//
// Row strides follow how the tensor-core products read each tile (tile_mma.cuh): W is only ever
// a B operand (rows stored whole), so LDB; A is read as stored (LD) for o and transposed (LDB)
// for dv. X stays LD: transposed K̂ is stored column-wise, where LDB would double the store
// conflicts that it saves on the reads.
template <bool DV>
using OutPairTile = std::conditional_t<DV, TileB, Tile>;

// The forward's products read their operands as stored TF32 values (RAW) where they run on tensor
// cores: Q̂ and the state tiles rounded where written, A by chunk_intra_kernel, V widened bf16 /
// fp16; each element is read by two to four warps, so that saves a rounding at every read and
// the tensor cores get the same bits (docs/design.md §5.2). The dv form rounds at its reads: stored
// rounded, it ran slower (benchmarks/NOTES.md c60).
//
// Every global operand is fetched one step ahead into registers (held as loaded): a K tile's rows
// (o: q and λ; dv: k and λ) while the previous K tile is used, each state tile while the previous
// one is multiplied, the first V / dO tile under the last state tile, A by cp.async from the
// start. Fetched right before their use, each CTA waited on memory at every tile (the loads'
// conversions led the stalls), which three CTAs per SM did not hide; with the fetches ahead,
// two CTAs per SM hold the registers for them.
template <typename T, bool DV>
struct OutRows;
template <typename T>
struct OutRows<T, false> {  // q and λ, in 16-byte pieces (chunk_pieces.cuh)
  RowPieces<T> fx, fl;
  __device__ __forceinline__ void fetch(const ChunkPass& p, const Pos& pos, int h, int k0, bool vec) {
    fx.fetch(p.q, pos.b, pos.t0, pos.L, h, k0, p.K, vec);
    fl.fetch(p.g, pos.b, pos.t0, pos.L, h, k0, p.K, vec);
  }
};
template <typename T>
struct OutRows<T, true> : SubChunkRows<T> {  // k and λ, a column of 16 rows a thread
  __device__ __forceinline__ void fetch(const ChunkPass& p, const Pos& pos, int h, int k0, bool) {
    SubChunkRows<T>::fetch(p.k, p.g, pos.b, pos.t0, pos.L, h, k0, p.K);
  }
};

// How many CTAs of the out kernel an SM holds. The kernel is latency-bound and its registers set
// its occupancy: the forward form over one V tile fits three CTAs with a few bytes spilled, and
// the third hides more of its latency; the other forms would spill hundreds of bytes, so two.
template <bool DV, int NV>
constexpr int kOutCtasPerSm = !DV && NV == 1 ? 3 : 2;

// vec: the rows it reads in pieces are whole 16-byte pieces (out_vec).
template <typename T, Reader RD, bool DV, int NV>
__global__ void __launch_bounds__(NTH, (kOutCtasPerSm<DV, NV>)) chunk_out_kernel(ChunkPass p, bool vec) {
  constexpr bool TF = kTC<T> && !DV;  // operands stored as TF32 values, read RAW (above)
  extern __shared__ float4 smem4[];
  Tile* X = reinterpret_cast<Tile*>(smem4);        // Q̂, or K̂ transposed [ch][j]
  TileB* W = reinterpret_cast<TileB*>(X + C);      // (o) λ, then the state tile, then V / dO
  OutPairTile<DV>* A = reinterpret_cast<OutPairTile<DV>*>(W + C);
  Decays& d = *reinterpret_cast<Decays*>(A + C);   // (dv) only d.tau is allocated: out_smem
  float(*tau)[DT] = d.tau;

  Pos pos;
  if (!locate(p, blockIdx.x, pos)) return;
  const int h = blockIdx.y, v0 = blockIdx.z * NV * DT;
  const int nv = min(NV, (p.V - v0 + DT - 1) / DT), nk = (p.K + DT - 1) / DT;
  const int m = threadIdx.x / DT, ch = threadIdx.x % DT;
  const int64_t KV = int64_t(p.K) * p.V;
  const float* st = static_cast<const float*>(DV ? p.dhst : p.hst) + (pos.slot * p.H + h) * KV;
  const VecArg& right = DV ? p.dout : p.v;  // the B operand of the pair product
  copy_pairs(A, static_cast<const float*>(p.amat) + (blockIdx.x * p.H + h) * int64_t(C) * C);
  OutRows<T, DV> rows;
  RowPieces<float> fs;  // state tiles, in the order (K tile, V tile)
  RowPieces<T> fr;      // V / dO tiles
  const bool mats_vec = p.V % 4 == 0 && aligned16(st);
  rows.fetch(p, pos, h, 0, vec);
  fs.fetch_mat(st, p.K, p.V, 0, v0, mats_vec);
  if (nk == 0) fr.fetch(right, pos.b, pos.t0, pos.L, h, v0, p.V, vec);
  Acc<T> acc[NV];
  for (int kt = 0; kt < nk; ++kt) {
    const int k0 = kt * DT;
    __syncthreads();  // the previous K tile's X, W and tau are consumed
    // Q̂ = q ⊙ exp2(G or E) = q ⊙ exp2(reader exponent) before[m];  K̂ = k ⊙ exp2(Qex) after[m].
    if constexpr (DV) {
      rows.template put_scaled<false, RD>(X, tau);  // the dv form rounds at the mma reads
      if (kt + 1 < nk) rows.fetch(p, pos, h, k0 + DT, vec);
    } else {
      rows.fx.store(X, 1.f), rows.fl.store(W, kLog2e);
      if (kt + 1 < nk) rows.fetch(p, pos, h, k0 + DT, vec);
      __syncthreads();
      chunk_decays(d, W);
      scale_reader<RD, TF>(X, W, m, ch, d.before[m][ch]);
      __syncthreads();  // λ (W) is consumed before the state tile lands there
    }
#pragma unroll
    for (int vt = 0; vt < NV; ++vt) {
      if (vt >= nv) break;
      if (vt > 0) __syncthreads();  // the previous V tile's product has read W
      fs.template store<TF>(W, 1.f);
      if (vt + 1 < nv) fs.fetch_mat(st, p.K, p.V, k0, v0 + (vt + 1) * DT, mats_vec);
      else if (kt + 1 < nk) fs.fetch_mat(st, p.K, p.V, k0 + DT, v0, mats_vec);
      else fr.fetch(right, pos.b, pos.t0, pos.L, h, v0, p.V, vec);
      __syncthreads();
      if (DV) acc[vt].template mma<true, Tri::Full, TF>(X, W, DT);
      else acc[vt].template mma<false, Tri::Full, TF>(X, W, DT);
    }
  }
  copy_wait<0>();
  __syncthreads();  // A has landed; the last product has read W
  const float rho = float(p.scale);
  if (DV) {  // dv = K̂ dS+ + ρ Aᵀ dO: fold ρ into A
    for (int e = threadIdx.x; e < C * C; e += NTH) A[e / C][e % C] *= rho;
  }
#pragma unroll
  for (int vt = 0; vt < NV; ++vt) {
    if (vt >= nv) break;
    if (vt > 0) __syncthreads();
    fr.store(W, 1.f);
    if (vt + 1 < nv) fr.fetch(right, pos.b, pos.t0, pos.L, h, v0 + (vt + 1) * DT, p.V, vec);
    __syncthreads();
    // A is lower triangular: row i of A V needs j <= i, row j of Aᵀ dO needs i >= j.
    if (DV) acc[vt].template mma<true, Tri::KFromRow, TF>(A, W, C);
    else acc[vt].template mma<false, Tri::KUpToRow, TF>(A, W, C);
    if (!DV && p.o_acc) store_frag<float>(acc[vt], p.o, pos.b, pos.t0, pos.L, h, v0 + vt * DT, p.V, rho);
    else store_frag<T>(acc[vt], DV ? p.dv : p.o, pos.b, pos.t0, pos.L, h, v0 + vt * DT, p.V, DV ? 1.f : rho,
                       DV && p.dv_adds);
  }
}

// The `vec` argument of chunk_out_kernel.
template <typename T>
inline bool out_vec(const ChunkPass& p, bool dv) {
  constexpr int P = RowPieces<T>::P;
  if (dv) return rows_in_pieces(p.dout, p.V, P);
  return rows_in_pieces(p.q, p.K, P) && rows_in_pieces(p.g, p.K, P) && rows_in_pieces(p.v, p.V, P);
}

constexpr size_t out_smem(bool dv) {
  const size_t decays = dv ? sizeof(float) * NSC * DT : sizeof(Decays);  // dv: the totals alone
  return sizeof(float) * C * (LD + tile::LDB + (dv ? tile::LDB : LD)) + decays;
}

}  // namespace chunk_detail
}  // namespace fla
