// The RWKV7 single-pass backward's gradients of one chunk beyond its chain (dplr_chunk_fused_backward.cuh):
// the state-side products, the sums over the value columns and the K-vector gradients.
#pragma once
#include <type_traits>

#include "dplr_chunk_fused_backward_smem.cuh"
#include "dplr_dw_scan.cuh"
#include "dplr_kvector_stores.cuh"

namespace fla {
namespace dplr_fused_detail {

// Step 2 for chunk ci, whose start state S^T this warp holds at its columns (st, as dt): the
// state-side products and the sums over the value columns, then the chunk-wide rest and the five
// K-vector gradients to their outputs. dt: dS+ (before this chunk's update), du, dm: dU^T, dM^T,
// each with its fp16 scale. Ends synchronised.
template <typename T>
__device__ inline void kvector_grads(const DplrChunkPass& p, const SeqSpan& s, const float (&st)[K / 8][4], int h,
                                     int64_t ci, const ChunkSteps& at, const ChainTiles& ct, const GradSmem& gs,
                                     const tile::F16A& dot,
                                     const float (&dt)[K / 8][4], float sd, const float (&du)[2][4], float sdu,
                                     const float (&dm)[2][4], float sdm, bool bounded, int tid) {
  using tile::F16A;
  using tile::F16B;
  using CT = ChainTiles;
  using B = ChunkBlock;
  const HeldLane ln(tid);
  const int x0 = ln.x0;
  constexpr int kRow = GradSmem::kRow, kMatRow = GradSmem::kMatRow;  // (the buffers' row strides)
  auto sc = [&](int t) { return ct.scale[t]; };
  const float ss = tile::pow2_down_scale(warp_amax(st));
  // M^T, U^T (state_products)
  float mt[2][4] = {}, ut[2][4] = {};
  state_products(ct, tile::a_from_km(ct.tile(CT::kV) + x0, kF16Row), sc(CT::kV), st, ss, mt, ut);
  const float su = tile::pow2_down_scale(warp_amax(ut)), smt = tile::pow2_down_scale(warp_amax(mt));
  // The 16 x 64 sums (column_sum), in two rounds through part's space: dR^ = rho dO S^T and dW =
  // dU S^T, then dK^ = V dS+^T and dB^ = U dS+^T.
  const F16A ua = tile::a_from_acc_t(ut[0], ut[1], su), dua = tile::a_from_acc_t(du[0], du[1], sdu);
  const F16A dma = tile::a_from_acc_t(dm[0], dm[1], sdm);
  const F16A doa = tile::a_from_mk(ct.tile(CT::kDout) + x0, kF16Row);
  {
    __half* const cols = reinterpret_cast<__half*>(gs.part);  // [V][kF16Row]: S^T, then dS+^T
    __half* const rows = cols + V * kF16Row;                  // [C][kF16Row]: dU, then U
    float* const scales = reinterpret_cast<float*>(rows + C * kF16Row);  // [4][4]: a row tile's, a column tile's, ...
    static_assert((V + C) * kF16Row * 2 + 16 * 4 <= 4 * GradSmem::kPart * 4, "in part's space");
    const int warp = tid / 32, d0 = 16 * warp;
    float* const s_a = scales, *const s_b = scales + 4, *const s_row = scales + 8, *const s_col = scales + 12;
    // One round: the held block h (scale sh) the column side, against the chain tile `tile` (its
    // scales at s_tile) into out_tile and the A operand ra (scale sr) into out_rows.
    auto round = [&](const float(&h)[K / 8][4], float sh, const F16A& ra, float sr, int tile, float* s_tile,
                     int out_tile, int out_rows) {
      put_held_f16(h, sh, cols, ln);
      put_a_f16(ra, rows, ln);
      if (tid % 32 == 0) s_tile[warp] = sc(tile), s_row[warp] = sr, s_col[warp] = sh;
      __syncthreads();
      column_sum(ct.tile(tile), s_tile, cols, s_col, d0, gs.big + out_tile * C * kRow);
      column_sum(rows, s_row, cols, s_col, d0, gs.big + out_rows * C * kRow);
      __syncthreads();
    };
    round(st, ss, dua, sdu, CT::kDout, s_a, GradSmem::kDR, GradSmem::kDW);
    round(dt, sd, ua, su, CT::kV, s_b, GradSmem::kDK, GradSmem::kDB);  // (then part's space: the 16 x 16 partials)
  }
  // The 16 x 16 sums and zeta's rowsum(S * dS+), all four warps' partials, then one sum.
  {
    F16B vb[2];
    tile::b_from_nk(vb, ct.tile(CT::kV) + x0, kF16Row);  // B(k = column, n = row j) = v[j][column]
    float m4[4][2][4] = {};
    const Unscale un_rk(sc(CT::kDout), sc(CT::kV)), un_rb(sc(CT::kDout), su), un_ak(sdm, sc(CT::kV)), un_x1(sdu, smt);
    for (int t = 0; t < 2; ++t) {
      tile::mma_f16(m4[GradSmem::kDArk][t], doa, vb[t]);
      tile::mma_f16(m4[GradSmem::kDArb][t], doa, tile::b_from_acc(ut[t], su));
      tile::mma_f16(m4[GradSmem::kDAak][t], dma, vb[t]);
      tile::mma_f16(m4[GradSmem::kDX1][t], dua, tile::b_from_acc(mt[t], smt));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        m4[GradSmem::kDArk][t][e] = un_rk(m4[GradSmem::kDArk][t][e]);
        m4[GradSmem::kDArb][t][e] = un_rb(m4[GradSmem::kDArb][t][e]);
        m4[GradSmem::kDAak][t][e] = un_ak(m4[GradSmem::kDAak][t][e]);
        m4[GradSmem::kDX1][t][e] = un_x1(m4[GradSmem::kDX1][t][e]);
      }
    }
    for (int m = 0; m < 4; ++m) put_partial(gs, m4[m], m * C * C, C, tid);
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
        if (ln.g == 0) mine[ln.chan(t, e)] = z;
      }
    sum_partials(gs, tid);
  }
  // Chunk-wide, on TF32 tensor cores (fp32 operands in shared memory, rounded as the two-pass
  // grad kernel's; 3xTF32 for fp32 inputs): the masks, dX = dU M^T + dW Â^T (warps 0, 1: a column
  // tile each), dÂ = X^T dW (each warp its 16 channels), then on warp 0 Y = X^T dX and
  // dA_ab = stril(Y X^T).
  constexpr bool X3 = std::is_same<T, float>::value;
  const int warp = tid / 32, g = tid % 32 / 4, q = tid % 4, d0 = 16 * warp;
  // element e of a warp's m16n8 accumulator: row g + 8 (e / 2), column 2q + e % 2 of its tile
  auto row_of = [&](int e) { return g + 8 * (e / 2); };
  auto col_of = [&](int e) { return 2 * q + e % 2; };
  const float* const X = at.blk + B::mats + kMatX * C * LM;
  float* const dArk = gs.small + GradSmem::kDArk * C * kMatRow;
  float* const dArb = gs.small + GradSmem::kDArb * C * kMatRow;
  float* const dAak = gs.small + GradSmem::kDAak * C * kMatRow;
  const float* const dX1 = gs.small + GradSmem::kDX1 * C * kMatRow;
  const float* const dW = gs.big + GradSmem::kDW * C * kRow;
  for (int e = tid; e < C * C; e += NTF) {
    const int i = e / C, j = e % C, x = i * kMatRow + j;
    if (j > i) dArk[x] = 0.f, dArb[x] = 0.f;
    if (j >= i) dAak[x] = 0.f;
  }
  if (warp < 2) {
    float acc[4] = {};
    tile::warp_mma_ld<false, true, false, false, X3>(acc, K, dW, kRow, at.blk + B::ahat + 8 * warp * LA, LA);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int at_ij = row_of(e) * kMatRow + 8 * warp + col_of(e);
      gs.dx[at_ij] = dX1[at_ij] + acc[e];
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    float acc[4] = {};
    tile::warp_mma_ld<true, false, false, false, X3>(acc, C, X, LM, dW + d0 + 8 * nt, kRow);
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2)  // (elements 2 h2, 2 h2 + 1: row g + 8 h2, two channels)
      *reinterpret_cast<float2*>(gs.dahat + (g + 8 * h2) * kRow + d0 + 8 * nt + 2 * q) =
          make_float2(acc[2 * h2], acc[2 * h2 + 1]);
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float acc[4] = {};
      tile::warp_mma_ld<true, false, false, false, X3>(acc, C, X, LM, gs.dx + 8 * nt, kMatRow);
#pragma unroll
      for (int e = 0; e < 4; ++e) gs.y[row_of(e) * kMatRow + 8 * nt + col_of(e)] = acc[e];
    }
    __syncwarp();
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float acc[4] = {};
      tile::warp_mma_ld<false, true, false, false, X3>(acc, C, gs.y, kMatRow, X + 8 * nt * LM, LM);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = row_of(e), j = 8 * nt + col_of(e);
        gs.daab[i * kMatRow + j] = j < i ? acc[e] : 0.f;
      }
    }
  }
  // The decay factors per channel: e^G (inclusive; warps 0, 1, warp 0 after Y and dA_ab) and
  // e^Omega (the rows after; warps 2, 3, then zeta), every exponent an added-up sum; e^E
  // (exclusive) is the row before's e^G (1 at row 0) and e^-G = e^Omega / gamma (factor_keys'
  // factor), formed where read.
  static_assert(NTF == 2 * K, "a thread a channel and direction");
  if (tid < K) {
    const int d = tid;
    float ge = 0.f;
    for (int i = 0; i < C; ++i) {
      ge += gs.in<T>(GradSmem::kW, i, d);
      gs.fac[GradSmem::kEG * C * kRow + i * kRow + d] = expf(ge);
    }
  } else {
    const int d = tid - K;
    float oe = 0.f;
    for (int i = C - 1; i >= 0; --i) {
      gs.fac[GradSmem::kEO * C * kRow + i * kRow + d] = expf(oe);
      oe += gs.in<T>(GradSmem::kW, i, d);
    }
    // zeta = rowsum(S+ * dS+) = gamma rowsum(S * dS+) + sum_j (K^ dK^ + B^ dB^) (dK^, dB^ before
    // the K-vector gradients take their place below)
    float z = at.blk[B::gam + d] * gs.zeta_s[d];
    for (int j = 0; j < C; ++j)
      z += at.blk[B::khat + j * LB + d] * gs.big[GradSmem::kDK * C * kRow + j * kRow + d] +
           at.blk[B::bhat + j * LB + d] * gs.big[GradSmem::kDB * C * kRow + j * kRow + d];
    gs.zeta_s[d] = z;
  }
  __syncthreads();
  // The K-vector gradients (docs/algorithms.md §6.4), in the factored forms where the chunk is
  // bounded (the pair factors e^(G_i - G_j) = e^G_i e^-G_j through K~ = k e^-G, B~ = b e^-G):
  // dr, da, dk, db over dR^, dÂ, dK^, dB^ in place (each thread reads only its own elements).
  const float* const kt = at.wrow;  // K~ [C][LA]
  const float* const bt = at.btil;  // B~ [C][LA]
  const float* const fac = gs.fac;
  float* const dR = gs.big + GradSmem::kDR * C * kRow;
  float* const dK = gs.big + GradSmem::kDK * C * kRow;
  float* const dB = gs.big + GradSmem::kDB * C * kRow;
  auto in = [&](int m, int i, int d) { return gs.in<T>(m, i, d); };
  const float* const eg = fac + GradSmem::kEG * C * kRow;  // e^G_i at x = i kRow + d
  const float* const eo = fac + GradSmem::kEO * C * kRow;  // e^Omega_i
  auto e_e = [&](int x) { return x >= kRow ? eg[x - kRow] : 1.f; };  // e^E_i
  if (bounded) {
    // dr = e^G (dR^ + dA_rk K~ + dA_rb B~), da = e^E (dÂ + dA_ak K~ + dA_ab B~), dk = dK^ e^Omega +
    // e^-G (dA_rk^T R^ + dA_ak^T Â), db = dB^ e^Omega + e^-G (dA_rb^T R^ + dA_ab^T Â): each warp
    // its 16 channels, a column tile at a time, the products on TF32 tensor cores.
    const float* const rh = at.blk + B::rhat;
    const float* const ah = at.blk + B::ahat;
#pragma unroll 1
    for (int nt = 0; nt < 2; ++nt) {
      const int dn = d0 + 8 * nt;
      float r[4] = {}, a[4] = {}, k[4] = {}, b[4] = {};
      tile::warp_mma_ld<false, false, false, false, X3>(r, C, dArk, kMatRow, kt + dn, LA);
      tile::warp_mma_ld<false, false, false, false, X3>(r, C, dArb, kMatRow, bt + dn, LA);
      tile::warp_mma_ld<false, false, false, false, X3>(a, C, dAak, kMatRow, kt + dn, LA);
      tile::warp_mma_ld<false, false, false, false, X3>(a, C, gs.daab, kMatRow, bt + dn, LA);
      tile::warp_mma_ld<true, false, false, false, X3>(k, C, dArk, kMatRow, rh + dn, LA);
      tile::warp_mma_ld<true, false, false, false, X3>(k, C, dAak, kMatRow, ah + dn, LA);
      tile::warp_mma_ld<true, false, false, false, X3>(b, C, dArb, kMatRow, rh + dn, LA);
      tile::warp_mma_ld<true, false, false, false, X3>(b, C, gs.daab, kMatRow, ah + dn, LA);
      // 8-byte accesses, elements 2 h2 and 2 h2 + 1 (row g + 8 h2, channels dn + 2q, + 1)
      auto ld2 = [](const float* x) { return *reinterpret_cast<const float2*>(x); };
      auto pick = [](const float2& f, int c) { return c ? f.y : f.x; };
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int x = (g + 8 * h2) * kRow + dn + 2 * q;
        const float2 fo = ld2(eo + x), fg = ld2(eg + x), gi = ld2(at.blk + B::ginv + dn + 2 * q);
        const float2 fe = x >= kRow ? ld2(eg + x - kRow) : make_float2(1.f, 1.f);
        const float2 vr = ld2(dR + x), va = ld2(gs.dahat + x), vk = ld2(dK + x), vb = ld2(dB + x);
        float out[4][2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int e = 2 * h2 + c;
          const float o = pick(fo, c), egi = o * pick(gi, c);  // e^Omega, e^-G
          out[0][c] = pick(fg, c) * (pick(vr, c) + r[e]);
          out[1][c] = pick(fe, c) * (pick(va, c) + a[e]);
          out[2][c] = pick(vk, c) * o + egi * k[e];
          out[3][c] = pick(vb, c) * o + egi * b[e];
        }
        float* const dst[4] = {dR + x, gs.dahat + x, dK + x, dB + x};
#pragma unroll
        for (int m = 0; m < 4; ++m) *reinterpret_cast<float2*>(dst[m]) = make_float2(out[m][0], out[m][1]);
      }
    }
  } else {
    for (int e = tid; e < C * K; e += NTF) {
      const int i = e / K, d = e % K, x = i * kRow + d;
      float r = 0.f, a = 0.f, k = 0.f, b = 0.f;
      // Past the bound: each pair's factor from its own segment sum of w (never positive; any w
      // in [-inf, 0]), walked from the row outwards. e^(G_i - G_j) for j <= i and e^(E_i - G_j)
      // = e^(G_(i-1) - G_j) for j < i (query-type rows), and the same pairs from the key side.
      float seg = 0.f;  // G_i - G_j, then for j < i: E_i - G_j is the step before's
      for (int j = i; j >= 0; --j) {
        const float f = expf(seg);
        r += f * (dArk[i * kMatRow + j] * in(GradSmem::kK, j, d) + dArb[i * kMatRow + j] * in(GradSmem::kB, j, d));
        seg += in(GradSmem::kW, j, d);
      }
      seg = 0.f;  // E_i - G_j = sum of w over rows j + 1 .. i - 1
      for (int j = i - 1; j >= 0; --j) {
        const float f = expf(seg);
        a += f * (dAak[i * kMatRow + j] * in(GradSmem::kK, j, d) + gs.daab[i * kMatRow + j] * in(GradSmem::kB, j, d));
        seg += in(GradSmem::kW, j, d);
      }
      seg = 0.f;  // G_i' - G_i for i' >= i (and E_i' - G_i = G_(i'-1) - G_i: the step before's)
      float prev = 0.f;
      for (int i2 = i; i2 < C; ++i2) {
        if (i2 > i) seg += in(GradSmem::kW, i2, d);
        const float f = expf(seg);
        k += f * dArk[i2 * kMatRow + i] * in(GradSmem::kR, i2, d);
        b += f * dArb[i2 * kMatRow + i] * in(GradSmem::kR, i2, d);
        if (i2 > i) {
          k += prev * dAak[i2 * kMatRow + i] * in(GradSmem::kA, i2, d);
          b += prev * gs.daab[i2 * kMatRow + i] * in(GradSmem::kA, i2, d);
        }
        prev = f;
      }
      r += eg[x] * dR[x], a += e_e(x) * gs.dahat[x];
      k += dK[x] * eo[x], b += dB[x] * eo[x];
      dR[x] = r, gs.dahat[x] = a, dK[x] = k, dB[x] = b;
    }
  }
  __syncthreads();
  // dw by the reverse scan (dplr_dw_scan.cuh; exactly 0 where exp(w) == 0) on all four warps:
  // warp w the rows 4w .. 4w + 3 of channels lane and lane + 32 (a warp's loads on 32 channels:
  // conflict-free), each group's map through fac's space (read above, free now), then its rows
  // from zeta carried through the later groups' maps; then all five to their outputs (rows of the
  // sequence only).
  const int64_t t0 = ci * C;
  float* const dw = gs.big + GradSmem::kDW * C * kRow;  // (over dW, which dX and dÂ have read)
  {
    const int w = tid / 32, lane = tid % 32;
    float* const map_c = gs.fac, *const map_keep = gs.fac + 4 * K;  // [4][K] each
    float x[2][4], y[2][4];
    bool z[2][4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int d = lane + 32 * half;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = 4 * w + r, e = i * kRow + d;
        x[half][r] = in(GradSmem::kR, i, d) * dR[e] - in(GradSmem::kK, i, d) * dK[e] - in(GradSmem::kB, i, d) * dB[e];
        y[half][r] = in(GradSmem::kA, i, d) * gs.dahat[e];
        z[half][r] = expf(in(GradSmem::kW, i, d)) == 0.f;
      }
      float c;
      bool keep;
      dw_group_map(x[half], y[half], z[half], c, keep);
      map_c[w * K + d] = c, map_keep[w * K + d] = keep ? 1.f : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int d = lane + 32 * half;
      float acc = gs.zeta_s[d], out[4];
      for (int q = 3; q > w; --q) acc = dw_through(acc, map_c[q * K + d], map_keep[q * K + d] != 0.f);
      dw_group_scan(acc, x[half], y[half], z[half], out);
#pragma unroll
      for (int r = 0; r < 4; ++r) dw[(4 * w + r) * kRow + lane + 32 * half] = out[r];
    }
  }
  __syncthreads();
  const float* const src[kNumKGrads] = {dR, dw, dK, gs.dahat, dB};
  static_assert(kGradR == 0 && kGradW == 1 && kGradK == 2 && kGradA == 3 && kGradB == 4, "kGrad order");
  const int nrow = s.len - t0 < C ? int(s.len - t0) : C;
  if (p.paths.grads_16byte) {
    store_kvector_quads<T, NTF>(p, s.b, s.bos, t0, h, K, nrow, src, kRow);
  } else {
    constexpr int kRowStep = NTF / K;  // (a thread's channel d, its rows i0, i0 + kRowStep, ...)
    const int d = tid % K, i0 = tid / K;
#pragma unroll 1
    for (int gi = 0; gi < kNumKGrads; ++gi) {
      T* out = vptr<T>(p.kgd[gi], s.b, s.bos + t0 + i0, h, d);
      const int64_t step = kRowStep * p.kgd[gi].st;
#pragma unroll
      for (int i = i0; i < C; i += kRowStep, out += step)
        if (i < nrow) *out = from_f<T>(src[gi][i * kRow + d]);
    }
  }
  __syncthreads();
}

}  // namespace dplr_fused_detail
}  // namespace fla
