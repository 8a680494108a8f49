// The chunked RWKV7 engine's prep kernel (dplr_chunk_launch.cuh has the overview): everything of
// a chunk that does not depend on the state (prepare: exp(G), exp(Omega), the pair matrices and
// X = (I - A_ab)^-1), then W, Q~, K^, B^, gamma, U0, O0 into the workspace (DplrWorkspaceLayout).
#pragma once
#include <type_traits>

#include "dplr_chunk_loads.cuh"
#include "dplr_chunk_pairs.cuh"
#include "dplr_chunk_tiles.cuh"

namespace fla {
namespace dplr_chunk_detail {

// Everything of a loaded chunk that does not depend on the state: exp(G), exp(Omega), the pair
// matrices (on tensor cores where the chunk's decays allow: pair_matrices_tc) and X. Ends
// synchronised. Returns whether the pair matrices were factored (then the r and a rows hold R^
// and Â).
template <bool TC>
__device__ inline bool prepare(float* sm, const Smem& L) {
  const bool bounded = chunk_decays(sm, L, L.eG, L.eO, -1, -1, TC ? kFactorBound : kFactorBoundFp32);
  // X = (I - N)^-1 for the strictly lower N = A_ab by 4 x 4 blocks (docs/algorithms.md §6.2), the
  // blocked inverse by doubling: each diagonal block by forward substitution down its columns;
  // the blocks (1, 0), (3, 2) as X_II N_IJ X_JJ; then the lower left 8 x 8 block as X_hi
  // (N_hi,lo X_lo), the inner product staged in the pair workspace (free by then). Every thread
  // makes its own entry, so all warps work where a 15-step substitution on one warp would keep
  // seven waiting, and every stage is a fixed chain of at most 16 terms: a stage per block
  // distance (X_IJ = X_II sum_L N_IL X_LJ, L = J..I-1) runs chains of up to 48 terms under
  // runtime bounds, and every warp waits at the barriers for the longest. Not the product
  // (I + N)(I + N^2)(I + N^4)(I + N^8): for repeated keys with iclr = 1 the entries of N^k grow
  // like C(14, k - 1) while |X| <= 1, and the cancellation cost ~1e-4 in fp32 (tests: the
  // "repeated" low-rank regime). Every entry is written: the upper triangle is explicit zeros.
  const int i = threadIdx.x / C, j = threadIdx.x % C, at = i * CP + j;
  const int I = i / 4, J = j / 4;
  const float* const N = sm + L.Aab;
  float* const X = sm + L.X;
  const bool factored = __syncthreads_and(bounded && factorable(L));  // CTA-uniform
  if (factored) {
    pair_matrices_tc(sm, L);
  } else {
    int pi, pj;
    pair_of_thread(pi, pj);
    float rk, rb, ak, ab;
    pair_matrices(sm, L, pi, pj, rk, rb, ak, ab);
    const int pat = pi * CP + pj;
    sm[L.Ark + pat] = rk, sm[L.Arb + pat] = rb, sm[L.Aak + pat] = ak, sm[L.Aab + pat] = ab;
  }
  __syncthreads();
  if (I == J) {  // column j of the diagonal block, rows from its start (x = 0 above row j)
    const int b0 = 4 * I, jj = j - b0, ii = i - b0;
    float x[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float v = q == jj ? 1.f : 0.f;
#pragma unroll
      for (int l = 0; l < q; ++l) v += N[(b0 + q) * CP + b0 + l] * x[l];
      x[q] = v;
    }
    X[at] = ii == 0 ? x[0] : ii == 1 ? x[1] : ii == 2 ? x[2] : x[3];
  } else if (I < J) {
    X[at] = 0.f;
  }
  __syncthreads();
  static_assert(C == 16, "the doubling below is written for four 4 x 4 blocks");
  if ((I == 1 && J == 0) || (I == 3 && J == 2)) {  // X_II N_IJ X_JJ (their upper parts are 0)
    float acc = 0.f;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int rp = 4 * I + m;
      float t = 0.f;
#pragma unroll
      for (int l = 0; l < 4; ++l) t += N[rp * CP + 4 * J + l] * X[(4 * J + l) * CP + j];
      acc += X[i * CP + rp] * t;
    }
    X[at] = acc;
  }
  __syncthreads();
  float* const T = sm + L.pw;  // [8][8]: N_hi,lo X_lo
  const bool low = i >= 8 && j < 8;
  if (low) {
    float t = 0.f;
#pragma unroll
    for (int l = 0; l < 8; ++l) t += N[i * CP + l] * X[l * CP + j];
    T[(i - 8) * 8 + j] = t;
  }
  __syncthreads();
  if (low) {
    float acc = 0.f;
#pragma unroll
    for (int m = 8; m < 16; ++m) acc += X[i * CP + m] * T[(m - 8) * 8 + j];
    X[at] = acc;
  }
  __syncthreads();
  return factored;
}

// Prep's products with the 16 x 16 matrices on TF32 tensor cores (bf16 / fp16 inputs; fp32 ones
// as 3xTF32, X3; the matrices themselves stay exact fp32 SIMT, as do all exponents). A warp owns
// 8 channels (or columns) at a time and chains its products through a warp-private 16 x 8
// scratch with __syncwarp only: the SIMT forms (a thread per channel and row group) need a CTA
// barrier between each product and the next.
// K-wide rows: W = X Â, Q~ = R^ + A_rb W, K^ and B^ into shared memory over the
// w, r, k, b rows (each lane overwrites only elements it has read), for store_kwide_rows; gamma
// straight to the workspace. `factored`: the a and r rows hold Â and R^ already (prepare).
// Not synchronised.
template <bool X3>
__device__ inline void kwide_rows_tc(float* sm, const Smem& L, const DplrWorkspaceLayout& ws, float* out, bool factored) {
  const int K = L.K, KP = L.KP, warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
  const MatFrag<X3> X(sm, L.X), Arb(sm, L.Arb);
  for (int n0 = 8 * warp; n0 < ws.KP4; n0 += NT / 4) {
    const int d = n0 + g;  // the B fragments' channel
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    X.mma(acc, [&](int l, int) {
      return d >= K ? 0.f : factored ? sm[L.a + l * KP + d] : sm[L.a + l * KP + d] * eE(sm, L, l, d);
    });
#pragma unroll
    for (int h = 0; h < 2; ++h)  // 8-byte stores: conflict-free on kp_row's rows
      *reinterpret_cast<float2*>(sm + L.w + kp_row(0, 2 * h) * KP + acc_col(n0, 0)) = make_float2(acc[2 * h], acc[2 * h + 1]);
    __syncwarp();
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = kp_row(0, e), x = acc_col(n0, e);
      acc[e] = x >= K ? 0.f : factored ? sm[L.r + i * KP + x] : sm[L.r + i * KP + x] * sm[L.eG + i * KP + x];
    }
    Arb.mma(acc, [&](int j, int) { return sm[L.w + j * KP + d]; });
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int at = kp_row(0, e) * KP + acc_col(n0, e);
      const float eo = acc_col(n0, e) < K ? sm[L.eO + at] : 0.f;
      sm[L.r + at] = acc[e];
      sm[L.k + at] *= eo;
      sm[L.b + at] *= eo;
    }
    if (threadIdx.x % 32 < 8 && n0 + threadIdx.x % 32 < ws.KP4) {
      const int x = n0 + threadIdx.x % 32;
      out[ws.gamma_at() + x] = x < K ? sm[L.eG + (C - 1) * KP + x] : 0.f;
    }
  }
}
// kwide_rows_tc's rows to the workspace as 16-byte pieces (after a barrier): the lanes of its
// fragments hold 8-byte pairs on 8 rows, and stores from there would take twice the store
// instructions, each to a swizzled address of its own. Rounded to TF32 (tf32_round): the sweeps
// read them only as tensor-core operands, now without a rounding add per read (the same values);
// X3 (fp32 inputs, whose sweeps' products are 3xTF32): whole.
template <bool X3>
__device__ inline void store_kwide_rows(const float* sm, const Smem& L, const DplrWorkspaceLayout& ws, float* out) {
  // A thread's row i and piece c once for all four arrays (one piece per thread at K = 64): the
  // krow_at swizzle has period C, so array m's piece sits m C KS further. Per piece, picking the
  // array and swizzling per element would cost ~40 instructions, more than the stores.
  const Split q4(ws.KP4 / 4);
  const int src[4] = {L.w, L.r, L.k, L.b};  // W, Q~, K^, B^ in ws order
  for (int e = threadIdx.x; e < C * q4.n; e += NT) {
    const int i = q4.quot(e), c = 4 * (e - i * q4.n);
    float* const dst = out + ws.w_at() + ws.krow_at(i, c);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const float4 x = *reinterpret_cast<const float4*>(sm + src[m] + i * L.KP + c);
      *reinterpret_cast<float4*>(dst + m * C * ws.KS) =
          make_float4(tf32_if<!X3>(x.x), tf32_if<!X3>(x.y), tf32_if<!X3>(x.z), tf32_if<!X3>(x.w));
    }
  }
}

