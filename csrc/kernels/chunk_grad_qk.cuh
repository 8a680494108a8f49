// The chunk engine's grad_qk kernel (chunk.cuh has the overview): dA, dq, dk, dg and the du
// partials of every chunk.
#pragma once
#include "async_copy.cuh"   // prefetch_l2
#include "chunk_intra.cuh"  // the micro-blocks (MB, NMB)

namespace fla {
namespace chunk_detail {

// ------------------------------------------------------------------------------------------------
// The in-sub-chunk part of dq and dk for thread (m, ch): channel ch of sub-chunk m's 16 rows. On
// entry DQ / DK hold the inter and off-diagonal terms at the sub-chunk references; on exit the
// complete dq' and dk'. The 4-row micro-blocks of diag_step_a / diag_step_b again: pairs inside a
// micro-block walk their exponents; pairs across micro-blocks use k4 = k ⊙ exp2(L) (to the key's
// micro-block end) and q4 = q ⊙ exp2(R) (reader exponent from the query's micro-block start) with
// the micro-block totals in between, every exponent a sum of terms <= 0:
//   dq_i = e^{R_i + B4} DQ_i + Σ_{j in i's micro-block} dA_ij k_j e^{(j,i]}
//          + Σ_{μj < μi} e^{R_i + τ4 between} Σ_{j in μj} dA_ij k4_j
//   dk_i = e^{L_i + A4} DK_i + Σ_{j in i's micro-block} dA_ji q_j e^{(i,j]}
//          + Σ_{μj > μi} e^{L_i + τ4 between} Σ_{j in μj} dA_ji q4_j
// (B4 / A4: the τ4 of the micro-blocks before / after i's in the sub-chunk; exclusive reader:
// (j,i) and (i,j) instead.) The pairs j = i are left out for both readers: the caller adds them
// (as the u bonus; 1 for GLA) where they cancel exactly in the dg sums. Q, Kr hold raw q, k; all
// loops unroll. Without DK only dq is formed (Q is not read).
template <Reader RD, bool DK_TOO = true>
__device__ __forceinline__ void diag_grads(Tile* DQ, Tile* DK, const Tile* DA, const Tile* Q,
                                           const Tile* Kr, const Tile* LAM, int m, int ch) {
  constexpr bool INC = RD == Reader::Inclusive;
  const int r0 = m * SC;
  float k4[SC], q4[SC], t4[NMB];
#pragma unroll
  for (int mu = 0; mu < NMB; ++mu) {
    float f = 0.f, e = 0.f;
#pragma unroll
    for (int r = MB - 1; r >= 0; --r) {
      const int j = mu * MB + r;
      k4[j] = Kr[r0 + j][ch] * ex2(f);
      f += LAM[r0 + j][ch];
    }
    t4[mu] = f;
    if constexpr (DK_TOO) {
#pragma unroll
      for (int r = 0; r < MB; ++r) {
        const int i = mu * MB + r;
        if (INC) e += LAM[r0 + i][ch];
        q4[i] = Q[r0 + i][ch] * ex2(e);
        if (!INC) e += LAM[r0 + i][ch];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < SC; ++i) {  // dq
    const int mi = i / MB, I = r0 + i;
    float e = INC ? LAM[I][ch] : 0.f, w = 0.f;
#pragma unroll
    for (int j = i - 1; j >= mi * MB; --j) {
      w += DA[I][r0 + j] * Kr[r0 + j][ch] * ex2(e);
      e += LAM[r0 + j][ch];
    }
    float before = 0.f;  // e = R_i now
#pragma unroll
    for (int nu = 0; nu < mi; ++nu) before += t4[nu];
    float x = ex2(e + before) * DQ[I][ch] + w, g = 0.f;
#pragma unroll
    for (int mj = mi - 1; mj >= 0; --mj) {
      float sum = 0.f;
#pragma unroll
      for (int r = 0; r < MB; ++r) sum += DA[I][r0 + mj * MB + r] * k4[mj * MB + r];
      x += ex2(e + g) * sum;
      g += t4[mj];
    }
    DQ[I][ch] = x;
  }
  if constexpr (DK_TOO) {
#pragma unroll
    for (int i = 0; i < SC; ++i) {  // dk
      const int mi = i / MB, I = r0 + i;
      float e = 0.f, w = 0.f;
#pragma unroll
      for (int j = i + 1; j < (mi + 1) * MB; ++j) {
        if (INC) e += LAM[r0 + j][ch];
        w += DA[r0 + j][I] * Q[r0 + j][ch] * ex2(e);
        if (!INC) e += LAM[r0 + j][ch];
      }
      float after = 0.f;  // e = L_i now
#pragma unroll
      for (int nu = mi + 1; nu < NMB; ++nu) after += t4[nu];
      float x = ex2(e + after) * DK[I][ch] + w, g = 0.f;
#pragma unroll
      for (int mj = mi + 1; mj < NMB; ++mj) {
        float sum = 0.f;
#pragma unroll
        for (int r = 0; r < MB; ++r) sum += DA[r0 + mj * MB + r][I] * q4[mj * MB + r];
        x += ex2(e + g) * sum;
        g += t4[mj];
      }
      DK[I][ch] = x;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The value-side forward's o through a softmax over each row (ChunkPass::o_softmax; here o is the
// transposed pass's dq, its row the K channels, all in this CTA's one K tile): every thread
// completes its logits in DQ (channels past K: -inf, weight 0), then a warp per row takes their
// max, the exponentials and their sum, and stores the weights. fp32 throughout, expf (not
// ex2.approx: the logits are not decay sums and may be large).
template <typename T>
__device__ __forceinline__ void store_softmax_rows(const ChunkPass& p, const Pos& pos, int h, Tile* DQ,
                                                   const Tile* DA, const Tile* KY, const float* us,
                                                   int m, int ch) {
  static_assert(DT == 64, "a lane holds channels lane and lane + 32");
#pragma unroll
  for (int t = m * SC; t < (m + 1) * SC; ++t)
    DQ[t][ch] = ch < p.K ? DQ[t][ch] + DA[t][t] * us[ch] * KY[t][ch] : -INFINITY;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  for (int t = threadIdx.x / 32; t < pos.L; t += NTH / 32) {  // warp-uniform: every lane shuffles
    const float x0 = DQ[t][lane], x1 = DQ[t][lane + 32];
    float top = fmaxf(x0, x1);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
    const float e0 = expf(x0 - top), e1 = expf(x1 - top);
    float sum = e0 + e1;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    auto store = [&](int c, float e) {
      if (c >= p.K) return;
      const float w = e / sum;
      *vptr<T>(p.dq, pos.b, pos.t0 + t, h, c) = from_f<T>(w);
      if (p.o_softmax_acc.on()) *vptr<float>(p.o_softmax_acc, pos.b, pos.t0 + t, h, c) = w;
    };
    store(lane, e0);
    store(lane + 32, e1);
  }
}

// dq's rows through the softmax's backward (ChunkPass::dq_softmax_w; the launch has one K tile):
// DQ holds every row's complete dq; a warp per row forms ⟨w, dq⟩ with shuffles and stores
// w ⊙ (dq − ⟨w, dq⟩), rounded once. A warp loads the weights of all its rows before the first
// row's sum, so that it waits out the memory's latency once, not once per row.
template <typename T>
__device__ __forceinline__ void store_softmax_grad_rows(const ChunkPass& p, const Pos& pos, int h,
                                                        const Tile* DQ) {
  constexpr int WARPS = NTH / 32, ROWS = C / WARPS;  // rows t = warp + i * WARPS
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool on0 = lane < p.K, on1 = lane + 32 < p.K;
  const VecArg& w = p.dq_softmax_w;
  float w0[ROWS], w1[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const int t = warp + i * WARPS;
    const bool row = t < pos.L;
    w0[i] = row && on0 ? *vptr<float>(w, pos.b, pos.t0 + t, h, lane) : 0.f;
    w1[i] = row && on1 ? *vptr<float>(w, pos.b, pos.t0 + t, h, lane + 32) : 0.f;
  }
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const int t = warp + i * WARPS;
    if (t >= pos.L) break;  // warp-uniform: every lane shuffles
    const float d0 = on0 ? DQ[t][lane] : 0.f, d1 = on1 ? DQ[t][lane + 32] : 0.f;
    float dot = w0[i] * d0 + w1[i] * d1;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    const int64_t row = pos.t0 + t;
    if (on0) *vptr<T>(p.dq, pos.b, row, h, lane) = from_f<T>(w0[i] * (d0 - dot));
    if (on1) *vptr<T>(p.dq, pos.b, row, h, lane + 32) = from_f<T>(w1[i] * (d1 - dot));
  }
}

// ------------------------------------------------------------------------------------------------
// dq, dk, dg (and du partials) for one chunk and K tile. DQ_ONLY: dq alone (the value-side
// forward's o, chunk_vdecay.cuh): no dS+, no q, no dk or dg work; dk, dg, du are not written.
// DQ_SOFTMAX: dq through the softmax's backward (ChunkPass::dq_softmax_w; its own build, so the
// plain kernels keep their registers). vec: the activations are rows of whole 16-byte pieces
// (grad_qk_vec).
template <typename T, Reader RD, bool DQ_ONLY = false, bool DQ_SOFTMAX = false>
__global__ void __launch_bounds__(NTH, 2) chunk_grad_qk_kernel(ChunkPass p, int nts, bool vec) {
  extern __shared__ float4 smem4[];
  Tile* DA = reinterpret_cast<Tile*>(smem4);
  Tile* DQ = DA + C;
  Tile* DK = DQ + C;
  Tile* QX = DK + C;   // phase 1: dO^T; phase 2: q, then q ⊙ exp2(reader exponent)
  Tile* KY = QX + C;   // phase 1: V^T;  phase 2: k, then k ⊙ exp2(Qex)
  Tile* LAM = KY + C;  // phase 1: S^T;  phase 2: λ
  Decays& d = *reinterpret_cast<Decays*>(LAM + C);
  float* zs = reinterpret_cast<float*>(&d + 1);  // [DT] zeta
  float* us = zs + DT;                            // [DT] u, then [DT] the last row's k ⊙ dk_inter
  // The dg scan's arrays reuse the decays' space (dead by then): 110 KB keeps 2 CTAs per SM.
  float* carry = reinterpret_cast<float*>(&d);              // [NSC][DT] sub-chunk scan values
  int* resets = reinterpret_cast<int*>(carry + NSC * DT);   // [NSC][DT]
  float* dup = reinterpret_cast<float*>(resets + NSC * DT); // [NSC][DT] du partials
  static_assert(sizeof(Decays) >= 4 * NSC * DT * sizeof(float), "scan arrays fit");

  Pos pos;
  if (!locate(p, blockIdx.x, pos)) return;
  const int h = blockIdx.y, k0 = blockIdx.z * DT;
  const int m = threadIdx.x / DT, ch = threadIdx.x % DT;
  const int64_t KV = int64_t(p.K) * p.V;
  const float rho = float(p.scale);

  // Phase 1, over V tiles: dA = dO Vᵀ, dqi = dO Sᵀ, dki = V dS+ᵀ.
  Acc<T> da, dqi, dki;
  const float* S = static_cast<const float*>(p.hst) + (pos.slot * p.H + h) * KV;
  const float* dS = static_cast<const float*>(p.dhst) + (pos.slot * p.H + h) * KV;
  const bool mats_vec = p.V % 4 == 0 && aligned16(S) && (DQ_ONLY || aligned16(dS));
  for (int v0 = 0; v0 < p.V; v0 += DT) {
    __syncthreads();
    {  // the V tile's loads in flight at once (kTilesTogether), by columns for the transposed stores
      constexpr bool together = kTilesTogether<T>;
      RowPieces<T, true> fo, fv;
      RowPieces<float, true> fs, fd;
      fo.fetch(p.dout, pos.b, pos.t0, pos.L, h, v0, p.V, vec);
      fv.fetch(p.v, pos.b, pos.t0, pos.L, h, v0, p.V, vec);
      if (!together) fo.store_transposed(QX, 1.f), fv.store_transposed(KY, 1.f);
      fs.fetch_mat(S, p.K, p.V, k0, v0, mats_vec);
      if (!together) fs.template store_transposed<kTC<T>>(LAM, 1.f);
      if (!DQ_ONLY) fd.fetch_mat(dS, p.K, p.V, k0, v0, mats_vec);
      if (together) fo.store_transposed(QX, 1.f), fv.store_transposed(KY, 1.f), fs.template store_transposed<kTC<T>>(LAM, 1.f);
      if (!DQ_ONLY) fd.template store_transposed<kTC<T>>(DQ, 1.f);
    }
    __syncthreads();
    // Phase 2's rows, on their way to L2 under this tile's products (their loads waited on DRAM).
    if (v0 + DT >= p.V) prefetch_key_tile<T, !DQ_ONLY>(p, pos, h, k0, min(DT, p.K - k0));
    // Every operand a TF32 value (dO, V widened; S, dS+ rounded at the store): read RAW.
    da.template mma<true, Tri::Full, true>(QX, KY, DT);
    dqi.template mma<true, Tri::Full, true>(QX, LAM, DT);
    if (!DQ_ONLY) dki.template mma<true, Tri::Full, true>(KY, DQ, DT);
  }
  __syncthreads();
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    const int i = da.row(e), j = da.col(e);
    DA[i][j] = j <= i ? rho * da.v[e] : 0.f;  // tril, diagonal included (u terms)
    DQ[i][j] = rho * dqi.v[e];
    if (!DQ_ONLY) DK[i][j] = dki.v[e];
  }
  if (threadIdx.x < DT) {
    float z = 0.f;
    const int kk = k0 + threadIdx.x;
    if (kk < p.K)
      for (int t = 0; t < nts; ++t)
        z += static_cast<const float*>(p.zeta)[((pos.slot * p.H + h) * nts + t) * p.K + kk];
    zs[threadIdx.x] = z;
    // The self pair (i = i) of dq / dk, left out of diag_grads: RWKV6's bonus u, GLA's 1.
    us[threadIdx.x] = RD == Reader::Inclusive ? 1.f
                      : kk < p.K ? ldu(p.u, int64_t(h) * p.K + kk, p.udtype) : 0.f;
  }
  __syncthreads();

  // Phase 2: the K tile's q, k, λ.
  if constexpr (!DQ_ONLY) {
    if (p.dg_adds) prefetch_rows<T>(p.dg, pos, h, k0, min(DT, p.K - k0));
    if (p.dk_adds) prefetch_rows<T>(p.dk, pos, h, k0, min(DT, p.K - k0));
  }
  if constexpr (DQ_SOFTMAX) prefetch_rows<float>(p.dq_softmax_w, pos, h, 0, p.K);
  {
    constexpr bool together = kTilesTogether<T>;
    RowPieces<T> fq, fk, fl;
    if (!DQ_ONLY) fq.fetch(p.q, pos.b, pos.t0, pos.L, h, k0, p.K, vec);
    if (!DQ_ONLY && !together) fq.store(QX, 1.f);
    fk.fetch(p.k, pos.b, pos.t0, pos.L, h, k0, p.K, vec);
    if (!together) fk.store(KY, 1.f);
    fl.fetch(p.g, pos.b, pos.t0, pos.L, h, k0, p.K, vec);
    if (!DQ_ONLY && together) fq.store(QX, 1.f);
    if (together) fk.store(KY, 1.f);
    fl.store(LAM, kLog2e);
  }
  __syncthreads();
  chunk_decays(d, LAM);
  // Inter terms to the sub-chunk references; operands for the off-diagonal blocks. Also
  // kin = k ⊙ dk_inter (exponent Ω_i = Σ_{r>i} λ_r) for the dg scan below: summed over this
  // thread's rows but the chunk's last, L - 1, whose term stays apart. There the factor is
  // exp2(0) = 1 and nothing else ever adds to DK (no later rows), so kin_last is bitwise the
  // product the scan forms from the final DK (__fmul_rn: no contraction on either side).
  // DQ_ONLY forms the dq terms alone (q is not loaded).
  float kin_sum = 0.f, kin_last = 0.f;
  {
    float suf = 0.f;
#pragma unroll
    for (int ii = SC - 1; ii >= 0; --ii) {
      const int row = m * SC + ii;
      DQ[row][ch] *= d.before[m][ch];
      if (DQ_ONLY) continue;
      const float dki = DK[row][ch] * d.after[m][ch];
      DK[row][ch] = dki;
      const float kin = __fmul_rn(KY[row][ch], ex2(suf) * dki);
      if (row == pos.L - 1) kin_last = kin; else kin_sum += kin;
      suf += LAM[row][ch];
    }
  }
  if (!DQ_ONLY) scale_reader<RD>(QX, LAM, m, ch, 1.f);
  scale_key<false>(KY, LAM, m, ch, 1.f);
  __syncthreads();
  {  // off-diagonal: DQ[i] += Σ_{j in mk<mq} dA_ij KY_j gap;  DK[j] += Σ_{i in mq>mk} dA_ij QX_i gap
    Acc<T> aq, ak;
    auto all = [](int, int) { return true; };
    aq.template mma_blocks<false>(
        DA, KY, [](int) { return 0; }, [](int mr) { return mr * SC; },
        [&](int j, int c, int mr) { return d.gap[j / SC][mr][c]; }, all);
    if (!DQ_ONLY)
      ak.template mma_blocks<true>(
          DA, QX, [](int mr) { return (mr + 1) * SC; }, [](int) { return C; },
          [&](int i, int c, int mr) { return d.gap[mr][i / SC][c]; }, all);
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      DQ[aq.row(e)][aq.col(e)] += aq.v[e];
      if (!DQ_ONLY) DK[ak.row(e)][ak.col(e)] += ak.v[e];
    }
  }
  __syncthreads();
  {  // raw q, k again
    RowPieces<T> fq, fk;
    if (!DQ_ONLY) fq.fetch(p.q, pos.b, pos.t0, pos.L, h, k0, p.K, vec);
    fk.fetch(p.k, pos.b, pos.t0, pos.L, h, k0, p.K, vec);
    if (!DQ_ONLY) fq.store(QX, 1.f);
    fk.store(KY, 1.f);
  }
  __syncthreads();
  diag_grads<RD, !DQ_ONLY>(DQ, DK, DA, QX, KY, LAM, m, ch);
  if constexpr (DQ_ONLY) {  // the value-side forward's o: dq alone, no dg scan
    if (p.o_softmax) return store_softmax_rows<T>(p, pos, h, DQ, DA, KY, us, m, ch);
    const int kk = k0 + ch;
    if (kk < p.K)
      for (int t = m * SC; t < (m + 1) * SC && t < pos.L; ++t)
        put<T>(p.dq, p.dq_acc, pos.b, pos.t0 + t, h, kk, DQ[t][ch] + DA[t][t] * us[ch] * KY[t][ch]);
    return;
  }

  // dg by the reverse cumsum (§3; RWKV6 reader terms strictly after t), as a segmented scan over
  // the 4 sub-chunks: where exp(λ_t) == 0 the true dg_t is exactly 0, and so is the suffix sum
  // (ζ included) it stands for, so the scan restarts from 0 there.
  //   ζ = rowsum(S⁺ ⊙ dS⁺) = γ ⊙ rowsum(S ⊙ dS⁺) (the state kernel's partials) + Σ_j k_j ⊙ dk_inter_j.
  // The last row's term k ⊙ dk_inter is O(1) whatever the decays and cancels against the same
  // term inside its k ⊙ dk: it goes into that row's summand instead (where the two are the same
  // fp32 product and cancel exactly), so ζ enters as γ-term + Σ_{j < L-1}; every other term then
  // carries a decay factor, and a chunk of strong decays (all <= -20) gets a dg of the right
  // size instead of an fp32 residue of O(1) terms.
  float* const kins = carry + 3 * NSC * DT;  // [NSC][DT] kin_sum partials
  kins[m * DT + ch] = kin_sum;
  if (pos.L - 1 >= m * SC && pos.L - 1 < (m + 1) * SC) us[DT + ch] = kin_last;
  __syncthreads();
  if (threadIdx.x < DT) zs[ch] += kins[ch] + kins[DT + ch] + kins[2 * DT + ch] + kins[3 * DT + ch];
  const float last_term = us[DT + ch];
  __syncthreads();
  const int kk = k0 + ch;
  // Row 0 of this thread's column of each output (null when off: chunk_vdecay.cuh wants only
  // some of them); row t is t time steps further.
  auto col0 = [&](const VecArg& a) { return a.on() ? vptr<T>(a, pos.b, pos.t0, h, kk) : nullptr; };
  T* const dgp = col0(p.dg);
  T* const dkp = col0(p.dk);
  const bool adds = p.dg_adds || p.dk_adds;  // then store_dg_dk stores both after the scan
  auto step = [&](float& acc, int t, bool write) {
    const float q = QX[t][ch], k = KY[t][ch];
    const bool dead = ex2(LAM[t][ch]) == 0.f && t < pos.L;
    const float xq = q * DQ[t][ch], xk = __fmul_rn(k, DK[t][ch]) - (t == pos.L - 1 ? last_term : 0.f);
    if (RD == Reader::Inclusive) acc += xq - xk; else acc -= xk;
    float dg = acc;
    if (dead) dg = 0.f, acc = 0.f;
    if (RD == Reader::Exclusive) acc += xq;
    if (write && t < pos.L && kk < p.K) {
      const float dA = DA[t][t];
      const float dk = DK[t][ch] + dA * us[ch] * q;
      if (adds) {  // dg and dk wait in this thread's own (now dead) LAM and DK cells
        LAM[t][ch] = dg;
        DK[t][ch] = dk;
      } else {
        if (dgp) dgp[t * p.dg.st] = from_f<T>(dg);
        if (dkp) dkp[t * p.dk.st] = from_f<T>(dk);
      }
      if (DQ_SOFTMAX) DQ[t][ch] += dA * us[ch] * k;  // stored by store_softmax_grad_rows
      else if (p.dq.on()) put<T>(p.dq, p.dq_acc, pos.b, pos.t0 + t, h, kk, DQ[t][ch] + dA * us[ch] * k);
      if (RD == Reader::Exclusive) dup[m * DT + ch] += dA * q * k;
    }
    return dead;
  };
  // Where dg or dk add into tensors (dg_adds, dk_adds), this thread's column of both is stored
  // after the scan, every earlier value loaded first, all at once: a load beside each store inside
  // the scan waits out the memory's latency once per row. Plain stores stay in the scan, where
  // nothing waits on them.
  auto store_dg_dk = [&]() {
    if (!adds || kk >= p.K) return;
    float dg_before[SC], dk_before[SC];
#pragma unroll
    for (int i = 0; i < SC; ++i) {
      const int t = m * SC + i;
      const bool row = t < pos.L;
      dg_before[i] = dgp && p.dg_adds && row ? to_f(dgp[t * p.dg.st]) : 0.f;
      dk_before[i] = dkp && p.dk_adds && row ? to_f(dkp[t * p.dk.st]) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < SC; ++i) {
      const int t = m * SC + i;
      if (t >= pos.L) break;
      if (dgp) dgp[t * p.dg.st] = from_f<T>(p.dg_adds ? LAM[t][ch] + dg_before[i] : LAM[t][ch]);
      if (dkp) dkp[t * p.dk.st] = from_f<T>(p.dk_adds ? DK[t][ch] + dk_before[i] : DK[t][ch]);
    }
  };
  {
    float acc = 0.f;
    int reset = 0;
    for (int t = (m + 1) * SC - 1; t >= m * SC; --t) reset |= step(acc, t, false);
    carry[m * DT + ch] = acc, resets[m * DT + ch] = reset;
    dup[m * DT + ch] = 0.f;
  }
  __syncthreads();
  {
    float acc = zs[ch];
    for (int l = NSC - 1; l > m; --l) acc = resets[l * DT + ch] ? carry[l * DT + ch] : acc + carry[l * DT + ch];
    for (int t = (m + 1) * SC - 1; t >= m * SC; --t) step(acc, t, true);
  }
  store_dg_dk();
  if (RD == Reader::Exclusive && p.du) {
    __syncthreads();
    if (threadIdx.x < DT && kk < p.K)
      static_cast<float*>(p.du)[(pos.slot * p.H + h) * p.K + kk] =
          dup[ch] + dup[DT + ch] + dup[2 * DT + ch] + dup[3 * DT + ch];
  }
  if constexpr (DQ_SOFTMAX) {
    __syncthreads();
    Pos at;  // located again: pos held through the scans would spill
    locate(p, blockIdx.x, at);
    store_softmax_grad_rows<T>(p, at, blockIdx.y, DQ);
  }
}

// The `vec` argument of chunk_grad_qk_kernel.
template <typename T>
inline bool grad_qk_vec(const ChunkPass& p) {
  constexpr int P = RowPieces<T>::P;
  return key_rows_vec<T>(p) && rows_in_pieces(p.v, p.V, P) && rows_in_pieces(p.dout, p.V, P);
}

}  // namespace chunk_detail
}  // namespace fla
