// The chunked RWKV7 engine's gradient kernel (dplr_chunk.cuh): every chunk's gradients, given the
// chunk-start states (forward sweep) and dS+ (reverse sweep, dplr_chunk_sweep.cuh).
#pragma once
#include "dplr_chunk.cuh"

namespace fla {
namespace dplr_chunk_detail {

// The backward's gradients, parallel over (chunk slot, head, tile of dplr_chunk_cols(K)
// columns): with S (hst), S+ and dS+ (dhst, from the reverse sweep) known, every chunk's
// gradients are independent. The pair matrices and X come from the prep workspace.
template <typename T, int KC = 0>  // KC: as prep_kernel's
__global__ void __launch_bounds__(NT, 2) grad_kernel(const DplrChunkPass p) {
  constexpr bool TC = !std::is_same<T, float>::value;
  extern __shared__ float4 sm4[];  // 16-byte aligned: the state rows are stored as float4
  float* sm = reinterpret_cast<float*>(sm4);
  const Smem L(KC ? KC : p.K, true);
  const DplrWs ws(L.K, p.V);
  const int64_t slot = blockIdx.x;
  const int n = slot_sequence<C>(p.cu_seqlens, p.N, p.T, slot);
  Cta c;
  c.h = blockIdx.y, c.n = n, c.tile = blockIdx.z, c.s = seq_span(p.cu_seqlens, n, p.T);
  c.x0 = c.tile * L.cols, c.nc = min(L.cols, p.V - c.x0);
  const int64_t ci = slot - chunk_slot<C>(p.cu_seqlens, n, p.T, 0);
  if (ci < 0 || ci * C >= c.s.len) return;
  const int K = L.K, KP = L.KP, cols = L.cols, BP = L.BP;
  const float rho = float(p.scale);
  {
    const int64_t t0 = ci * C;
    const int nrow = int(c.s.len - t0 < C ? c.s.len - t0 : C);
    const float* mats = static_cast<const float*>(p.ws) + (slot * p.H + c.h) * ws.per() + ws.mats();
    // S (hst at this chunk) and dS+ at this tile's columns. zeta = rowsum(S+ * dS+) is formed
    // without S+ (S+ = gamma S + K^^T V + B^^T U): gamma rowsum(S * dS+) here, the rest from the
    // state parts v dS+^T and U dS+^T below, so no S+ is read.
    const float *s0 = slot_state(p, p.hst, c, ci), *d1 = slot_state(p, p.dhst, c, ci);
    const int lq = L.lc - 2;  // log2(column quads per row)
    auto quad = [&](int e, int& d, int& x) { d = e >> lq, x = 4 * (e & ((1 << lq) - 1)); };
    if (p.rows16) {
      // Everything in flight before any wait: rows, v, dO, the matrices, S and dS+ by cp.async.
      copy_rows_async<T>(sm, L, p, c.s, c.h, t0, nrow);
      copy_cols_async<T>(sm, L, p.v, 0, c.s, c.h, t0, nrow, c.x0, cols, c.nc);
      copy_cols_async<T>(sm, L, p.dout, 1, c.s, c.h, t0, nrow, c.x0, cols, c.nc);
      for (int e = threadIdx.x; e < 5 * C * CP / 4; e += NT)  // stored in the shared layout
        copy16(sm + L.Ark + 4 * e, mats + 4 * e, true);
      for (int e = threadIdx.x; e < K << lq; e += NT) {
        int d, x;
        quad(e, d, x);
        const int64_t at = int64_t(d) * p.V + x;
        copy16(sm + L.S + d * BP + x, s0 + at, x < c.nc);
        copy16(sm + L.dS + d * BP + x, d1 + at, x < c.nc);
      }
      copy_commit();
      if (!kRawRows<T>) widen_rows<T>(sm, L);  // fp32: the channel padding only
      copy_wait<0>();
      __syncthreads();
      if (kRawRows<T>) widen_rows<T>(sm, L);
      widen_cols<T>(sm, L, 0, cols, 0, L.v);
      widen_cols<T>(sm, L, 1, cols, 0, L.dO);
    } else {
      const bool vec = p.V % 4 == 0 && aligned16(p.hst) && aligned16(p.dhst);
#pragma unroll 2
      for (int e = threadIdx.x; e < K << lq; e += NT) {
        int d, x;
        quad(e, d, x);
        const int64_t at = int64_t(d) * p.V + x;
        *reinterpret_cast<float4*>(sm + L.S + d * BP + x) = load4(s0 + at, c.nc - x, vec);
        *reinterpret_cast<float4*>(sm + L.dS + d * BP + x) = load4(d1 + at, c.nc - x, vec);
      }
      load_chunk<T>(sm, L, p, c, t0, nrow, true);
      for (int e = threadIdx.x; e < 5 * C * CP; e += NT) sm[L.Ark + e] = mats[e];
    }
    __syncthreads();
    for (int d0 = 0; d0 < K; d0 += NT / 4) {  // rowsum(S * dS+): four threads per channel
      const int d = d0 + threadIdx.x / 4, part = threadIdx.x % 4;
      float z = 0.f;
      if (d < K)
        for (int x = 4 * part; x < cols; x += 16) z = dot4(ld4(sm + L.S + d * BP + x), ld4(sm + L.dS + d * BP + x), z);
      z += __shfl_xor_sync(0xffffffffu, z, 1);
      z += __shfl_xor_sync(0xffffffffu, z, 2);
      if (d < K && part == 0) sm[L.zeta + d] = z;
    }
    // Â and exp(Omega) in the gradient rows ga, gk (the raw stage there is spent), which the
    // K-vector gradients write last; exp(G) is not stored (see there).
    chunk_decays(sm, L, -1, L.gk, L.ga, L.zgam);
    __syncthreads();
    // exp(w) in place of w: the pair parts of the K-vector gradients multiply the factors up
    // (products of <= 15 factors <= 1, a few ulp) instead of exponentiating sums per pair. K^ =
    // k exp(Omega) and B^ = b exp(Omega) in gk (over exp(Omega): same element, same thread) and
    // gb, 0 on the channel padding where exp(Omega) is not set.
    for (int e = threadIdx.x; e < C * KP; e += NT) {
      const bool on = e % KP < K;
      const float eo = on ? sm[L.gk + e] : 0.f;
      sm[L.w + e] = on ? expf(sm[L.w + e]) : 0.f;
      sm[L.gk + e] = sm[L.k + e] * eo, sm[L.gb + e] = sm[L.b + e] * eo;
    }
    auto put_dv = [&](int j, int xx, float v) {
      if (xx < c.nc && j < nrow) *vptr<T>(p.dv, c.s.b, c.s.bos + t0 + j, c.h, c.x0 + xx) = from_f<T>(v);
    };
    // The pair-matrix gradients (thread (i, j); dX only below the diagonal: the rest cannot
    // reach dA_ab), from complete dO, v, U, dM, dU, M + P rows (exact SIMT; the TC path's are
    // products on tensor cores).
    auto pair_grads = [&]() {
      const int i = threadIdx.x / C, j = threadIdx.x % C, at = i * CP + j;
      float rk = 0.f, rb = 0.f, ak = 0.f, dx = 0.f;
      if (j <= i)
        for (int q = 0; q < cols; q += 4) {
          const float4 o = ld4(sm + L.dO + i * BP + q), vj = ld4(sm + L.v + j * BP + q);
          rk = dot4(o, vj, rk), rb = dot4(o, ld4(sm + L.U + j * BP + q), rb);
          if (j < i) {
            ak = dot4(ld4(sm + L.dM + i * BP + q), vj, ak);
            dx = dot4(ld4(sm + L.dU + i * BP + q), ld4(sm + L.M + j * BP + q), dx);  // M + P
          }
        }
      *reinterpret_cast<float4*>(sm + L.dA + 4 * (i * C + j)) = make_float4(rho * rk, rho * rb, ak, 0.f);
      sm[L.dX + at] = j < i ? dx : 0.f;
    };
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
    if (TC) {
      __syncthreads();  // K^, B^ and exp(w) (the loop above is elementwise over all threads)
      // A warp per 8 columns chains every 16-row product of its columns on tensor cores, with
      // __syncwarp between them (the SIMT forms below need a CTA barrier after each):
      //   M + P = A_ak V + Â S,  U = X (M + P),  dU = scale A_rb^T dO + B^ dS+,  dM = X^T dU,
      //   dV = scale A_rk^T dO + A_ak^T dM + K^ dS+.
      for (int x0 = 8 * (threadIdx.x / 32); x0 < cols; x0 += NT / 4) {
        auto col = [&](int arr, float f) {
          return [=](int k, int n) { return f * sm[arr + k * BP + x0 + n]; };
        };
        auto put = [&](int arr, const float(&acc)[4]) {
#pragma unroll
          for (int e = 0; e < 4; ++e) sm[arr + acc_row(0, e) * BP + acc_col(x0, e)] = acc[e];
        };
        float mp[4] = {0.f, 0.f, 0.f, 0.f}, u[4] = {0.f, 0.f, 0.f, 0.f};
        rows_state_mma(sm, L, L.ga, L.S, x0, mp);
        MatFrag(sm, L.Aak).mma(mp, col(L.v, 1.f));
        put(L.M, mp);
        __syncwarp();
        MatFrag(sm, L.X).mma(u, col(L.M, 1.f));
        put(L.U, u);
        float du[4] = {0.f, 0.f, 0.f, 0.f}, dm[4] = {0.f, 0.f, 0.f, 0.f}, dv[4] = {0.f, 0.f, 0.f, 0.f};
        rows_state_mma(sm, L, L.gb, L.dS, x0, du);
        MatFrag(sm, L.Arb, true).mma(du, col(L.dO, rho));
        put(L.dU, du);
        __syncwarp();
        MatFrag(sm, L.X, true).mma(dm, col(L.dU, 1.f));
        put(L.dM, dm);
        __syncwarp();
        rows_state_mma(sm, L, L.gk, L.dS, x0, dv);
        MatFrag(sm, L.Ark, true).mma(dv, col(L.dO, rho));
        MatFrag(sm, L.Aak, true).mma(dv, col(L.dM, 1.f));
#pragma unroll
        for (int e = 0; e < 4; ++e) put_dv(acc_row(0, e), acc_col(x0, e), dv[e]);
      }
      __syncthreads();
      {  // the pair-matrix gradients as 16 x 16 products over the columns, a warp per 8 of j
         // (the SIMT pair_grads here: grad 2.15 -> 2.33 ms)
        static_assert(NT / 32 == 8, "4 products x 2 column tiles");
        const int w = threadIdx.x / 32, m = w / 2, j0 = 8 * (w % 2);  // m: rk, rb, ak, dX
        const int A = m < 2 ? L.dO : m == 2 ? L.dM : L.dU, B = m == 1 ? L.U : m == 3 ? L.M : L.v;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        warp_mma_ld<false, true>(acc, cols, sm + A, BP, sm + B + j0 * BP, BP);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = acc_row(0, e), j = acc_col(j0, e);
          const bool on = m < 2 ? j <= i : j < i;
          if (m == 3) sm[L.dX + i * CP + j] = on ? acc[e] : 0.f;
          else sm[L.dA + 4 * (i * C + j) + m] = on ? (m < 2 ? rho : 1.f) * acc[e] : 0.f;
        }
      }
      // The state parts of the K-vector gradients, dO S^T, dM S^T, v dS^T, U dS^T ([C][K] over
      // this tile's columns), into the gradient rows (Â, K^, B^ there are spent).
      const int ntile = (K + 7) / 8;
      for (int task = threadIdx.x / 32; task < 4 * ntile; task += NT / 32) {
        const int m = task / ntile, n0 = 8 * (task % ntile);
        const int A = m == 0 ? L.dO : m == 1 ? L.dM : m == 2 ? L.v : L.U, B = m < 2 ? L.S : L.dS;
        const int D = m == 0 ? L.gr : m == 1 ? L.ga : m == 2 ? L.gk : L.gb;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        // (warp_mma_ld here: grad 3.57 -> 3.99 ms in c16, 2.88 -> 2.96 now; kept the functors)
        warp_mma(acc, cols, [&](int r, int k) { return sm[A + r * BP + k]; },
                 [&](int k, int n) { return n0 + n < K ? sm[B + (n0 + n) * BP + k] : 0.f; });
        float z[2] = {0.f, 0.f};  // zeta's parts sum_j K^_j (v_j dS+^T), sum_j B^_j (U_j dS+^T)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int d = acc_col(n0, e), at = acc_row(0, e) * KP + d;
          if (d >= K) continue;
          if (m >= 2) z[e % 2] += sm[D + at] * acc[e];  // K^, B^ there until this write
          sm[D + at] = acc[e];
        }
        if (m >= 2) {  // warp-uniform: summed over the 16 rows (lanes g)
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            for (int lanes = 4; lanes < 32; lanes *= 2) z[h2] += __shfl_xor_sync(0xffffffffu, z[h2], lanes);
            const int d = acc_col(n0, h2);
            if (threadIdx.x % 32 < 4 && d < K) sm[L.zparts + (m - 2) * K + d] = z[h2];
          }
        }
      }
      __syncthreads();
      solve_grads();
    } else {
      pseudo_values(sm, L, L.ga);
      // Thread (column x, rows j and j + 8 for j = j0, j0 + NT / cols, ..), so that each state
      // or tile element read serves two rows; 4 channels per K-row read. The 16 x 16 matrices
      // are zero-filled outside their triangles: fixed 16-term sums.
      const int x = threadIdx.x & (cols - 1), j0 = threadIdx.x >> L.lc, jstep = NT >> L.lc;
      for (int j = j0; j < C / 2; j += jstep) {  // dU = scale A_rb^T dO + B^ dS+
        float u0 = 0.f, u1 = 0.f;
        for (int i = 0; i < C; ++i) {
          const float o = rho * sm[L.dO + i * BP + x];
          u0 += sm[L.Arb + i * CP + j] * o, u1 += sm[L.Arb + i * CP + j + C / 2] * o;
        }
        rows_dot_state(sm, L, L.gb, L.dS, j, x, u0, u1);
        sm[L.dU + j * BP + x] = u0, sm[L.dU + (j + C / 2) * BP + x] = u1;
      }
      __syncthreads();
      for (int j = j0; j < C / 2; j += jstep) {  // dM = X^T dU
        float m0 = 0.f, m1 = 0.f;
        for (int i = 0; i < C; ++i) {
          const float du = sm[L.dU + i * BP + x];
          m0 += sm[L.X + i * CP + j] * du, m1 += sm[L.X + i * CP + j + C / 2] * du;
        }
        sm[L.dM + j * BP + x] = m0, sm[L.dM + (j + C / 2) * BP + x] = m1;
      }
      __syncthreads();
      pair_grads();
      __syncthreads();
      solve_grads();
      for (int j = j0; j < C / 2; j += jstep) {  // dV = scale A_rk^T dO + A_ak^T dM + K^ dS+
        float v0 = 0.f, v1 = 0.f;
        for (int i = 0; i < C; ++i) {
          const float o = rho * sm[L.dO + i * BP + x], m = sm[L.dM + i * BP + x];
          v0 += sm[L.Ark + i * CP + j] * o + sm[L.Aak + i * CP + j] * m;
          v1 += sm[L.Ark + i * CP + j + C / 2] * o + sm[L.Aak + i * CP + j + C / 2] * m;
        }
        rows_dot_state(sm, L, L.gk, L.dS, j, x, v0, v1);
        put_dv(j, x, v0), put_dv(j + C / 2, x, v1);
      }
      __syncthreads();  // K^, B^ read: the gradient rows are written below
    }
    // K-vector gradients of rows i and i + 8 (one read of S and dS serves both), channel d:
    // state parts, then the pair parts (query-type rows r, a over j <= i; key-type rows k, b
    // over i' >= j), factors multiplied up from exp(w).
    for (int e = threadIdx.x; e < (C / 2) * K; e += NT) {
      const int i0 = e / K, d = e % K;
      float g[2][4] = {};
      if (TC) {
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int at = (i0 + h2 * (C / 2)) * KP + d;
          g[h2][0] = sm[L.gr + at], g[h2][1] = sm[L.ga + at], g[h2][2] = sm[L.gk + at], g[h2][3] = sm[L.gb + at];
        }
      }
      for (int q = 0; q < (TC ? 0 : cols); q += 4) {
        const float4 s = ld4(sm + L.S + d * BP + q), ds = ld4(sm + L.dS + d * BP + q);
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int i = i0 + h2 * (C / 2);
          g[h2][0] = dot4(ld4(sm + L.dO + i * BP + q), s, g[h2][0]);
          g[h2][1] = dot4(ld4(sm + L.dM + i * BP + q), s, g[h2][1]);
          g[h2][2] = dot4(ld4(sm + L.v + i * BP + q), ds, g[h2][2]);
          g[h2][3] = dot4(ld4(sm + L.U + i * BP + q), ds, g[h2][3]);
        }
      }
      float zp = 0.f;  // SIMT: this thread's rows' part of zeta's K^ (v dS+^T) + B^ (U dS+^T)