// Column tiles: U0 = X A_ak V and, forward, O0 = scale (A_rk V + A_rb U0), with v raw in the
// stage ([C][stage_pitch(V)] of T, copy_cols_async; landed and synchronised, exp(G), exp(Omega) no longer
// read). Columns [V, VP4) are written (0). Not synchronised.
template <typename T>
__device__ inline void col_tiles_tc(float* sm, const Smem& L, const DplrWorkspaceLayout& ws, float* uout, int V,
                                    float rho, bool o0) {
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
  uout = static_cast<float*>(__builtin_assume_aligned(uout, 16));  // (else its float2 stores split)
  const T* const vs = reinterpret_cast<const T*>(sm + L.stage) + stage_cols_at<T>(L.K);
  const int vp = stage_pitch<T>(V);
  // [C][8] per warp over exp(G), exp(Omega), v, U, M (contiguous, unused here: 2 C KP + 3 C BP
  // floats, >= 1728 for K <= 128 (BP = 36), >= 4352 beyond (KP >= 136); the 8 warps take 1024).
  // Scratch row k sits at srow(k): MatFrag's B rows 2q (+ 1) of a k-step, 8 floats apart, would
  // share banks for q, q + 2; rotating each 4-row block by its index spreads them over all 32.
  float* const scr = sm + L.eG + warp * C * 8;
  constexpr bool X3 = std::is_same<T, float>::value;
  const MatFrag<X3> Aak(sm, L.Aak), X(sm, L.X);
  auto srow = [](int k) { return (k & ~3) | ((k + (k >> 2)) & 3); };
  auto put = [&](float (&acc)[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<float2*>(scr + srow(kp_row(0, 2 * h)) * 8 + acc_col(0, 0)) = make_float2(acc[2 * h], acc[2 * h + 1]);
  };
  auto from_scr = [&](int k, int n) { return scr[srow(k) * 8 + n]; };
  for (int x0 = 8 * warp; x0 < ws.VP4; x0 += NT / 4) {
    const int xb = x0 + g;
    auto vb = [&](int k, int) { return xb < V ? to_f(vs[k * vp + xb]) : 0.f; };
    float m[4] = {0.f, 0.f, 0.f, 0.f}, u[4] = {0.f, 0.f, 0.f, 0.f};
    Aak.mma(m, vb);
    __syncwarp();  // the previous column slab's last scratch reads
    put(m);
    __syncwarp();
    X.mma(u, from_scr);
    const int c = x0 + 2 * q;
    if (c < ws.VP4)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(uout + ws.uo_at(0, kp_row(0, 2 * h), c)) = make_float2(u[2 * h], u[2 * h + 1]);
    if (!o0) continue;
    __syncwarp();
    put(u);
    __syncwarp();
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    MatFrag<X3>(sm, L.Ark).mma(o, vb);
    MatFrag<X3>(sm, L.Arb).mma(o, from_scr);
    if (c < ws.VP4)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(uout + ws.uo_at(1, kp_row(0, 2 * h), c)) =
            make_float2(rho * o[2 * h], rho * o[2 * h + 1]);
  }
}

// The workspaces' padding (DplrWorkspaceLayout): the K-rows' columns [KP4, KS) in `out`, and U0 /
// O0 columns past VP4 (which the column tiles write, 0 in [V, VP4)) and past kDplrSweepCols of
// each tile in `uout`, 16 bytes at a time. The sweeps copy whole blocks: padding is
// never read, but left unset it would be undefined data in a kept workspace.
__device__ inline void zero_ws_pads(float* out, float* uout, const DplrWorkspaceLayout& ws) {
  const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
  const int kpr = (ws.KS - ws.KP4) / 4;
  for (int e = threadIdx.x; e < 4 * C * kpr; e += NT) {
    const int row = e / kpr, c = ws.KP4 + 4 * (e - row * kpr);
    *reinterpret_cast<float4*>(out + ws.w_at() + ws.krow_at(row, c)) = z;
  }
  // Only the padding pieces are enumerated (a loop over every piece testing each cost more than
  // the stores): the UP / 4 - SP pieces past each row's kDplrSweepCols, then the last tile's
  // pieces in [VP4, its end).
  constexpr int upr = DplrWorkspaceLayout::UP / 4, spr = kDplrSweepCols / 4, extra = upr - spr;
  uout = static_cast<float*>(__builtin_assume_aligned(uout, 16));
  for (int e = threadIdx.x; e < ws.tiles * 2 * C * extra; e += NT) {
    const int row = e / extra;
    *reinterpret_cast<float4*>(uout + row * DplrWorkspaceLayout::UP + 4 * (spr + e - row * extra)) = z;
  }
  const int last = (ws.tiles - 1) * kDplrSweepCols, v0 = (ws.VP4 - last) / 4, tail = spr - v0;
  float* const ul = uout + ws.uo_tile_at(ws.tiles - 1);
  for (int e = threadIdx.x; e < 2 * C * tail; e += NT) {
    const int row = e / tail;
    *reinterpret_cast<float4*>(ul + row * DplrWorkspaceLayout::UP + 4 * (v0 + e - row * tail)) = z;
  }
}

// ---------------------------------------------------------------------------------------------
// Forward, parallel part: one CTA per (chunk slot, head). Slots without a chunk (final-state and
// gap slots) are never read; a training forward writes zeros there (its workspace is kept as an
// op output), any other call leaves them unwritten.
// KC: K as a compile-time constant (64 or 128; 0: p.K), so that the shared-memory layout and every index
// derived from K fold into immediates (launch_k).
template <typename T, int KC = 0>
__global__ void __launch_bounds__(NT, KC == 64 ? 4 : 3) prep_kernel(const DplrChunkPass p) {
  extern __shared__ float sm[];
  const Smem L(KC ? KC : p.K, false);
  const DplrWorkspaceLayout ws(L.K, p.V);
  // Windows (DplrChunkPass::window_chunks) launch (window_chunks, H, N): chunk window_begin +
  // blockIdx.x of sequence blockIdx.z, at the window's slot of uo (its U0 / O0 serve the window's
  // sweep alone) and of ws, but at the whole pass's slot of ws in a forward keeping it
  // (dplr_ws_slot); else (slots, H, 1), one CTA per slot of both (dplr_work_slot).
  const bool windowed = p.window_chunks > 0;
  const DplrSlotChunk at =
      windowed ? DplrSlotChunk{int(blockIdx.z), p.window_begin + blockIdx.x} : dplr_slot_chunk(p, blockIdx.x);
  const int h = blockIdx.y, n = at.n;
  const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
  const int64_t ci = at.ci, t0 = ci * C;
  const int64_t slot = blockIdx.x + int64_t(blockIdx.z) * p.prep_ws_seq_slots + p.prep_ws_slot0;
  float* out = static_cast<float*>(p.ws) + (slot * p.H + h) * ws.floats_per_chunk();
  // (formed where used: held across the kernel it cost prep 16 bytes more of spills)
  auto uout = [&] {
    return static_cast<float*>(p.uo) + ((blockIdx.x + int64_t(blockIdx.z) * p.window_chunks) * p.H + h) * ws.uo_floats_per_chunk();
  };
  const bool train = !p.backward() && dplr_ws_kept(p);  // a forward keeping ws
  if (windowed) {
    // A window's chunks past the sequence's have no slot of theirs. The final state's slot (the
    // next) gets a training forward's zeros from the last chunk's CTA: no window reaches past it.
    const int64_t nch = (s.len + C - 1) / C;
    if (ci >= nch) return;
    if (train && ci == nch - 1)
      for (int e = threadIdx.x; e < ws.floats_per_chunk() / 4; e += NT)
        reinterpret_cast<float4*>(out + int64_t(p.H) * ws.floats_per_chunk())[e] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (ci < 0 || t0 >= s.len) {
    // (floats_per_chunk() is a multiple of 4)
    for (int e = threadIdx.x; e < (train ? ws.floats_per_chunk() / 4 : 0); e += NT)
      reinterpret_cast<float4*>(out)[e] = make_float4(0.f, 0.f, 0.f, 0.f);
    return;
  }
  const int nrow = int(s.len - t0 < C ? s.len - t0 : C);
  const int cols = L.cols, BP = L.BP;
  if (p.paths.rows_16byte) {
    copy_rows_async<T>(sm, L, p, s, h, t0, nrow);
    copy_commit();
    copy_wait<0>();
    __syncthreads();
    widen_rows<T>(sm, L);
  } else {
    load_rows<T>(sm, L, p, s, h, t0, nrow);
  }
  __syncthreads();
  constexpr bool TC = !std::is_same<T, float>::value;
  const bool factored = prepare<TC>(sm, L);
  // All of v at once into the stage (over the pair workspace, free now), in flight during the
  // K-wide rows below; every column tile reads it.
  if (p.paths.rows_16byte) {
    copy_cols_async<T>(sm, L, p.v, 0, s, h, t0, nrow, 0, p.V, p.V);
    copy_commit();
  }
  // The pair matrices and X serve the backward's grad kernel alone: stored by a backward's prep
  // or a training forward's, the rows' padding columns as zeros (a kept workspace is an op
  // output: every float written, the same from run to run).
  static_assert(CP == C + 4, "one 16-byte piece of padding a row");
  for (int e = threadIdx.x; e < (p.backward() || train ? 5 * C * CP / 4 : 0); e += NT)  // as DplrWorkspaceLayout::mats_at()
    *reinterpret_cast<float4*>(out + ws.mats_at() + 4 * e) =
        e % (CP / 4) == C / 4 ? make_float4(0.f, 0.f, 0.f, 0.f) : *reinterpret_cast<const float4*>(sm + L.Ark + 4 * e);
  zero_ws_pads(out, uout(), ws);
  // K-wide rows, then the column tiles (when v is in the stage) on tensor cores: single TF32 for
  // bf16 / fp16, 3xTF32 for fp32 (X3: fp32-accurate).
  const float rho = float(p.scale);
  kwide_rows_tc<!TC>(sm, L, ws, out, factored);
  if (p.paths.rows_16byte) copy_wait<0>();
  __syncthreads();
  store_kwide_rows<!TC>(sm, L, ws, out);
  // U0 serves the forward sweeps alone: a backward on strided states runs none
  if (p.backward() && p.sweep_strided_states) return;
  if (p.paths.rows_16byte) {
    col_tiles_tc<T>(sm, L, ws, uout(), p.V, rho, !p.backward());
    return;
  }
  // V columns in tiles of `cols`: thread (column x, row group g). U0 = X A_ak V, O0 = scale
  // (A_rk V + A_rb U0) (forward only); columns in [V, VP4) are written (0: v reads 0 there).
  const int x = threadIdx.x % cols, G = NT / cols, g = threadIdx.x / cols;
  for (int x0 = 0; x0 < p.V; x0 += cols) {
    if (p.paths.rows_16byte) {
      if (x0 == 0) {
        copy_wait<0>();
        __syncthreads();
      }
      widen_cols<T>(sm, L, 0, p.V, x0, L.v);
    } else {
      load_cols<T>(sm, L, p, s, h, x0, min(cols, p.V - x0), t0, nrow, false);
    }
    __syncthreads();
    const bool put = x0 + x < ws.VP4;
    float vc[C], y[C];
#pragma unroll
    for (int j = 0; j < C; ++j) vc[j] = sm[L.v + j * BP + x];
    for (int i = g; i < C; i += G) {
      float m = 0.f;
#pragma unroll
      for (int j = 0; j < C; ++j) m += sm[L.Aak + i * CP + j] * vc[j];
      sm[L.M + i * BP + x] = m;
    }
    __syncthreads();
#pragma unroll
    for (int l = 0; l < C; ++l) y[l] = sm[L.M + l * BP + x];
    for (int i = g; i < C; i += G) {
      float u = 0.f;
#pragma unroll
      for (int l = 0; l < C; ++l) u += sm[L.X + i * CP + l] * y[l];
      sm[L.U + i * BP + x] = u;
      if (put) uout()[ws.uo_at(0, i, x0 + x)] = u;
    }
    __syncthreads();
    if (p.backward()) continue;  // O0 only serves the forward's o
#pragma unroll
    for (int l = 0; l < C; ++l) y[l] = sm[L.U + l * BP + x];
    for (int i = g; i < C; i += G) {
      float o = 0.f;
#pragma unroll
      for (int j = 0; j < C; ++j) o += sm[L.Ark + i * CP + j] * vc[j] + sm[L.Arb + i * CP + j] * y[j];
      if (put) uout()[ws.uo_at(1, i, x0 + x)] = rho * o;
    }
    __syncthreads();
  }
}

}  // namespace dplr_chunk_detail
}  // namespace fla
