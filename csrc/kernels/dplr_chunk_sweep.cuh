// The sequential passes of the chunked RWKV7 engine (dplr_chunk.cuh): the forward sweep (o, the
// chunk-start states) and its transpose, the reverse sweep (dS+ at every chunk end).
#pragma once
#include "dplr_chunk.cuh"

namespace fla {
namespace dplr_chunk_detail {

constexpr int SX = kDplrSweepCols, NTS = 256;  // state columns and threads per CTA
// Row stride of the column arrays (state, U, v rows, U0, O0): 8 mod 32, so that the TF32 B
// fragments (lanes (g, q) read row k + q, column n0 + g) fall on 32 different banks.
constexpr int SXP = DplrWs::UP;
static_assert(NTS == C * SX / 2, "phase A: one thread per row and column pair");
FLA_HD int state_tiles(int V) { return (V + SX - 1) / SX; }
// Shared memory (floats): S [K][SXP], U, Vt [C][SXP], then two stages of a chunk's workspace
// block as DplrWs lays it out: W, Q~, K^, B^ [C][KS], gamma [KP4], then this tile's U0, O0
// [C][SXP]; then the stages' mbarriers (bulk copies).
struct StateSmem {
  int KS, S, U, Vt, buf, sW, sQ, sKh, sBh, sGam, sU0, sO0, stage, bars, total;
  FLA_HD StateSmem(const DplrWs& ws, int K) : KS(ws.KS) {
    S = 0, U = K * SXP, Vt = U + C * SXP, buf = Vt + C * SXP;
    sW = 0, sQ = C * KS, sKh = 2 * C * KS, sBh = 3 * C * KS, sGam = 4 * C * KS;
    sU0 = sGam + ws.KP4, sO0 = sU0 + C * SXP, stage = sO0 + C * SXP;
    bars = (buf + 2 * stage + 1) / 2 * 2;  // 8-byte aligned
    total = bars + 4;
  }
  FLA_HD size_t bytes() const { return size_t(total) * sizeof(float); }
};

// The sequential passes: one CTA of NTS threads per (sequence, head, SX state columns), walking
// the chunks with the K x SX slice in shared memory and the next chunk's workspace block copied
// asynchronously while the current one is used. The backward pass is the forward's transpose:
//   forward  (REV = false)  T = W S, U = U0 + T, o = O0 + scale Q~ S;  S  = gamma S + K^^T V + B^^T U
//   backward (REV = true)   T = B^ D;                                  D  = gamma D + Q~^T (scale dO) + W^T T
// (D = dS+ at a chunk's end, ALGORITHMS.md §6.4: dS = gamma dS+ + scale R^^T dO + W^T dU with
// dU = scale A_rb^T dO + B^ dS+, and Q~ = R^ + A_rb W.) The forward stores the chunk-start
// states in hst (when asked) and the final one after them; the backward stores every D in dhst.
// Tried (NOTES c9, c13): 16 columns on 128 threads (SIMT: 15 % slower; TF32: equal at K = 64,
// 35 % slower at K = 128), three workspace stages instead of two (SIMT: 8 % slower;
// TF32: equal, NOTES c17).
// OUT: the forward computes o (false in the forward sweep of a backward call, which only makes
// hst: no O0 copies, no Q~ S).
// KC: as prep_kernel's.
template <typename T, bool REV, bool OUT = !REV, int KC = 0>  // two CTAs per SM: at most 128 registers
__global__ void __launch_bounds__(NTS, 512 / NTS) sweep_kernel(const DplrChunkPass p) {
  constexpr bool TC = !std::is_same<T, float>::value;
  extern __shared__ float4 sm4[];
  float* sm = reinterpret_cast<float*>(sm4);
  const int K = KC ? KC : p.K;
  const DplrWs ws(K, p.V);
  const StateSmem L(ws, K);
  const int KS = L.KS, tiles = state_tiles(p.V);
  const int tile = blockIdx.x % tiles, nh = blockIdx.x / tiles, h = nh % p.H, n = nh / p.H;
  const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
  const int x0 = tile * SX, nc = min(SX, p.V - x0);
  const int64_t nch = (s.len + C - 1) / C;
  float *S = sm + L.S, *U = sm + L.U, *Vt = sm + L.Vt;  // S: the state or D; U: U or T
  const float* wsb = static_cast<const float*>(p.ws);
  const float rho = float(p.scale);
  const int64_t slot0 = chunk_slot<C>(p.cu_seqlens, n, p.T, 0);
  auto slot_of = [&](int64_t ci) { return slot0 + ci; };
  auto chunk_of = [&](int64_t step) { return REV ? nch - 1 - step : step; };

  const bool want_o = OUT && p.o.on();
  // Step `step`'s workspace block is the first one plus s slots (REV: minus).
  const int64_t block_step = int64_t(p.H) * ws.per();
  const float* const block0 = nch > 0 ? wsb + (slot_of(chunk_of(0)) * p.H + h) * ws.per() : wsb;
  uint64_t* const bars = reinterpret_cast<uint64_t*>(sm + L.bars);
  // The K-part (the reverse sweep skips K^, which it does not read) and this tile's U0 (and, for
  // o, O0) block: both laid out in the workspace as here (DplrWs).
  const int64_t kcut = REV ? ws.Kh() : ws.kpart(), kskip = REV ? ws.Bh() : ws.kpart();
  const int64_t un = REV ? 0 : (want_o ? 2 : 1) * C * SXP, usrc = ws.utile(tile);
#if FLA_BULK_COPY
  // Two or three bulk copies issued by one thread, completing on the stage's mbarrier: the
  // cp.async form below cost every thread ~130 instructions a step, a third of the sweep's
  // (ncu); a bulk copy per row (97 a step) was slower still (the copy engine's cost per copy).
  const unsigned fetch_bytes = unsigned(4 * (kcut + ws.kpart() - kskip + un));
  auto fetch = [&](int64_t step) {
    if (threadIdx.x != 0) return;
    float* const dst = sm + L.buf + (step & 1) * L.stage;
    const float* const src = block0 + (REV ? -step : step) * block_step;
    uint64_t* const bar = bars + (step & 1);
    fence_proxy_async();  // this stage's reads in step - 1 (ordered by its closing barrier)
    mbar_expect_tx(bar, fetch_bytes);
    bulk_copy(dst, src, unsigned(4 * kcut), bar);
    if (kskip < ws.kpart()) bulk_copy(dst + kskip, src + kskip, unsigned(4 * (ws.kpart() - kskip)), bar);
    if (un) bulk_copy(dst + L.sU0, src + usrc, unsigned(4 * un), bar);
  };
  auto fetch_wait = [&](int64_t step) { mbar_wait(bars + (step & 1), unsigned(step >> 1) & 1u); };
#else
  // cp.async, 16 bytes a thread, the same blocks.
  auto fetch = [&](int64_t step) {
    float* const dst = sm + L.buf + (step & 1) * L.stage;
    const float* const src = block0 + (REV ? -step : step) * block_step;
    for (int64_t e = 4 * threadIdx.x; e < ws.kpart(); e += 4 * NTS)
      if (e < kcut || e >= kskip) copy16(dst + e, src + e, true);
    for (int e = 4 * threadIdx.x; e < un; e += 4 * NTS) copy16(dst + L.sU0 + e, src + usrc + e, true);
    copy_commit();
  };
  auto fetch_wait = [&](int64_t step) {
    if (step + 1 < nch) copy_wait<1>();
    else copy_wait<0>();
  };
  (void)bars;
#endif
  // Step `step`'s rows of v (forward) or dO (backward) at this tile's columns, two per thread (0
  // outside), kept in T until the next step stores them: converting right after the load made
  // every step wait for it (ncu: 18 % of the sweep's stall samples on that conversion).
  // Row pointers at the sequence's first chunk, a chunk's offset once per step.
  const VecArg& src_rows = REV ? p.dout : p.v;
  const int64_t chunk_stride = int64_t(C) * src_rows.st;
  const T* row_at[C * SX / NTS];
#pragma unroll
  for (int it = 0; it < C * SX / NTS; ++it) {
    const int e = threadIdx.x + it * NTS;
    row_at[it] = vptr<T>(src_rows, s.b, s.bos + e / SX, h, x0 + e % SX);
  }
  auto fetch_rows = [&](int64_t step, T* x) {
    const int64_t ci = chunk_of(step), off = ci * chunk_stride;
    const int64_t rem = step < nch ? s.len - ci * C : 0;  // rows of the chunk
#pragma unroll
    for (int it = 0; it < C * SX / NTS; ++it) {
      const int e = threadIdx.x + it * NTS, i = e / SX, c = e % SX;
      x[it] = i < rem && c < nc ? row_at[it][off] : from_f<T>(0.f);
    }
  };
  const bool quads = nc == SX && p.V % 4 == 0;  // whole tile, 16-byte aligned rows
  auto store_slot = [&](void* dst_base, int64_t slot, bool zero) {
    float* dst = static_cast<float*>(dst_base) + (slot * p.H + h) * int64_t(K) * p.V + x0;
    if (quads) {
      for (int e = threadIdx.x; e < K * SX / 4; e += NTS) {
        const int d = e / (SX / 4), x = 4 * (e % (SX / 4));
        *reinterpret_cast<float4*>(dst + int64_t(d) * p.V + x) =
            zero ? make_float4(0.f, 0.f, 0.f, 0.f) : *reinterpret_cast<const float4*>(S + d * SXP + x);
      }
      return;
    }
    for (int e = threadIdx.x; e < K * SX; e += NTS)
      if (e % SX < nc) dst[int64_t(e / SX) * p.V + e % SX] = zero ? 0.f : S[e / SX * SXP + e % SX];
  };
  auto store_state_at = [&](void* dst_base, int64_t ci) { store_slot(dst_base, slot_of(ci), false); };
  T* const o_at = OUT ? vptr<T>(p.o, s.b, s.bos, h, x0) : nullptr;  // row 0 of the sequence
  auto store_o = [&](int64_t ci, int i, int x, float v) {  // the SIMT path's
    const int64_t t = ci * C + i;
    if (t < s.len && x < nc) o_at[t * p.o.st + x * p.o.sd] = from_f<T>(v);
  };

  const MatArg& init = REV ? p.dht : p.h0;
  for (int e = threadIdx.x; e < K * SX; e += NTS) {
    const int d = e / SX, x = e % SX;
    S[d * SXP + x] = init.on() && x < nc ? *mptr(init, n, h, d, x0 + x) : 0.f;
  }
  if (FLA_BULK_COPY) {
    if (threadIdx.x == 0) mbar_init(bars, 1), mbar_init(bars + 1, 1);
    __syncthreads();
  }
  T vx[C * SX / NTS];
  if (nch > 0) fetch(0);
  fetch_rows(0, vx);
  const int i = threadIdx.x / (SX / 2), xp = 2 * (threadIdx.x % (SX / 2));  // phase A: row i, columns xp, xp + 1
  const int warp = threadIdx.x / 32;
  // Tensor-core o: this lane's accumulator elements (rows g, g + 8; columns oc, oc + 1 of its
  // warp's 8), addressed from the sequence's row 0 (a chunk's offset once per step).
  const int og = threadIdx.x % 32 / 4, oc = 8 * (warp % (SX / 8)) + 2 * (threadIdx.x % 4);
  T* const o_lane = want_o ? o_at + og * p.o.st + oc * p.o.sd : nullptr;
  const int64_t o_row8 = 8 * p.o.st;
  for (int64_t step = 0; step < nch; ++step) {
    const int64_t ci = chunk_of(step);
    const float* cur = sm + L.buf + (step & 1) * L.stage;
    if (step + 1 < nch) fetch(step + 1);
    fetch_wait(step);
#pragma unroll
    for (int it = 0; it < C * SX / NTS; ++it) {
      const int e = threadIdx.x + it * NTS;
      Vt[e / SX * SXP + e % SX] = REV ? tf32_if<TC>(rho * to_f(vx[it])) : to_f(vx[it]);  // mma operands
    }
    fetch_rows(step + 1, vx);
    __syncthreads();
    if (REV) store_state_at(p.dhst, ci);
    else if (p.hst) store_state_at(p.hst, ci);
    if (TC) {
      // Phase A, one m16n8 tile per warp: columns 8 (warp % NN), product T (the first NN warps)
      // or Q~ S (the next NN, forward with o).
      constexpr int NN = SX / 8;
      static_assert(2 * NN <= NTS / 32, "a warp per phase-A tile");
      if (warp < (OUT ? 2 : 1) * NN) {
        const int n0 = 8 * (warp % NN);
        const float* A = cur + (REV ? L.sBh : warp < NN ? L.sW : L.sQ);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (K % 8 == 0)  // the workspace rows hold TF32 values (prep's store_kwide_rows)
          warp_mma_ld<false, false, true>(acc, K, A, KS, S + n0, SXP);
        else
          warp_mma(acc, K, [&](int r, int k) { return k < K ? A[r * KS + k] : 0.f; },
                   [&](int k, int c) { return k < K ? S[k * SXP + n0 + c] : 0.f; });
        if (REV || warp < NN) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = acc_row(0, e), x = acc_col(n0, e);
            // U is read only as an mma operand: rounded once here, not per read
            U[r * SXP + x] = tf32_round(REV ? acc[e] : cur[L.sU0 + r * SXP + x] + acc[e]);
          }
        } else if (want_o) {
          T* const ob = o_lane + ci * C * p.o.st;
          const int64_t rem = s.len - ci * C;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = acc_row(0, e), x = acc_col(n0, e);
            if (r < rem && x < nc) ob[(e / 2) * o_row8 + (e % 2) * p.o.sd] = from_f<T>(cur[L.sO0 + r * SXP + x] + rho * acc[e]);
          }
        }
      }
    } else if (REV) {  // T = B^ D
      const float* br = cur + L.sBh + i * KS;
      float t0 = 0.f, t1 = 0.f;
#pragma unroll 4
      for (int d = 0; d < K; ++d) {
        const float2 sv = *reinterpret_cast<const float2*>(S + d * SXP + xp);
        t0 += br[d] * sv.x, t1 += br[d] * sv.y;
      }
      U[i * SXP + xp] = t0, U[i * SXP + xp + 1] = t1;
    } else {  // U = U0 + W S, o = O0 + scale Q~ S
      const float *wr = cur + L.sW + i * KS, *qr = cur + L.sQ + i * KS;
      float t0 = 0.f, t1 = 0.f, q0 = 0.f, q1 = 0.f;
#pragma unroll 4
      for (int d = 0; d < K; ++d) {
        const float2 sv = *reinterpret_cast<const float2*>(S + d * SXP + xp);
        const float w = wr[d];
        t0 += w * sv.x, t1 += w * sv.y;
        if (OUT) {
          const float q = qr[d];
          q0 += q * sv.x, q1 += q * sv.y;
        }
      }
      const float* u0 = cur + L.sU0 + i * SXP + xp;
      const float* o0 = u0 + C * SXP;
      U[i * SXP + xp] = u0[0] + t0, U[i * SXP + xp + 1] = u0[1] + t1;
      if (want_o) store_o(ci, i, xp, o0[0] + rho * q0), store_o(ci, i, xp + 1, o0[1] + rho * q1);
    }
    __syncthreads();
    // S = gamma S + X1^T Vt + X2^T U with (X1, X2) = (K^, B^) forward, (Q~, W) backward.
    const float* x1 = cur + (REV ? L.sQ : L.sKh);
    const float* x2 = cur + (REV ? L.sW : L.sBh);
    const float* gam = cur + L.sGam;
    if (TC) {  // m16n8 tiles (16 state rows, 8 columns), warp-strided; each element has one owner
      for (int tl = warp; tl < (K + 15) / 16 * (SX / 8); tl += NTS / 32) {
        const int m0 = 16 * (tl / (SX / 8)), n0 = 8 * (tl % (SX / 8));
        float acc[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int d = acc_row(m0, e);
          acc[e] = d < K ? gam[d] * S[d * SXP + acc_col(n0, e)] : 0.f;
        }
        if (m0 + 16 <= K) {  // A(r, j) = X[j][m0 + r]: the workspace rows, transposed
          warp_mma_ld<true, false, true, true>(acc, C, x1 + m0, KS, Vt + n0, SXP);
          warp_mma_ld<true, false, true, true>(acc, C, x2 + m0, KS, U + n0, SXP);
        } else {
          warp_mma(acc, C, [&](int r, int j) { return m0 + r < K ? x1[j * KS + m0 + r] : 0.f; },
                   [&](int j, int c) { return Vt[j * SXP + n0 + c]; });
          warp_mma(acc, C, [&](int r, int j) { return m0 + r < K ? x2[j * KS + m0 + r] : 0.f; },
                   [&](int j, int c) { return U[j * SXP + n0 + c]; });
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int d = acc_row(m0, e);
          if (d < K) S[d * SXP + acc_col(n0, e)] = acc[e];
        }
      }
    } else {  // thread: rows 4 dg .. 4 dg + 3, columns xp, xp + 1
      for (int dg = threadIdx.x / (SX / 2); 4 * dg < K; dg += NTS / (SX / 2)) {
        const int d0 = 4 * dg;
        float acc[4][2];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float g = gam[d0 + r];
          const bool in = d0 + r < K;
          acc[r][0] = in ? g * S[(d0 + r) * SXP + xp] : 0.f;
          acc[r][1] = in ? g * S[(d0 + r) * SXP + xp + 1] : 0.f;
        }
#pragma unroll 4
        for (int j = 0; j < C; ++j) {
          const float4 a4 = *reinterpret_cast<const float4*>(x1 + j * KS + d0);
          const float4 b4 = *reinterpret_cast<const float4*>(x2 + j * KS + d0);
          const float2 v = *reinterpret_cast<const float2*>(Vt + j * SXP + xp);
          const float2 u = *reinterpret_cast<const float2*>(U + j * SXP + xp);
          const float ar[4] = {a4.x, a4.y, a4.z, a4.w}, br[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            acc[r][0] += ar[r] * v.x + br[r] * u.x;
            acc[r][1] += ar[r] * v.y + br[r] * u.y;
          }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r)
          if (d0 + r < K) S[(d0 + r) * SXP + xp] = acc[r][0], S[(d0 + r) * SXP + xp + 1] = acc[r][1];
      }
    }
    __syncthreads();
  }
  const MatArg& fin = REV ? p.dh0 : p.hT;
  if (!REV && p.hst) {
    store_state_at(p.hst, nch);
    if (p.cu_seqlens) {  // hst may be kept as an op output: its varlen gap slots read 0
      const int64_t next =
          n + 1 < p.N ? chunk_slot<C>(p.cu_seqlens, n + 1, p.T, 0) : chunk_slots<C>(p.N, p.T, true);
      for (int64_t slot = slot_of(nch) + 1; slot < next; ++slot) store_slot(p.hst, slot, true);
    }
  }
  if (fin.on())
    for (int e = threadIdx.x; e < K * SX; e += NTS)
      if (e % SX < nc) *mptr(fin, n, h, e / SX, x0 + e % SX) = S[e / SX * SXP + e % SX];
}

}  // namespace dplr_chunk_detail
}  // namespace fla