#pragma unroll 1
      for (int h2 = 0; h2 < 2; ++h2) {
        const int i = i0 + h2 * (C / 2);
        // The state parts (selects: no local memory) take their row factors last: exp(E_i)
        // and exp(Omega_i) are the products the pair walks end with (no exp(G) rows stored).
        const float sr = h2 ? g[1][0] : g[0][0], sa = h2 ? g[1][1] : g[0][1];
        const float sk = h2 ? g[1][2] : g[0][2], sb = h2 ? g[1][3] : g[0][3];
        const float* ew = sm + L.w + d;  // exp(w)
        const float4 di = ld4(sm + L.dA + 4 * (i * C + i));
        float dr = di.x * sm[L.k + i * KP + d] + di.y * sm[L.b + i * KP + d], da = 0.f;
        const float ewi = ew[i * KP];
        float fex = 1.f;  // exp(sum of w_s over j < s < i); after the walk exp(E_i)
        for (int j = i - 1; j >= 0; --j) {
          const float fin = fex * ewi;
          const float kj = sm[L.k + j * KP + d], bj = sm[L.b + j * KP + d];
          const float4 a = ld4(sm + L.dA + 4 * (i * C + j));
          dr += (a.x * kj + a.y * bj) * fin;
          da += (a.z * kj + a.w * bj) * fex;
          fex *= ew[j * KP];
        }
        dr += sr * (rho * (fex * ewi)), da += sa * fex;  // exp(G_i) = exp(E_i) exp(w_i)
        const int j = i;  // this row as the key
        const float4 dj = ld4(sm + L.dA + 4 * (j * C + j));
        float dk = dj.x * sm[L.r + j * KP + d], db = dj.y * sm[L.r + j * KP + d];
        fex = 1.f;  // exp(sum of w_s over j < s < i'); after the walk exp(Omega_j)
        for (int i2 = j + 1; i2 < C; ++i2) {
          const float fin = fex * ew[i2 * KP];
          const float ri = sm[L.r + i2 * KP + d], ai = sm[L.a + i2 * KP + d];
          const float4 a = ld4(sm + L.dA + 4 * (i2 * C + j));
          dk += a.x * ri * fin + a.z * ai * fex;
          db += a.y * ri * fin + a.w * ai * fex;
          fex = fin;
        }
        dk += sk * fex, db += sb * fex;
        if (!TC) zp += (sm[L.k + j * KP + d] * sk + sm[L.b + j * KP + d] * sb) * fex;
        sm[L.gr + i * KP + d] = dr, sm[L.ga + i * KP + d] = da;
        sm[L.gk + i * KP + d] = dk, sm[L.gb + i * KP + d] = db;
      }
      if (!TC) sm[L.zparts + i0 * K + d] = zp;
    }
    __syncthreads();

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
        float x[4], y[4], cg = 0.f;
        bool z[4], keep = true;  // keep: no reset in this row group
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int at = (r0 + r) * KP + d;
          const bool live = on && r0 + r < nrow;
          x[r] = live ? sm[L.r + at] * sm[L.gr + at] - sm[L.k + at] * sm[L.gk + at] -
                            sm[L.b + at] * sm[L.gb + at]
                      : 0.f;
          y[r] = live ? sm[L.a + at] * sm[L.ga + at] : 0.f;
          z[r] = live && sm[L.w + at] == 0.f;  // exp(w), set above
        }
