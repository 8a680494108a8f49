// The sequential passes of the chunked RWKV7 engine (dplr_chunk_launch.cuh): the forward sweep
// (o, the chunk-start states) and its transpose, the reverse sweep (dS+ at every chunk end).
#pragma once
#include "async_copy.cuh"
#include "dplr_chunk_layout.cuh"

namespace fla {
namespace dplr_chunk_detail {

constexpr int SX = kDplrSweepCols, NTS = 256;  // state columns and threads per CTA
constexpr int SXP = DplrWorkspaceLayout::UP;  // row stride of the staged U0 / O0
static_assert(NTS == 256, "phase A: warps 0-3 make T, 4-7 o; phase B: two warps per channel tile");
FLA_HD int state_tiles(int V) { return (V + SX - 1) / SX; }
// The column arrays hold the state and the chunk's rows transposed, columns x and x + 8 of each
// 16-column half interleaved (pair p = 8 (x / 16) + x % 8, x % 16 / 8 the element of the pair):
// then a lane's A fragment of an m16n8k8 product, (A(g, k), A(g + 8, k), A(g, k + 1), A(g + 8,
// k + 1)) with k permuted (lane q's four k of a 16-wide step are 4q .. 4q + 3, read the same for
// A and B), is one 16-byte shared load straight into the mma's registers:
//   ST  [16][R]  S^T (the state, or D), [K8][2] per pair (K8: K rounded up to 8). R = 2 K8
//                rounded up to 32, and in odd pairs the 16-byte pieces (channel pairs) XOR 5, so
//                that both 16-byte reads are conflict-free: phase A's (pieces 2q, 2q + 1 of pairs
//                p, p + 1: XOR 1 would do) and phase B's (pieces q + 0..3: XOR 4 would do); at
//                R = 2 K8 + 4 phase B's are two-way conflicts, and the sweep is bound by
//                shared-memory throughput.
//   UT, VT [16][32]  U^T (or T^T) and v^T (or (scale dO)^T), [16][2] per pair, 16-byte pieces
//                swizzled by the pair: cidx()
// (a [K][SX] layout reads four 4-byte words per lane and k-step, so shared loads would dominate
// the sweep's instructions; [SX][K] with 16-byte loads needs 4 register moves per mma).
FLA_HD int pair_of(int x) { return (x >> 4) * 8 + (x & 7); }
FLA_HD int sidx(int R, int x, int d) {
  const int p = pair_of(x), piece = (d >> 1) ^ (5 * (p & 1));
  return p * R + (piece << 2) + 2 * (d & 1) + ((x >> 3) & 1);
}
FLA_HD int cidx(int x, int j) {
  const int p = pair_of(x), f = 2 * j + ((x >> 3) & 1);
  return p * 2 * C + ((((f >> 2) ^ (p & 1) ^ (((p >> 1) & 3) << 1)) << 2) | (f & 3));
}
// Shared memory (floats): ST, UT, VT, then two stages of a chunk's workspace block as
// DplrWorkspaceLayout lays it out (K-part, then this tile's U0, O0 [C][SXP]), then the stages'
// mbarriers (bulk copies).
struct StateSmem {
  int R, S, U, Vt, buf, sW, sQ, sKh, sBh, sGam, sU0, sO0, stage, bars, total;
  FLA_HD StateSmem(const DplrWorkspaceLayout& ws, int K) : R((2 * ((K + 7) / 8 * 8) + 31) / 32 * 32) {
    S = 0, U = SX / 2 * R, Vt = U + SX * C, buf = Vt + SX * C;
    sW = int(ws.w_at()), sQ = int(ws.q_at()), sKh = int(ws.khat_at()), sBh = int(ws.bhat_at()), sGam = int(ws.gamma_at());
    sU0 = int(ws.kpart_floats()), sO0 = sU0 + C * SXP, stage = sO0 + C * SXP;
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
// (D = dS+ at a chunk's end, docs/algorithms.md §6.4: dS = gamma dS+ + scale R^^T dO + W^T dU with
// dU = scale A_rb^T dO + B^ dS+, and Q~ = R^ + A_rb W.) Computed transposed: phase A T^T = S^T
// X_A^T (X_A = W, Q~ or B^: rows [i][d]), phase B S^T = gamma S^T + V^T X1 + U^T X2 (X1, X2 =
// K^, B^ or Q~, W: rows [j][d]). The forward stores the chunk-start states in hst (when asked)
// and the final one after them; the backward stores every D in dhst; both from phase B's
// registers.
// Every product runs on tensor cores: single TF32 for bf16 / fp16 inputs (prep stores the K-part
// as TF32 values; the state's operands are truncated by the mma), 3xTF32 for fp32 ones (X3:
// fp32-accurate, mma_tf32x3; U^T and v^T then stay fp32 too), which for fp32 is the faster
// form than SIMT FMA (benchmarks/NOTES.md c40).
// Why 32 columns on 256 threads and two workspace stages: 16 columns on 128 threads is slower
// (SIMT, and TF32 at K = 128: the K-part of the workspace is fetched whole per CTA for half the
// work), and a third stage is no faster (two already hide the fetch).
// OUT: the forward computes o (false in the forward sweep of a backward call, which only makes
// hst: no O0 copies, no Q~ S).
// KC: as prep_kernel's.
// STRIDED: a forward storing the strided states (DplrChunkPass::sweep_strided_states; a build of
// its own: as a runtime choice the stores' slot arithmetic kept more registers live).
template <typename T, bool REV, bool OUT = !REV, int KC = 0, bool STRIDED = false>  // two CTAs per SM: at most 128 registers
__global__ void __launch_bounds__(NTS, 512 / NTS) sweep_kernel(const DplrChunkPass p) {
  static_assert(!STRIDED || !REV, "strided states: the forward's");
  if (!REV && p.sweep_strided_states != STRIDED) return;  // (the launch's pick: hst's size is its)
  constexpr bool X3 = std::is_same<T, float>::value;
  extern __shared__ float4 sm4[];
  float* sm = reinterpret_cast<float*>(sm4);
  const int K = KC ? KC : p.K;
  const DplrWorkspaceLayout ws(K, p.V);
  const StateSmem L(ws, K);
  const int R = L.R, K8 = (K + 7) / 8 * 8, tiles = state_tiles(p.V);
  const int tile = blockIdx.x % tiles, nh = blockIdx.x / tiles, h = nh % p.H, n = nh / p.H;
  const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
  const int x0 = tile * SX, nc = min(SX, p.V - x0);
  const int64_t nch = (s.len + C - 1) / C;
  // The chunks walked, [c_lo, c_hi): all, or the window's (DplrChunkPass::window_chunks; a
  // sequence with none of its chunks there has nothing to do, unless it has no chunk at all and
  // this is the first window, which passes its dht on to dh0).
  const bool windowed = p.window_chunks > 0;
  const int64_t c_lo = windowed ? p.window_begin : 0;
  const int64_t c_end = p.window_begin + p.window_chunks, c_hi = windowed && c_end < nch ? c_end : nch;
  if (windowed && c_lo >= nch && !(nch == 0 && c_lo == 0)) return;
  const int64_t steps = c_hi > c_lo ? c_hi - c_lo : 0;
  float *ST = sm + L.S, *UT = sm + L.U, *VT = sm + L.Vt;  // the state or D; U or T; v or dO
  const float* wsb = static_cast<const float*>(p.ws);
  const float rho = float(p.scale);
  // Slots of the states (hst: chunk_slot; dhst: dplr_work_slot) and of ws (dplr_ws_slot); a
  // sequence's chunks take consecutive slots in both.
  const int64_t slot0 = REV && windowed ? dplr_work_slot(p, n, 0) : chunk_slot<C>(p.cu_seqlens, n, p.T, 0);
  const int64_t ws_slot0 = windowed ? dplr_ws_slot(p, n, 0) : slot0;
  auto slot_of = [&](int64_t ci) { return slot0 + ci; };
  auto chunk_of = [&](int64_t step) { return REV ? c_hi - 1 - step : c_lo + step; };

  const bool want_o = OUT && p.o.on();
  // Step `step`'s workspace blocks are the first ones plus s slots (REV: minus).
  const int64_t block_step = int64_t(p.H) * ws.floats_per_chunk(), ublock_step = int64_t(p.H) * ws.uo_floats_per_chunk();
  const int64_t slot_first = steps > 0 ? (ws_slot0 + chunk_of(0)) * p.H + h : 0;
  const float* const block0 = wsb + slot_first * ws.floats_per_chunk();
  // U0 / O0: at ws's slots, or a forward window's own (prep_kernel; its sequences' chunks in turn)
  const int64_t uslot_first = windowed ? (int64_t(n) * p.window_chunks) * p.H + h : slot_first;
  const float* const ublock0 =
      REV ? nullptr : static_cast<const float*>(p.uo) + uslot_first * ws.uo_floats_per_chunk() + ws.uo_tile_at(tile);
  uint64_t* const bars = reinterpret_cast<uint64_t*>(sm + L.bars);
  // The K-part (the reverse sweep skips K^, which it does not read) and this tile's U0 (and, for
  // o, O0) block: both laid out in the workspace as here (DplrWorkspaceLayout).
  const int64_t kcut = REV ? ws.khat_at() : ws.kpart_floats(), kskip = REV ? ws.bhat_at() : ws.kpart_floats();
  const int64_t un = REV ? 0 : (want_o ? 2 : 1) * C * SXP;
#if FLA_BULK_COPY
  // Two or three bulk copies issued by one thread, completing on the stage's mbarrier: the
  // cp.async form below costs every thread ~130 instructions a step; a bulk copy per row (97 a
  // step) pays the copy engine's cost per copy 97 times.
  const unsigned fetch_bytes = unsigned(4 * (kcut + ws.kpart_floats() - kskip + un));
  auto fetch = [&](int64_t step) {
    if (threadIdx.x != 0) return;
    float* const dst = sm + L.buf + (step & 1) * L.stage;
    const float* const src = block0 + (REV ? -step : step) * block_step;
    uint64_t* const bar = bars + (step & 1);
    fence_proxy_async();  // this stage's reads in step - 1 (ordered by its closing barrier)
    mbar_expect_tx(bar, fetch_bytes);
    bulk_copy(dst, src, unsigned(4 * kcut), bar);
    if (kskip < ws.kpart_floats()) bulk_copy(dst + kskip, src + kskip, unsigned(4 * (ws.kpart_floats() - kskip)), bar);
    if (un) bulk_copy(dst + L.sU0, ublock0 + step * ublock_step, unsigned(4 * un), bar);
  };
  auto fetch_wait = [&](int64_t step) { mbar_wait(bars + (step & 1), unsigned(step >> 1) & 1u); };
#else
  // cp.async, 16 bytes a thread, the same blocks.
  auto fetch = [&](int64_t step) {
    float* const dst = sm + L.buf + (step & 1) * L.stage;
    const float* const src = block0 + (REV ? -step : step) * block_step;
    for (int64_t e = 4 * threadIdx.x; e < ws.kpart_floats(); e += 4 * NTS)
      if (e < kcut || e >= kskip) copy16(dst + e, src + e, true);
    const float* const usrc = un ? ublock0 + step * ublock_step : nullptr;
    for (int e = 4 * threadIdx.x; e < un; e += 4 * NTS) copy16(dst + L.sU0 + e, usrc + e, true);
    copy_commit();
  };
  auto fetch_wait = [&](int64_t step) {
    if (step + 1 < steps) copy_wait<1>();
    else copy_wait<0>();
  };
  (void)bars;
#endif
  // Step `step`'s rows of v (forward) or dO (backward) at this tile's columns, two per thread (0
  // outside), kept in T until the next step stores them: converting right after the load would
  // make every step wait for it.
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
    const int64_t rem = step < steps ? s.len - ci * C : 0;  // rows of the chunk
#pragma unroll
    for (int it = 0; it < C * SX / NTS; ++it) {
      const int e = threadIdx.x + it * NTS, i = e / SX, c = e % SX;
      x[it] = i < rem && c < nc ? row_at[it][off] : from_f<T>(0.f);
    }
  };
  // The state's elements (d, x) a thread made go to hst / dhst slot `slot` (at this tile).
  float* const st_out = static_cast<float*>(REV ? p.dhst : p.hst);
  auto state_at = [&](int64_t slot, int d, int x) { return st_out + (slot * p.H + h) * int64_t(K) * p.V + int64_t(d) * p.V + x0 + x; };
  T* const o_at = OUT ? vptr<T>(p.o, s.b, s.bos, h, x0) : nullptr;  // row 0 of the sequence

  const MatArg& init = REV ? (c_hi < nch ? p.carry : p.dht) : (c_lo > 0 ? p.carry : p.h0);
  // The forward's states: every chunk's at slot_of, or on strided states (sweep_strided_states)
  // every kDplrStateStride-th and the final one at their slots (dplr_kept_state_slot: the state
  // after chunk ci goes to kslot0 + ceil((ci + 1) / S)).
  constexpr int S = kDplrStateStride;
  const int64_t kslot0 = STRIDED ? dplr_kept_state_slot(p.cu_seqlens, n, p.T, 0) : 0;
  // the initial state's slot (a later forward window's: the window before stored it)
  const bool first_out = REV ? steps > 0 : p.hst && c_lo == 0;
  for (int e = threadIdx.x; e < K8 * SX; e += NTS) {  // channels [K, K8): 0
    const int d = e / SX, x = e % SX;
    const float v = d < K && init.on() && x < nc ? *mptr(init, n, h, d, x0 + x) : 0.f;
    ST[sidx(R, x, d)] = v;
    if (first_out && d < K && x < nc) *state_at(STRIDED ? kslot0 : slot_of(REV ? c_hi - 1 : 0), d, x) = v;
  }
  if (FLA_BULK_COPY && threadIdx.x == 0) mbar_init(bars, 1), mbar_init(bars + 1, 1);
  __syncthreads();
  T vx[C * SX / NTS];
  if (steps > 0) fetch(0);
  fetch_rows(0, vx);
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
  const int64_t o_row = p.o.st;
  // Lane operands as 16-byte pieces (K a multiple of 16), else element by element.
  const bool wide = K % 16 == 0;
  // Phase A: a warp per m16n8 tile, rows m0 = 16 (warp % 2) of the state's columns, 8 of the
  // chunk's rows i0 = 8 (warp / 2 % 2) of K-part array xrow (warps 0..3 T, 4..7 o).
  const int m0 = 16 * (warp % 2), i0 = 8 * (warp / 2 % 2), xrow = REV ? 3 * C : warp < 4 ? 0 : C;  // B^, W or Q~
  // Lane offsets formed once (the swizzle repeats every 32 channels): phase A's B piece of row
  // arow (kb = 0 or 16 mod 32), phase B's B rows x1 / x2 + 4q + r at channel 8 (warp / 2) + g.
  const int x1 = REV ? C : 2 * C, x2 = REV ? 0 : 3 * C;  // K-part rows (K^, B^ or Q~, W)
  const int arow = xrow + i0 + g, aoff0 = ws.krow_at(arow, 4 * q), aoff1 = ws.krow_at(arow, 16 + 4 * q);
  int boff1[4], boff2[4];
#pragma unroll
  for (int r = 0; r < 4; ++r)
    boff1[r] = ws.krow_at(x1 + 4 * q + r, 8 * (warp / 2) + g), boff2[r] = ws.krow_at(x2 + 4 * q + r, 8 * (warp / 2) + g);
  // Phase A's o elements (rows i0 + 2q + {0, 1}, columns 16 (warp % 2) + g + {0, 8}) and phase
  // B's state elements (channels 8 (warp / 2) + 2q + {0, 1}, the same columns) from row 0 of the
  // sequence / slot 0 and channel 0 of the head: a step adds its chunk's offset (64-bit index
  // arithmetic per element would cost more instructions than the stores).
  const int lx = m0 + g;
  const bool lx0 = lx < nc, lx1 = lx + 8 < nc;
  T* const o_lane = want_o ? o_at + int64_t(8 * (warp / 2 % 2) + 2 * q) * p.o.st + int64_t(lx) * p.o.sd : nullptr;
  const int64_t slot_size = int64_t(p.H) * K * p.V;
  float* const st_lane = st_out ? state_at(0, 8 * (warp / 2) + 2 * q, lx) : nullptr;
  // This thread's v^T elements (fetch_rows' e, as cidx places them), formed once.
  int vt_at[C * SX / NTS];
#pragma unroll
  for (int it = 0; it < C * SX / NTS; ++it) {
    const int e = threadIdx.x + it * NTS;
    vt_at[it] = cidx(e % SX, e / SX);
  }
  // Phase B's lane offsets: channel tile n of warp w is d0 = 8 (w / 2) + 32 n (w / 2 < 4, so the
  // first tile is under 32 and the trip count is K / 32 for every warp where K is a multiple of
  // 32: a compile-time count at a compile-time K, so the loop unrolls; with a warp-dependent
  // start it did not, and each pass recomputed these offsets). From tile to tile the
  // state's index moves by 64 floats (sidx: channel d + 32 is piece + 16 whatever the pair's
  // XOR, which touches the low 3 bits only), gamma's and the B rows' by 32, the store's by 32 rows.
  constexpr int kTileStep = 8 * (NTS / 64);
  static_assert(kTileStep == 32, "sidx's 64-float step below is for channel steps of 32");
  const int dwarp = 8 * (warp / 2);  // tile 0's first channel
  const int st_lane_at = sidx(R, m0 + g, dwarp + 2 * q);
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t ci = chunk_of(step);
    const float* cur = sm + L.buf + (step & 1) * L.stage;
    if (step + 1 < steps) fetch(step + 1);
    fetch_wait(step);
#pragma unroll
    for (int it = 0; it < C * SX / NTS; ++it)  // mma operands
      VT[vt_at[it]] = REV ? tf32_if<!X3>(rho * to_f(vx[it])) : to_f(vx[it]);
    fetch_rows(step + 1, vx);
    __syncthreads();
    // Phase A: T^T = S^T X_A^T into UT (plus U0: U^T), and o^T = O0^T + scale S^T Q~^T.
    if (warp < (want_o ? 8 : 4)) {
      const float* A = cur + L.sW;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      if (wide) {
        // channels 4q, 4q + 1 and 4q + 2, 4q + 3 (the swizzle keeps them in each 8-piece group)
        const float *const a0 = ST + sidx(R, m0 + g, 4 * q), *const a1 = ST + sidx(R, m0 + g, 4 * q + 2);
        for (int kb = 0; kb < K; kb += 16) {
          const float4 u = *reinterpret_cast<const float4*>(a0 + 2 * kb);
          const float4 v = *reinterpret_cast<const float4*>(a1 + 2 * kb);
          const float4 w = *reinterpret_cast<const float4*>(A + (kb & ~31) + (kb & 16 ? aoff1 : aoff0));
          mma_tf32_as<X3>(acc, {u.x, u.y, u.z, u.w}, {w.x, w.y});
          mma_tf32_as<X3>(acc, {v.x, v.y, v.z, v.w}, {w.z, w.w});
        }
      } else {
        warp_mma<X3>(acc, (K + 7) / 8 * 8, [&](int r, int k) { return k < K ? ST[sidx(R, m0 + r, k)] : 0.f; },
                     [&](int k, int c) { return k < K ? A[ws.krow_at(xrow + i0 + c, k)] : 0.f; });
      }
      if (warp < 4) {
        const int x = m0 + g, i = i0 + 2 * q;  // acc: (x, i), (x, i + 1), (x + 8, i), (x + 8, i + 1)
        if (!REV) {
          const float* const u0 = cur + L.sU0 + i * SXP + x;
          acc[0] += u0[0], acc[1] += u0[SXP], acc[2] += u0[8], acc[3] += u0[SXP + 8];
        }
        // UT is read only as an mma operand: rounded once here, not per read (X3: kept whole)
        *reinterpret_cast<float4*>(UT + cidx(x, i)) = make_float4(tf32_if<!X3>(acc[0]), tf32_if<!X3>(acc[2]),
                                                                  tf32_if<!X3>(acc[1]), tf32_if<!X3>(acc[3]));
      } else {
        T* const ob = o_lane + ci * C * o_row;
        const int64_t rem = s.len - ci * C;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int x = acc_row(m0, e), i = acc_col(i0, e);
          if (i < rem && (e < 2 ? lx0 : lx1))
            ob[(e % 2) * o_row + (e / 2) * 8 * p.o.sd] = from_f<T>(cur[L.sO0 + i * SXP + x] + rho * acc[e]);
        }
      }
    }
    __syncthreads();
    // Phase B: S^T = gamma S^T + VT X1 + UT X2 with (X1, X2) = (K^, B^) forward, (Q~, W) backward;
    // the new state also to its hst / dhst slot (chunk ci + 1's start; REV: chunk ci - 1's end).
    const float* const X = cur + L.sW;
    const float* gam = cur + L.sGam;
    const bool put = REV ? step + 1 < steps : p.hst != nullptr && (!STRIDED || (ci + 1) % S == 0 || ci + 1 == nch);
    const int64_t put_slot = STRIDED ? kslot0 + (ci + S) / S : slot_of(REV ? ci - 1 : ci + 1);
    {
      // m16n8 tiles of S^T (16 state columns, 8 channels): warp w takes columns 16 (w % 2) and
      // channel tiles w / 2, w / 2 + 4, .. (m0 as in phase A); its A fragments (VT, UT rows) once.
      float va[8], ua[8];
      {
        const float4 v0 = *reinterpret_cast<const float4*>(VT + cidx(m0 + g, 4 * q));
        const float4 v1 = *reinterpret_cast<const float4*>(VT + cidx(m0 + g, 4 * q + 2));
        const float4 u0 = *reinterpret_cast<const float4*>(UT + cidx(m0 + g, 4 * q));
        const float4 u1 = *reinterpret_cast<const float4*>(UT + cidx(m0 + g, 4 * q + 2));
        const float vv[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
        const float uu[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) va[e] = vv[e], ua[e] = uu[e];
      }
      float* const st_step = put ? st_lane + put_slot * slot_size : nullptr;
      // (a runtime K up to kMaxHeadDim = 256 keeps a rolled loop: unrolled it spilled)
      constexpr int kTiles = KC ? (KC + kTileStep - 1) / kTileStep : 256 / kTileStep, kUnroll = KC ? kTiles : 1;
#pragma unroll kUnroll
      for (int n = 0; n < kTiles; ++n) {
        const int d0 = dwarp + kTileStep * n, dc = d0 + 2 * q;  // this lane's accumulator channels dc, dc + 1
        if ((KC == 0 || KC % kTileStep != 0) && d0 >= K) break;
        float* const sx = ST + st_lane_at + 64 * n;
        float acc[4];
        {
          const float2 gm = K % 8 == 0 || dc + 1 < K ? *reinterpret_cast<const float2*>(gam + dc)
                                                     : make_float2(dc < K ? gam[dc] : 0.f, 0.f);
          // (x, dc), (x + 8, dc), (x, dc + 1), ..
          const float4 sv = *reinterpret_cast<const float4*>(sx);
          acc[0] = gm.x * sv.x, acc[1] = gm.y * sv.z, acc[2] = gm.x * sv.y, acc[3] = gm.y * sv.w;
        }
        const bool bon = K % 8 == 0 || d0 + g < K;  // this lane's B fragment channel
        const float* const Xd = X + kTileStep * n;
        float b1[4], b2[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // rows j = 4q + r
          b1[r] = bon ? Xd[boff1[r]] : 0.f;
          b2[r] = bon ? Xd[boff2[r]] : 0.f;
        }
        mma_tf32_as<X3>(acc, {va[0], va[1], va[2], va[3]}, {b1[0], b1[1]});
        mma_tf32_as<X3>(acc, {va[4], va[5], va[6], va[7]}, {b1[2], b1[3]});
        mma_tf32_as<X3>(acc, {ua[0], ua[1], ua[2], ua[3]}, {b2[0], b2[1]});
        mma_tf32_as<X3>(acc, {ua[4], ua[5], ua[6], ua[7]}, {b2[2], b2[3]});
        *reinterpret_cast<float4*>(sx) = make_float4(acc[0], acc[2], acc[1], acc[3]);
        if (put) {
          float* const sp = st_step + int64_t(kTileStep * n) * p.V;
          const bool d0in = K % 8 == 0 || dc < K, d1in = K % 8 == 0 || dc + 1 < K;
          if (lx0 && d0in) sp[0] = acc[0];
          if (lx0 && d1in) sp[p.V] = acc[1];
          if (lx1 && d0in) sp[8] = acc[2];
          if (lx1 && d1in) sp[p.V + 8] = acc[3];
        }
      }
    }
    __syncthreads();
  }
  if (!REV && p.hst && p.cu_seqlens) {  // hst may be kept as an op output: its varlen gap slots read 0
    // (the slots after this sequence's final state: chunk_slot's map, or on strided states
    // dplr_kept_state_slot's, whose final state sits at ceil(nch / S))
    const int64_t after = STRIDED ? kslot0 + (nch + S - 1) / S + 1 : slot_of(nch) + 1;
    const int64_t next = dplr_slots_after<STRIDED ? C * S : C>(p, n);
    for (int64_t slot = after; slot < next; ++slot)
      for (int e = threadIdx.x; e < K * SX; e += NTS)
        if (e % SX < nc) *state_at(slot, e / SX, e % SX) = 0.f;
  }
  const MatArg& fin = REV ? (c_lo > 0 ? p.carry : p.dh0) : (c_hi < nch ? p.carry : p.hT);
  if (fin.on())
    for (int e = threadIdx.x; e < K * SX; e += NTS)
      if (e % SX < nc) *mptr(fin, n, h, e / SX, x0 + e % SX) = ST[sidx(R, e % SX, e / SX)];
}

}  // namespace dplr_chunk_detail
}  // namespace fla
