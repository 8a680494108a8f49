// The chunked RWKV7 engine's gradient kernel (dplr_chunk_launch.cuh): every chunk's gradients,
// given the chunk-start states (forward sweep) and dS+ (reverse sweep, dplr_chunk_sweep.cuh).
#pragma once
#include <type_traits>

#include "dplr_chunk_grad_columns.cuh"
#include "dplr_chunk_loads.cuh"
#include "dplr_chunk_pairs.cuh"
#include "dplr_chunk_tiles.cuh"
#include "dplr_dw_scan.cuh"
#include "dplr_kvector_stores.cuh"

namespace fla {
namespace dplr_chunk_detail {

// S (hst at this chunk; not where `with_state` is off: the CTA made it) and dS+ at the CTA's
// tile columns into shared memory: issued as cp.async copies (not committed) where the rows are
// 16-byte pieces, else loaded.
template <typename T>
__device__ __forceinline__ void load_states(float* sm, const Smem& L, const DplrChunkPass& p, const Cta& c, int64_t ci,
                                            bool with_state = true) {
  const int K = L.K, BP = L.BP;
  const int64_t state_slot = p.kept == DplrKept::states
                                 ? dplr_kept_state_slot(p.cu_seqlens, c.n, p.T, ci / kDplrStateStride)
                                 : chunk_slot<C>(p.cu_seqlens, c.n, p.T, ci);
  const float *s0 = slot_state(p, p.hst, c, state_slot), *d1 = slot_state(p, p.dhst, c, dplr_work_slot(p, c.n, ci));
  const int lq = L.lc - 2;  // log2(column quads per row)
  auto quad = [&](int e, int& d, int& x) { d = e >> lq, x = 4 * (e & ((1 << lq) - 1)); };
  if (p.paths.rows_16byte) {
    // a thread's quads are one column x on rows d, d + dstep, ..: pointers stepped, not re-formed
    // from 64-bit products per quad (integer multiply-adds that would outnumber the loads)
    int d, x;
    quad(threadIdx.x, d, x);
    const int dstep = NT >> lq;
    const int64_t gstep = int64_t(dstep) * p.V;
    const float *gs = s0 + int64_t(d) * p.V + x, *gd = d1 + int64_t(d) * p.V + x;
    float* ss = sm + L.S + d * BP + x;
    const bool on = x < c.nc;
    for (; d < K; d += dstep, gs += gstep, gd += gstep, ss += dstep * BP) {
      if (with_state) copy16(ss, gs, on);
      copy16(ss + (L.dS - L.S), gd, on);
    }
    return;
  }
  const bool vec = p.V % 4 == 0 && aligned16(p.hst) && aligned16(p.dhst);
#pragma unroll 2
  for (int e = threadIdx.x; e < K << lq; e += NT) {
    int d, x;
    quad(e, d, x);
    const int64_t at = int64_t(d) * p.V + x;
    if (with_state) *reinterpret_cast<float4*>(sm + L.S + d * BP + x) = load4(s0 + at, c.nc - x, vec);
    *reinterpret_cast<float4*>(sm + L.dS + d * BP + x) = load4(d1 + at, c.nc - x, vec);
  }
}

// grad_kernel, step 1: the chunk's rows, the pair matrices and X (from the prep workspace), v and
// dO at the tile's columns, S and dS+ into shared memory. Returns whether chunk_decays ran
// already (`early`). Not synchronised.
template <typename T>
__device__ __forceinline__ bool load_grad_operands(float* sm, const Smem& L, const DplrChunkPass& p, const Cta& c,
                                                   int64_t ci, int64_t t0, int nrow, const float* mats,
                                                   bool with_state) {
  const int K = L.K, KP = L.KP, cols = L.cols;
  // zeta = rowsum(S+ * dS+) is formed without S+ (S+ = gamma S + K^^T V + B^^T U): gamma
  // rowsum(S * dS+) here, the rest from the state parts v dS+^T and U dS+^T below, so no S+ is read.
  // early: the decays run while S, dS+, v and dO are still landing (their 36 KB are the
  // kernel's longest wait on memory). chunk_decays writes dk_rows and da_rows, which
  // must lie within the spent raw K-row stage, not over the column stage still landing.
  const bool early = p.paths.rows_16byte && kRawRows<T> &&
                     stage_cols_at<T>(K) * int64_t(sizeof(T)) >= int64_t(L.da_rows + C * KP - L.dk_rows) * 4;
  if (p.paths.rows_16byte) {
    // Everything in flight before any wait, by cp.async in two groups: the rows and matrices,
    // then v, dO, S and dS+.
    copy_rows_async<T>(sm, L, p, c.s, c.h, t0, nrow);
    for (int e = threadIdx.x; e < 5 * C * CP / 4; e += NT)  // stored in the shared layout
      copy16(sm + L.Ark + 4 * e, mats + 4 * e, true);
    copy_commit();
    copy_cols_async<T>(sm, L, p.v, 0, c.s, c.h, t0, nrow, c.x0, cols, c.nc);
    copy_cols_async<T>(sm, L, p.dout, 1, c.s, c.h, t0, nrow, c.x0, cols, c.nc);
    load_states<T>(sm, L, p, c, ci, with_state);
    copy_commit();
    if (!kRawRows<T>) widen_rows<T>(sm, L);  // fp32: the channel padding only
    if (early) {
      copy_wait<1>();
      __syncthreads();
      widen_rows<T>(sm, L);
      __syncthreads();
      chunk_decays(sm, L, -1, L.dk_rows, L.da_rows, L.zgam);
    }
    copy_wait<0>();
    __syncthreads();
    if (kRawRows<T> && !early) widen_rows<T>(sm, L);
    widen_cols<T>(sm, L, 0, cols, 0, L.v);
    widen_cols<T>(sm, L, 1, cols, 0, L.dO);
  } else {
    load_states<T>(sm, L, p, c, ci, with_state);
    load_chunk<T>(sm, L, p, c, t0, nrow, true);
    for (int e = threadIdx.x; e < 5 * C * CP; e += NT) sm[L.Ark + e] = mats[e];
  }
  return early;
}

// grad_kernel walking the column tiles (dplr_grad_walks_tiles), every tile after the first: its
// v, dO, S and dS+ into shared memory, the chunk's rows and matrices staying. v and dO land raw
// over dA, dX and Y, which hold nothing until the last tile's sums are put. Not synchronised.
template <typename T>
__device__ __forceinline__ void load_tile_columns(float* sm, const Smem& L, const DplrChunkPass& p, const Cta& c,
                                                  int64_t ci, int64_t t0, int nrow, bool with_state) {
  // (dA, dX, Y are consecutive: Smem; fp32 never walks the tiles)
  static_assert(!kRawRows<T> || 2 * C * stage_pitch<T>(dplr_chunk_cols(128)) * sizeof(T) <=
                                    (4 * C * C + 2 * C * CP) * sizeof(float),
                "v and dO's raw rows fit over dA, dX and Y");
  if (p.paths.rows_16byte) {
    copy_cols_async<T>(sm, L, p.v, 0, c.s, c.h, t0, nrow, c.x0, L.cols, c.nc, L.dA);
    copy_cols_async<T>(sm, L, p.dout, 1, c.s, c.h, t0, nrow, c.x0, L.cols, c.nc, L.dA);
    load_states<T>(sm, L, p, c, ci, with_state);
    copy_commit();
    copy_wait<0>();
    __syncthreads();
    widen_cols<T>(sm, L, 0, L.cols, 0, L.v, L.dA);
    widen_cols<T>(sm, L, 1, L.cols, 0, L.dO, L.dA);
  } else {
    load_states<T>(sm, L, p, c, ci, with_state);
    load_cols<T>(sm, L, p, c.s, c.h, c.x0, c.nc, t0, nrow, true);
  }
}

// grad_kernel, step 2: zeta's part rowsum(S * dS+) at L.zeta (added to it for `add`: the column
// tiles after the first) and, kRound (bf16 / fp16: the products read TF32 values as stored), dS+
// and (unless kExactS: strided states, whose next state needs S exact) S rounded to TF32 in
// place; fp32's 3xTF32 products split the whole values. After the loads' barrier; not synchronised.
template <bool kRound, bool kExactS = false>
__device__ __forceinline__ void state_rowsum(float* sm, const Smem& L, bool add = false) {
  const int K = L.K, cols = L.cols, BP = L.BP;
  // rowsum(S * dS+): eight threads per channel, so that a load phase (8 lanes) reads 128
  // contiguous bytes of one row (four per channel read two rows: two-way conflicts)
  for (int d0 = 0; d0 < K; d0 += NT / 8) {
    const int d = d0 + threadIdx.x / 8, part = threadIdx.x % 8;
    float z = 0.f;
    if (d < K)
      for (int x = 4 * part; x < cols; x += 32) {
        float4 *s = reinterpret_cast<float4*>(sm + L.S + d * BP + x), *ds = reinterpret_cast<float4*>(sm + L.dS + d * BP + x);
        const float4 s4 = *s, d4 = *ds;
        z = dot4(s4, d4, z);
        if (kRound) {  // S, dS+ as TF32 values from here on: every later read is a tensor-core operand
          if (!kExactS) *s = make_float4(tf32_round(s4.x), tf32_round(s4.y), tf32_round(s4.z), tf32_round(s4.w));
          *ds = make_float4(tf32_round(d4.x), tf32_round(d4.y), tf32_round(d4.z), tf32_round(d4.w));
        }
      }
#pragma unroll
    for (int lanes = 1; lanes < 8; lanes *= 2) z += __shfl_xor_sync(0xffffffffu, z, lanes);
    if (d < K && part == 0) sm[L.zeta + d] = add ? sm[L.zeta + d] + z : z;
  }
}

// grad_kernel, step 3: the decay rows the gradients use (exp(Omega), Â, K^, B^, exp(w)). Ends
// with the rows written, not synchronised.
__device__ __forceinline__ void decay_factor_rows(float* sm, const Smem& L, bool early) {
  const int K = L.K, KP = L.KP;
  // Â and exp(Omega) in the gradient rows da_rows, dk_rows (the raw stage there is spent),
  // which the K-vector gradients write last; exp(G) is not stored (see there).
  if (!early) chunk_decays(sm, L, -1, L.dk_rows, L.da_rows, L.zgam);
  __syncthreads();
  // exp(w) in place of w: the pair parts of the K-vector gradients multiply the factors up
  // (products of <= 15 factors <= 1, a few ulp) instead of exponentiating sums per pair. K^ =
  // k exp(Omega) and B^ = b exp(Omega) in dk_rows (over exp(Omega): same element, same thread)
  // and db_rows, 0 on the channel padding where exp(Omega) is not set.
  for (int e = threadIdx.x; e < C * KP; e += NT) {
    const bool on = e % KP < K;
    const float eo = on ? sm[L.dk_rows + e] : 0.f;
    sm[L.w + e] = on ? expf(sm[L.w + e]) : 0.f;
    sm[L.dk_rows + e] = sm[L.k + e] * eo, sm[L.db_rows + e] = sm[L.b + e] * eo;
  }
}

// grad_kernel, step 5: the K-vector gradients dr, da, dk, db of every row into the gradient rows,
// from the state parts there (put_state_part). Ends synchronised.
__device__ __forceinline__ void kvector_grads(float* sm, const Smem& L, float rho) {
  const int K = L.K, KP = L.KP;
  // K-vector gradients, 2 channels of rows 4 p .. 4 p + 3 per task: one pair walk serves the four
  // rows (pair_walks), reading their state parts (dr, da, dk, db rows) where it needs them.
  constexpr int CW = 2, R = kWalkRows;
  using V = Chans<CW>;
  const int nq = (K + CW - 1) / CW;
  for (int e = threadIdx.x; e < (C / R) * nq; e += NT) {
    const int blk = e / nq, i0 = R * blk, d = CW * (e - blk * nq);
    auto state_part = [&](int r, int m) {
      const int rows = m == 0 ? L.dr_rows : m == 1 ? L.da_rows : m == 2 ? L.dk_rows : L.db_rows;
      return V::ld(sm + rows + (i0 + r) * KP + d);
    };
    pair_walks<CW, R>(sm, L, i0, d, rho, state_part);
  }
  __syncthreads();
}

// grad_kernel, step 6: dw by the reverse scan, then the five K-vector gradients to their outputs.
template <typename T>
__device__ __forceinline__ void store_kvector_grads(float* sm, const Smem& L, const DplrChunkPass& p, const Cta& c,
                                                    int64_t t0, int nrow) {
  const int K = L.K, KP = L.KP;
  // Grad g of row t, channel d: straight into its output (kg_pair = 0, one tile), stored into
  // this tile's slab (1), or added onto a zero-filled slab shared by two tiles (2).
  auto put_kg = [&](int g, int64_t t, int d, float v) {
    if (p.kg_pair == 0) {
      *vptr<T>(p.kgd[g], c.s.b, t, c.h, d) = from_f<T>(v);
      return;
    }
    VecArg s = p.kg;
    s.ptr = static_cast<const float*>(p.kg.ptr) + c.tile / p.kg_pair * p.kg_tile + g * p.kg_grad;
    float* const at = vptr<float>(s, c.s.b, t, c.h, d);
    if (p.kg_pair == 1) *at = v;
    else atomicAdd(at, v);
  };
  // dw = reverse cumsum + zeta (§6.4), exactly 0 where exp(w) == 0: per row t (reverse)
  // acc += x_t; acc = 0 where exp(w_t) == 0; dw_t = acc; acc += y_t. Four threads per channel,
  // four rows each: a row group maps the sum entering it to acc_in + c (no reset in it) or to
  // c, and each thread starts from zeta carried through the later groups' maps (shuffles).
  {
    const int part = threadIdx.x % 4, r0 = 4 * part;
    for (int d0 = 0; d0 < K; d0 += NT / 4) {  // the same trip count on every lane
      const int d = d0 + threadIdx.x / 4;
      const bool on = d < K;
      const int sw = part & 2;  // rows in the order r ^ 2 (swap_halves_if)
      float x[4], y[4], cg;
      bool z[4], keep;  // keep: no reset in this row group
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int at = (r0 + (r ^ sw)) * KP + d;
        const bool live = on && r0 + (r ^ sw) < nrow;
        x[r] = live ? sm[L.r + at] * sm[L.dr_rows + at] - sm[L.k + at] * sm[L.dk_rows + at] -
                          sm[L.b + at] * sm[L.db_rows + at]
                    : 0.f;
        y[r] = live ? sm[L.a + at] * sm[L.da_rows + at] : 0.f;
        z[r] = live && sm[L.w + at] == 0.f;  // exp(w), set above
      }
      swap_halves_if(x, sw), swap_halves_if(y, sw), swap_halves_if(z, sw);  // to row order
      dw_group_map(x, y, z, cg, keep);
      float acc = 0.f;  // zeta = gamma rowsum(S * dS+) + its two state-part sums (put_state_part)
      if (on) acc = sm[L.zgam + d] * sm[L.zeta + d] + sm[L.zparts + d] + sm[L.zparts + K + d];
#pragma unroll
      for (int q = 3; q >= 0; --q) {
        const float cq = __shfl_sync(0xffffffffu, cg, q, 4);
        const float kq = __shfl_sync(0xffffffffu, keep ? 1.f : 0.f, q, 4);
        if (q > part) acc = dw_through(acc, cq, kq != 0.f);
      }
      float dw[4];
      dw_group_scan(acc, x, y, z, dw);
      swap_halves_if(dw, sw);  // to the loads' order
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = r0 + (r ^ sw);
        if (!on || row >= nrow) continue;
        if (p.paths.grads_16byte) sm[L.w + row * KP + d] = dw[r];  // over exp(w), read above by this thread only
        else put_kg(kGradW, c.s.bos + t0 + row, d, dw[r]);
      }
    }
  }
  // All five from shared memory, 4 channels per thread (dw in the w rows).
  if (p.paths.grads_16byte) {
    __syncthreads();
    // in kGrad order: r, w, k, a, b
    const float* const src[kNumKGrads] = {sm + L.dr_rows, sm + L.w, sm + L.dk_rows, sm + L.da_rows, sm + L.db_rows};
    static_assert(kGradR == 0 && kGradW == 1 && kGradK == 2 && kGradA == 3 && kGradB == 4, "kGrad order");
    store_kvector_quads<T, NT>(p, c.s.b, c.s.bos, t0, c.h, K, nrow, src, KP);
    return;
  }
  for (int i = threadIdx.x / 64; i < nrow; i += NT / 64) {
    const int64_t t = c.s.bos + t0 + i;
    for (int d = threadIdx.x % 64; d < K; d += 64) {
      const int at = i * KP + d;
      put_kg(kGradR, t, d, sm[L.dr_rows + at]), put_kg(kGradK, t, d, sm[L.dk_rows + at]);
      put_kg(kGradA, t, d, sm[L.da_rows + at]), put_kg(kGradB, t, d, sm[L.db_rows + at]);
    }
  }
}