#pragma unroll
        for (int r = 3; r >= 0; --r) cg = z[r] ? y[r] : cg + x[r] + y[r], keep = keep && !z[r];
        float acc = 0.f;  // zeta = gamma rowsum(S * dS+) + its state-part sums (TC: 2, SIMT: 8)
        if (on) {
          acc = sm[L.zgam + d] * sm[L.zeta + d];
#pragma unroll
          for (int q = 0; q < (TC ? 2 : C / 2); ++q) acc += sm[L.zparts + q * K + d];
        }
#pragma unroll
        for (int q = 3; q >= 0; --q) {
          const float cq = __shfl_sync(0xffffffffu, cg, q, 4);
          const float kq = __shfl_sync(0xffffffffu, keep ? 1.f : 0.f, q, 4);
          if (q > part) acc = kq != 0.f ? acc + cq : cq;
        }
#pragma unroll
        for (int r = 3; r >= 0; --r) {
          acc += x[r];
          if (z[r]) acc = 0.f;
          if (on && r0 + r < nrow) {
            if (p.kg16) sm[L.w + (r0 + r) * KP + d] = acc;  // over exp(w), read above by this thread only
            else put_kg(kGradW, c.s.bos + t0 + r0 + r, d, acc);
          }
          acc += y[r];
        }
      }
    }
    if (p.kg16) {  // all five from shared memory as 16-byte pieces (dw in the w rows)
      constexpr int E = kPiece<T>;
      const int pk = K / E;
      __syncthreads();
      for (int e = threadIdx.x; e < kNumKGrads * C * pk; e += NT) {
        const int gi = e / (C * pk), i = e / pk % C, ch = (e % pk) * E;
        if (i >= nrow) continue;
        const int src = gi == kGradR ? L.gr : gi == kGradW ? L.w : gi == kGradK ? L.gk : gi == kGradA ? L.ga : L.gb;
        const float* f = sm + src + i * KP + ch;
        T v[E];
#pragma unroll
        for (int q = 0; q < E; ++q) v[q] = from_f<T>(f[q]);
        uint4 raw;
        memcpy(&raw, v, sizeof(raw));
        *reinterpret_cast<uint4*>(vptr<T>(p.kgd[gi], c.s.b, c.s.bos + t0 + i, c.h, ch)) = raw;
      }
      return;
    }
    for (int i = threadIdx.x / 64; i < nrow; i += NT / 64) {
      const int64_t t = c.s.bos + t0 + i;
      for (int d = threadIdx.x % 64; d < K; d += 64) {
        const int at = i * KP + d;
        put_kg(kGradR, t, d, sm[L.gr + at]), put_kg(kGradK, t, d, sm[L.gk + at]);
        put_kg(kGradA, t, d, sm[L.ga + at]), put_kg(kGradB, t, d, sm[L.gb + at]);
      }
    }
  }
}

}  // namespace dplr_chunk_detail
}  // namespace fla