// The backward's gradients, parallel over (chunk slot, head, tile of dplr_chunk_cols(K)
// columns; bf16 / fp16 at K = 128: (chunk slot, head), the CTA walking the tiles,
// dplr_grad_walks_tiles): with S (hst), S+ and dS+ (dhst, from the reverse sweep) known, every
// chunk's gradients are independent. The pair matrices and X come from the prep workspace. Steps
// (1 to 4 per tile where the CTA walks them; the others load only the tile's columns):
//   1 load_grad_operands   rows, pair matrices and X, v and dO, S and dS+ into shared memory
//   2 state_rowsum         zeta's part rowsum(S * dS+)
//   3 decay_factor_rows    exp(Omega), Â, K^, B^, exp(w) rows
//   4 column_chain_tc ..   dU, dM = d(M + P), dv; the pair-matrix gradients dA, dX -> dA_ab and
//     put_state_part       the state parts (tensor cores: TF32, or 3xTF32 for fp32 inputs)
//   5 kvector_grads        dr, da, dk, db: state parts and pair walks
//   6 store_kvector_grads  dw by the reverse scan, all five K-vector gradients to their outputs
// kStrided (bf16 / fp16, K = V = 64 or 128; DplrKept::states): hst holds every
// kDplrStateStride-th chunk-start state, and a CTA takes the chunks of one in order, S loaded for
// the first and made for each next one in step 4 (NextState), S kept exact in shared memory
// throughout: at K = 64 from the state parts' warps, put after them; at K = 128, where the CTA
// walks two column tiles, each tile's state in a buffer of its own (S, S1), made in place once
// the tile's products have read it.
template <typename T, int KC = 0, bool kStrided = false>  // KC: as prep_kernel's
__global__ void __launch_bounds__(NT, KC == 128 ? 1 : 2) grad_kernel(const DplrChunkPass p) {
  constexpr bool TC = !std::is_same<T, float>::value;  // bf16 / fp16: TF32; fp32: 3xTF32 (X3)
  constexpr bool X3 = !TC;
  // The CTA walks every column tile of its chunk (dplr_grad_walks_tiles, which treats bf16 and
  // fp16 alike; the launch takes KC = 128 for K = 128 alone), summing the tiles' pair-matrix
  // gradients and state parts in registers, and makes the K-vector gradients once, from the sums.
  constexpr bool kWalk = dplr_grad_walks_tiles(TC ? DType::bf16 : DType::f32, KC);
  extern __shared__ float4 sm4[];  // 16-byte aligned: the state rows are stored as float4
  float* sm = reinterpret_cast<float*>(sm4);
  const Smem L(KC ? KC : p.K, true, kStrided && kWalk);
  // The CTA's chunks: one, or on strided states (DplrKept::states) a stride of them in order,
  // each next chunk-start state made from the one before (NextState).
  const DplrSlotChunk first = dplr_grad_first_chunk(p, blockIdx.x);
  const int n = first.n;
  Cta c;
  c.h = blockIdx.y, c.n = n, c.tile = kWalk ? 0 : blockIdx.z, c.s = seq_span(p.cu_seqlens, n, p.T);
  c.x0 = c.tile * L.cols, c.nc = min(L.cols, p.V - c.x0);
  if (first.ci < 0 || first.ci * C >= c.s.len) return;
  static_assert(!kStrided || (TC && ((KC == 64 && !kWalk) || (KC == 128 && kWalk))),
                "strided states: bf16 / fp16, K = 64 in one tile or 128 walking two");
  if (kStrided != (p.kept == DplrKept::states) || (kStrided && p.V != KC)) return;  // (the launch's)
  int64_t last = min(first.ci + (kStrided ? kDplrStateStride : 1), (c.s.len + C - 1) / C);  // (kStrided)
  if (p.window_chunks > 0) last = min(last, p.window_begin + p.window_chunks);
  const int K = L.K, cols = L.cols;
  const float rho = float(p.scale);
  const int tiles = kWalk ? dplr_chunk_tiles(K, p.V) : 1;
  // kWalk: the column sums carried from tile to tile, per warp: its pair-matrix gradient product
  // and its two state-part tasks (step 4 below)
  constexpr int kHeldTasks = 4 * ((KC + 31) / 32) / (NT / 32);
  NextState<KC == 128 ? 128 : 64> next;  // (kStrided)
  // Chunk ci's gradients; makes_next: chunk ci + 1's start state is this CTA's to make (S+ over
  // S once ci's steps no longer read S). A function, not a loop body, so that the builds of one
  // chunk per CTA keep their registers (a loop lets invariants be hoisted out of it, live
  // throughout).
  auto grad_chunk = [&](int64_t ci, bool makes_next) {
    const int64_t t0 = ci * C;
    const int nrow = int(c.s.len - t0 < C ? c.s.len - t0 : C);
    const float* mats = static_cast<const float*>(p.ws) + dplr_mats_offset(p, dplr_ws_slot(p, n, ci), c.h);
    float pair_sum[4] = {0.f, 0.f, 0.f, 0.f};
    float part_sum[kWalk ? kHeldTasks : 1][4][4] = {};
    for (int tile = 0; tile < tiles; ++tile) {
      // The tile's state: S, or on strided states at K = 128 the second tile's own (Smem::S1)
      Smem Lt = L;
      if constexpr (kStrided && kWalk) Lt.S = tile ? L.S1 : L.S;
      bool early = false;
      if constexpr (kWalk) c.tile = tile, c.x0 = tile * cols, c.nc = min(cols, p.V - c.x0);  // (each chunk from tile 0)
      if (tile == 0) {
        early = load_grad_operands<T>(sm, Lt, p, c, ci, t0, nrow, mats, ci == first.ci);
      } else {
        load_tile_columns<T>(sm, Lt, p, c, ci, t0, nrow, !kStrided || ci == first.ci);
      }
      __syncthreads();
      state_rowsum<TC, kStrided>(sm, Lt, tile > 0);
      if (tile == 0) decay_factor_rows(sm, L, early);
      // Y = X^T dX, then dA_ab = stril(Y X^T). Ends synchronised.
      auto solve_grads = [&]() {
        const int i = threadIdx.x / C, j = threadIdx.x % C;
        float y = 0.f;
        for (int pp = 0; pp < C; ++pp) y += sm[L.X + pp * CP + i] * sm[L.dX + pp * CP + j];
        sm[L.Y + i * CP + j] = y;
        __syncthreads();
        float z = 0.f;
        if (j < i)
          for (int q = 0; q < C; ++q) z += sm[L.Y + i * CP + q] * sm[L.X + j * CP + q];
        sm[L.dA + 4 * (i * C + j) + 3] = z;
        __syncthreads();
      };
      // Step 4: dU, dM, dv and the pair-matrix gradients.
      __syncthreads();  // K^, B^, exp(w) (decay_factor_rows), S and dS+ (TF32 unless X3: state_rowsum)
      column_chain_tc<T, kStrided>(sm, Lt, p, c, t0, nrow, rho);
      __syncthreads();
      const int warp = threadIdx.x / 32;
      if constexpr (!kWalk) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        pair_grad_product<X3>(sm, L, acc);
        put_pair_grads(sm, L, acc, rho);
        if constexpr (kStrided) {
          // (K = 64: one task per warp) K^ and B^ read for the next state between the task's
          // product and its put, which writes over them: nothing held through the products.
          static_assert(4 * ((KC + 31) / 32) == NT / 32, "a state-part task per warp");
          float part[4][4] = {};
          state_part_product<true>(sm, L, warp, part);
          if (makes_next) {
            next.load_keys(sm, L);
            __syncthreads();
          }
          put_state_part(sm, L, warp, part);
          if (makes_next) next.update(sm, L);
        } else {
          for (int task = warp; task < state_part_tasks(L); task += NT / 32) {
            float part[4][4] = {};
            state_part_product<false, X3>(sm, L, task, part);
            put_state_part(sm, L, task, part);
          }
        }
      } else {
        static_assert(!kWalk || kHeldTasks * (NT / 32) == 4 * ((KC + 31) / 32), "every warp holds kHeldTasks tasks");
        pair_grad_product(sm, Lt, pair_sum);
#pragma unroll
        for (int h = 0; h < kHeldTasks; ++h) state_part_product<kStrided>(sm, Lt, warp + h * (NT / 32), part_sum[h]);
        if constexpr (kStrided) {
          if (makes_next) {  // the tile's next state, in place once every product has read S
            __syncthreads();
            next.update_in_place(sm, Lt);
          }
        }
        if (tile + 1 < tiles) {  // this tile's rows and states are read: the next tile's loads go over them
          __syncthreads();
          continue;
        }
        if constexpr (kStrided) {
          if (makes_next) __syncthreads();  // (the update read K^, B^, which the puts write over)
        }
        put_pair_grads(sm, L, pair_sum, rho);
#pragma unroll
        for (int h = 0; h < kHeldTasks; ++h) put_state_part(sm, L, warp + h * (NT / 32), part_sum[h]);
      }
      __syncthreads();
      if constexpr (kStrided && !kWalk) {
        if (makes_next) next.put(sm, L);  // (no later step of this chunk reads S)
      }
      solve_grads();
      kvector_grads(sm, L, rho);
      store_kvector_grads<T>(sm, L, p, c, t0, nrow);
    }
  };
  if constexpr (kStrided) {
    for (int64_t ci = first.ci; ci < last; ++ci) {
      grad_chunk(ci, ci + 1 < last);
      if (ci + 1 < last) __syncthreads();  // this chunk's rows read: the next one's loads go over them
    }
  } else {
    grad_chunk(first.ci, false);
  }
}

}  // namespace dplr_chunk_detail
}  // namespace fla
