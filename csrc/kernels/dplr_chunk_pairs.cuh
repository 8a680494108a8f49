// The chunked RWKV7 engine's pair matrices (dplr_chunk_launch.cuh has the overview): the chunk's
// decay rows exp(G), exp(Omega) (chunk_decays), the four pair matrices A_rk, A_rb, A_ak, A_ab
// exact on SIMT (pair_matrices) or factored on tensor cores (pair_matrices_tc), and the
// backward's walks over the pairs for the K-vector gradients (pair_walks).
#pragma once
#include "dplr_chunk_layout.cuh"

namespace fla {
namespace dplr_chunk_detail {

// The pair (i, j) of this thread: the 136 pairs j <= i on threads 0..135 (packed, so that warps 5..7
// hold only pairs above the diagonal, whose entries are 0 and skip the channel loop: a thread per
// (i, j) in row order left ~47 % of every warp's lanes multiplying by zeros), the 120 pairs j > i
// on the rest.
__device__ __forceinline__ void pair_of_thread(int& i, int& j) {
  constexpr int kLower = C * (C + 1) / 2;
  const int t = threadIdx.x;
  const int e = t < kLower ? t : t - kLower;  // index among the pairs j <= i, or j < i
  const int off = t < kLower ? 1 : -1;        // row r of index e: r (r + off) / 2 <= e
  int r = int((sqrtf(8.f * float(e) + 1.f) - float(off)) * 0.5f);
  while (r * (r + off) / 2 > e) --r;
  while ((r + 1) * (r + 1 + off) / 2 <= e) ++r;
  const int c = e - r * (r + off) / 2;
  if (t < kLower) i = r, j = c;
  else i = c, j = r;  // the strictly lower pair (r, c) mirrored
}

// The four pair-matrix entries of thread (i, j) = pair_of_thread() over all channels (0 for
// j > i): A_rk, A_rb with
// exp(sum_{j<s<=i} w_s), A_ak, A_ab (j < i) with exp(sum_{j<s<i} w_s), as
//   rk = sum_c (R F_in)(K), rb = sum_c (R F_in)(B), ak = sum_c (A F_ex)(K), ab = sum_c (A F_ex)(B)
// with rows picked per pair so that every thread runs the same instructions: different
// micro-blocks take the prescaled rows and the gap factor (no exponential per pair); one
// micro-block the raw rows and the products P of at most three exp(w) (each <= 1; a few ulp);
// the diagonal raw rows, F_in = 1, F_ex = 0. The per-pair exponent walk this replaced put
// ~15 x K additions on the thread of pair (15, 0), and divergent paths serialised the warps.
__device__ inline void pair_matrices(float* sm, const Smem& L, int i, int j, float& rk, float& rb,
                                     float& ak, float& ab) {
  float* const pw = sm + L.pw;
  auto row = [&](int q, int i) { return pw + (q * C + i) * PSP; };  // q: 0 r~ 1 a~ 2 k~ 3 b~ 4.. P
  float* const gap = pw + kPairRows * C * PSP;
  float *const ones = gap + 3 * PSP, *const zeros = ones + PSP;
  const int K = L.K, KP = L.KP;
  const int mi = i / MB, mj = j / MB, dl = i - j;
  rk = rb = ak = ab = 0.f;
  for (int d0 = 0; d0 < K; d0 += PS) {
    const int nd = min(PS, K - d0);
    __syncthreads();
    static_assert(C / MB * PS <= NT, "a thread per micro-block and slab channel");
    if (threadIdx.x < C / MB * PS) {  // thread (micro-block m, slab channel c): its four rows
      const int m = threadIdx.x / PS, c = threadIdx.x % PS, d = d0 + c;
      const bool on = c < nd;
      float e = 0.f, p1 = 1.f, p2 = 1.f;  // p1, p2: exp(w) of the previous one and two rows
#pragma unroll
      for (int q = 0; q < MB; ++q) {  // from the micro-block start
        const int rw = m * MB + q, at_ = rw * KP + d;
        const float w = on ? sm[L.w + at_] : 0.f, ew = expf(w);
        row(1, rw)[c] = on ? sm[L.a + at_] * expf(e) : 0.f;
        e += w;
        row(0, rw)[c] = on ? sm[L.r + at_] * expf(e) : 0.f;
        row(4, rw)[c] = on ? ew : 0.f, row(5, rw)[c] = on ? ew * p1 : 0.f, row(6, rw)[c] = on ? ew * p2 : 0.f;
        p2 = ew * p1, p1 = ew;
      }
      float f = 0.f;
#pragma unroll
      for (int q = MB - 1; q >= 0; --q) {  // to the micro-block end
        const int rw = m * MB + q, at_ = rw * KP + d;
        row(2, rw)[c] = on ? sm[L.k + at_] * expf(f) : 0.f;
        row(3, rw)[c] = on ? sm[L.b + at_] * expf(f) : 0.f;
        f += on ? sm[L.w + at_] : 0.f;
      }
      if (m == 0) {  // gaps: totals of micro-blocks 1 and 2, added
        float t1 = 0.f, t2 = 0.f;
#pragma unroll
        for (int q = 0; q < MB; ++q)
          t1 += on ? sm[L.w + (MB + q) * KP + d] : 0.f, t2 += on ? sm[L.w + (2 * MB + q) * KP + d] : 0.f;
        gap[c] = expf(t1), gap[PSP + c] = expf(t2), gap[2 * PSP + c] = expf(t1 + t2);
        ones[c] = on ? 1.f : 0.f, zeros[c] = 0.f;
      }
    }
    __syncthreads();
    const float *R, *A, *Kr, *Br, *Fin, *Fex;
    if (mi != mj) {
      R = row(0, i), A = row(1, i), Kr = row(2, j), Br = row(3, j);
      Fin = Fex = mi < mj ? zeros : mi - mj == 1 ? ones : gap + (mi - mj == 3 ? 2 : mi - 2) * PSP;
    } else {  // raw rows at the slab (channels >= nd: the zeroed row padding, and F = 0 there)
      R = sm + L.r + i * KP + d0, A = sm + L.a + i * KP + d0;
      Kr = sm + L.k + j * KP + d0, Br = sm + L.b + j * KP + d0;
      Fin = dl == 0 ? ones : dl > 0 ? row(3 + dl, i) : zeros;
      Fex = dl <= 0 ? zeros : dl == 1 ? ones : row(2 + dl, i - 1);
    }
    // Raw rows: no reads past the row's padding. Above the diagonal: nothing to add.
    const int n4 = j > i ? 0 : mi != mj ? PS : (nd + 3) / 4 * 4;
    for (int c = 0; c < n4; c += 4) {
      const float4 r4 = *reinterpret_cast<const float4*>(R + c), a4 = *reinterpret_cast<const float4*>(A + c);
      const float4 k4 = *reinterpret_cast<const float4*>(Kr + c), b4 = *reinterpret_cast<const float4*>(Br + c);
      const float4 fi = *reinterpret_cast<const float4*>(Fin + c), fe = *reinterpret_cast<const float4*>(Fex + c);
      const float r[4] = {r4.x * fi.x, r4.y * fi.y, r4.z * fi.z, r4.w * fi.w};
      const float a[4] = {a4.x * fe.x, a4.y * fe.y, a4.z * fe.z, a4.w * fe.w};
      const float k[4] = {k4.x, k4.y, k4.z, k4.w}, b[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
      for (int u = 0; u < 4; ++u) rk += r[u] * k[u], rb += r[u] * b[u], ak += a[u] * k[u], ab += a[u] * b[u];
    }
  }
}

// The four-row walks of chunk_decays and grad's dw scan (four threads per channel, rows 4 part
// + r) touch the rows of parts 2, 3 in the order r ^ 2: rows 8 apart share banks (8 KP = 0 mod
// 32), so parts p, p + 2 at row r of their groups at once were two-way conflicts. This maps four
// values between that access order and row order (both ways: an involution), with selects, not a
// runtime register index.
template <class X>
__device__ __forceinline__ void swap_halves_if(X (&v)[4], bool sw) {
  const X t0 = v[0], t1 = v[1];
  if (sw) v[0] = v[2], v[1] = v[3], v[2] = t0, v[3] = t1;
}

// exp(G) at `eg` and exp(Omega) at `eo` (rows [C][KP]; eg < 0: not stored) of a loaded chunk and,
// at `ah` when >= 0, Â = a exp(E).
// Four threads per channel, four rows each (all 256 threads: one thread per channel walking all
// 16 rows would keep three warps in four idle at the next barrier). Every
// exponent is a sum of w's (the other rows' totals through shuffles), never a difference. Not
// synchronised. Returns whether every channel this thread saw has a chunk total Gamma >= -bound
// (pair_matrices_tc; NaN: false). gm >= 0: gamma = exp(Gamma) [K] there.
// The bounds of the factored pair matrices: the factors' exponents are prefix sums, whose
// rounding (~2^-24 |G| each) becomes their relative error. 60 keeps every factor a normal float
// and that error far below bf16 / fp16 input rounding; fp32 inputs take 16, where it stays at
// the level of the 3xTF32 products themselves (~1e-6), and RWKV-7's own decays (w >= -exp(-0.5),
// a chunk's total >= -9.7) always factor. Chunks past a bound take the exact pair_matrices.
constexpr float kFactorBound = 60.f, kFactorBoundFp32 = 16.f;
__device__ inline bool chunk_decays(float* sm, const Smem& L, int eg, int eo, int ah = -1, int gm = -1,
                                    float bound = kFactorBound) {
  static_assert(C == 16, "four rows per thread, four threads per channel");
  const int K = L.K, KP = L.KP, part = threadIdx.x % 4, r0 = 4 * part;
  bool bounded = true;
  for (int d0 = 0; d0 < K; d0 += NT / 4) {  // the same trip count on every lane: shuffles below
    const int d = d0 + threadIdx.x / 4;
    const bool on = d < K;
    const int sw = part & 2;  // rows in the order r ^ 2 (swap_halves_if)
    float wl[4], al[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int at = (r0 + (r ^ sw)) * KP + d;
      wl[r] = on ? sm[L.w + at] : 0.f;
      al[r] = on && ah >= 0 ? sm[L.a + at] : 0.f;
    }
    swap_halves_if(wl, sw), swap_halves_if(al, sw);
    const float tot = wl[0] + wl[1] + wl[2] + wl[3];
    float before = 0.f, after = 0.f;  // totals of the rows before and after this thread's four
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float t = __shfl_sync(0xffffffffu, tot, q, 4);
      if (q < part) before += t;
      if (q > part) after += t;
    }
    if (!on) continue;
    bounded = bounded && before + tot + after >= -bound;
    if (gm >= 0 && part == 0) sm[gm + d] = expf(tot + after);
    float run = before, prev = part ? expf(before) : 1.f;  // prev = exp(E_i) = exp(G_{i-1})
    float hv[4], gv[4], ov[4];  // Â, exp(G), exp(Omega) of the four rows
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      hv[r] = al[r] * prev;
      prev = expf(run += wl[r]);
      gv[r] = prev;
    }
    run = after;
#pragma unroll
    for (int r = 3; r >= 0; --r) {
      ov[r] = expf(run);
      run += wl[r];
    }
    swap_halves_if(hv, sw), swap_halves_if(gv, sw), swap_halves_if(ov, sw);  // to the access order
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int at = (r0 + (r ^ sw)) * KP + d;
      if (ah >= 0) sm[ah + at] = hv[r];
      if (eg >= 0) sm[eg + at] = gv[r];
      sm[eo + at] = ov[r];
    }
  }
  return bounded;
}

// The four pair matrices on tensor cores, for a chunk with every channel's total decay Gamma >=
// -kFactorBound (fp32: -kFactorBoundFp32; checked by chunk_decays: a bound relied on, never
// assumed). Then exp(G_i - G_j) = exp(G_i) exp(-G_j) with both factors in [e^-60, e^60]
// (normal floats: nothing overflows or underflows; docs/algorithms.md §2.2 scheme 2 at C = 16), and each matrix is one 16 x 16 x K
// product of rows R^ = r exp(G_i) or Â = a exp(E_i) with rows k exp(-G_j) or b exp(-G_j),
// masked to j <= i (rk, rb) or j < i (ak, ab); exp(-G_j) = exp(Omega_j) / gamma. R^ and Â
// replace the r and a rows (kwide_rows_tc reads them scaled: `factored`); the key rows go to
// the pair workspace. 3xTF32: fp32-accurate, since X = (I - A_ab)^-1 amplifies the errors of
// A_ab. The exponent is a prefix difference, its error ~2^-24 |Gamma| relative (kFactorBound).
// After the flag's barrier; not synchronised at the end.
__device__ __forceinline__ bool factorable(const Smem& L) { return 2 * C * L.KP <= L.pwn; }
__device__ inline void pair_matrices_tc(float* sm, const Smem& L) {
  const int K = L.K, KP = L.KP, kn = (K + 7) / 8 * 8;
  float *const kf = sm + L.pw, *const bf = kf + C * KP;  // k exp(-G), b exp(-G): [C][KP]
  // Four channels a thread (16-byte accesses: a quarter of the load and store instructions of
  // one access per element); a quad that reaches past K element by element.
  const int kq = kn / 4;
  for (int e = threadIdx.x; e < C * kq; e += NT) {
    const int i = e / kq, c = 4 * (e - i * kq), at = i * KP + c;
    if (c + 4 <= K) {
      const float4 eg = ld4(sm + L.eG + at), eo = ld4(sm + L.eO + at), gt = ld4(sm + L.eG + (C - 1) * KP + c);
      const float4 ee = i ? ld4(sm + L.eG + at - KP) : make_float4(1.f, 1.f, 1.f, 1.f);  // exp(E)
      const float4 f = make_float4(__fdividef(eo.x, gt.x), __fdividef(eo.y, gt.y), __fdividef(eo.z, gt.z),
                                   __fdividef(eo.w, gt.w));
      st4(sm + L.a + at, mul4(ld4(sm + L.a + at), ee));
      st4(sm + L.r + at, mul4(ld4(sm + L.r + at), eg));
      st4(kf + at, mul4(ld4(sm + L.k + at), f)), st4(bf + at, mul4(ld4(sm + L.b + at), f));
      continue;
    }
    for (int d = c; d < c + 4; ++d) {
      const int ad = i * KP + d;
      if (d >= K) {  // read by the products' last k-step: exp(G) is unset there
        kf[ad] = bf[ad] = 0.f;
        continue;
      }
      const float eg = sm[L.eG + ad], f = __fdividef(sm[L.eO + ad], sm[L.eG + (C - 1) * KP + d]);
      sm[L.a + ad] *= eE(sm, L, i, d);
      sm[L.r + ad] *= eg;
      kf[ad] = sm[L.k + ad] * f, bf[ad] = sm[L.b + ad] * f;
    }
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
  const int m = warp / 2, j0 = 8 * (warp % 2);
  const bool inc = m < 2;  // A_rk, A_rb: j <= i; A_ak, A_ab: j < i
  const float* pa = sm + (inc ? L.r : L.a) + g * KP + q;
  const float* pb = (m % 2 ? bf : kf) + (j0 + g) * KP + q;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int c0 = 0; c0 < kn; c0 += 8, pa += 8, pb += 8) {
    const float av[4] = {pa[0], pa[8 * KP], pa[4], pa[8 * KP + 4]}, bv[2] = {pb[0], pb[4]};
    tile::mma_tf32x3(acc, av, bv);
  }
  float* const M = sm + L.Ark + m * C * CP;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int i = acc_row(0, e), j = acc_col(j0, e);
    M[i * CP + j] = (inc ? j <= i : j < i) ? acc[e] : 0.f;
  }
}

// CW consecutive channels of a K-row, read as one 8- or 16-byte load.
template <int CW>
struct Chans {
  float v[CW] = {};
  __device__ __forceinline__ static Chans ld(const float* p) {
    Chans r;
    if constexpr (CW == 4) {
      const float4 t = *reinterpret_cast<const float4*>(p);
      r.v[0] = t.x, r.v[1] = t.y, r.v[2] = t.z, r.v[3] = t.w;
    } else if constexpr (CW == 2) {
      const float2 t = *reinterpret_cast<const float2*>(p);
      r.v[0] = t.x, r.v[1] = t.y;
    } else {
#pragma unroll
      for (int c = 0; c < CW; ++c) r.v[c] = p[c];
    }
    return r;
  }
  __device__ __forceinline__ void st(float* p) const {
#pragma unroll
    for (int c = 0; c < CW; ++c) p[c] = v[c];  // adjacent: merged into one vector store
  }
};

// The K-vector gradients of rows i0 .. i0 + R - 1 (i0 a multiple of R), channels [d, d + CW),
// into the gradient rows dr_rows, da_rows, dk_rows, db_rows: the pair parts walk the rows below
// the block (as queries: r, a) and above it (as keys: k, b), multiplying the decay factors up from
// exp(w) (in the w rows: products of <= 15 factors <= 1, a few ulp; no exponential per pair), then
// the state parts st(r, m) (m: sr, sa, sk, sb) of row i0 + r, read as needed (so that the walks'
// registers hold no state part), take their row factors, exp(G) = exp(E)
// exp(w) and exp(Omega): the products the walks end with. One walk serves the R rows, so each
// step's loads (the walked row's k, b, exp(w) or r, a, exp(w), and the rows' dA) serve all R:
// row i0 + r's factor over the shared steps is the first row's times the exp(w) between them
// (queries; keys: the last key's, likewise), applied once at the end, and the steps inside the
// block are added on their own, each with its running factor (which ends as that row's).
template <int CW, int R, class StatePart>
__device__ __forceinline__ void pair_walks(float* sm, const Smem& L, int i0, int d, float rho, StatePart st) {
  using V = Chans<CW>;
  const int KP = L.KP;
  const float *ew = sm + L.w + d, *kr = sm + L.k + d, *br = sm + L.b + d;  // ew: exp(w)
  const float *rr = sm + L.r + d, *ar = sm + L.a + d, *dA = sm + L.dA;
  auto pair = [&](int i, int j) { return ld4(dA + 4 * (i * C + j)); };  // (rk, rb, ak, ab) of (i, j)
  auto ones = [] {
    V v;
#pragma unroll
    for (int c = 0; c < CW; ++c) v.v[c] = 1.f;
    return v;
  };
  // Queries: wr, da per row over the shared steps j < i0, before the row's factor; fex =
  // exp(sum of w_s, j < s < i0).
  V wr[R], da[R], fex = ones();
  for (int j = i0 - 1; j >= 0; --j) {
    const V kj = V::ld(kr + j * KP), bj = V::ld(br + j * KP), ej = V::ld(ew + j * KP);
    V kf, bf;
#pragma unroll
    for (int c = 0; c < CW; ++c) kf.v[c] = kj.v[c] * fex.v[c], bf.v[c] = bj.v[c] * fex.v[c], fex.v[c] *= ej.v[c];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float4 a = pair(i0 + r, j);
#pragma unroll
      for (int c = 0; c < CW; ++c)
        wr[r].v[c] += a.x * kf.v[c] + a.y * bf.v[c], da[r].v[c] += a.z * kf.v[c] + a.w * bf.v[c];
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {  // fex = exp(E_i0) now
    const int I = i0 + r;
    V tw, ta, f = ones();  // the steps j = I - 1 .. i0, f = exp(sum of w_s, j < s < I)
#pragma unroll
    for (int u = r - 1; u >= 0; --u) {
      const int j = i0 + u;
      const float4 a = pair(I, j);
      const V kj = V::ld(kr + j * KP), bj = V::ld(br + j * KP), ej = V::ld(ew + j * KP);
#pragma unroll
      for (int c = 0; c < CW; ++c) {
        const float kf = kj.v[c] * f.v[c], bf = bj.v[c] * f.v[c];
        tw.v[c] += a.x * kf + a.y * bf, ta.v[c] += a.z * kf + a.w * bf, f.v[c] *= ej.v[c];
      }
    }
    const float4 dd = pair(I, I);
    const V eI = V::ld(ew + I * KP), kI = V::ld(kr + I * KP), bI = V::ld(br + I * KP), sr = st(r, 0), sa = st(r, 1);
    V dr, dav;
#pragma unroll
    for (int c = 0; c < CW; ++c) {  // f = exp(sum of w_s, i0 <= s < I): exp(E_I) = fex f
      const float eE = fex.v[c] * f.v[c];
      dr.v[c] = dd.x * kI.v[c] + dd.y * bI.v[c] +
                eI.v[c] * (wr[r].v[c] * f.v[c] + tw.v[c] + sr.v[c] * (rho * eE));
      dav.v[c] = da[r].v[c] * f.v[c] + ta.v[c] + sa.v[c] * eE;
    }
    dr.st(sm + L.dr_rows + I * KP + d), dav.st(sm + L.da_rows + I * KP + d);
  }
  // Keys: dk, db per row over the shared steps i2 > i0 + R - 1, before the key's factor; fex =
  // exp(sum of w_s, i0 + R - 1 < s < i2).
  V dk[R], db[R];
  fex = ones();
  for (int i2 = i0 + R; i2 < C; ++i2) {
    const V e2 = V::ld(ew + i2 * KP), r2 = V::ld(rr + i2 * KP), a2 = V::ld(ar + i2 * KP);
    V re, af;
#pragma unroll
    for (int c = 0; c < CW; ++c) re.v[c] = r2.v[c] * e2.v[c] * fex.v[c], af.v[c] = a2.v[c] * fex.v[c], fex.v[c] *= e2.v[c];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float4 a = pair(i2, i0 + r);
#pragma unroll
      for (int c = 0; c < CW; ++c)
        dk[r].v[c] += a.x * re.v[c] + a.z * af.v[c], db[r].v[c] += a.y * re.v[c] + a.w * af.v[c];
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {  // fex = exp(Omega_{i0 + R - 1}) now
    const int J = i0 + r;
    V tk, tb, f = ones();  // the steps i2 = J + 1 .. i0 + R - 1, f = exp(sum of w_s, J < s < i2)
#pragma unroll
    for (int u = r + 1; u < R; ++u) {
      const int i2 = i0 + u;
      const float4 a = pair(i2, J);
      const V e2 = V::ld(ew + i2 * KP), r2 = V::ld(rr + i2 * KP), a2 = V::ld(ar + i2 * KP);
#pragma unroll
      for (int c = 0; c < CW; ++c) {
        const float re = r2.v[c] * e2.v[c] * f.v[c], af = a2.v[c] * f.v[c];
        tk.v[c] += a.x * re + a.z * af, tb.v[c] += a.y * re + a.w * af, f.v[c] *= e2.v[c];
      }
    }
    const float4 dd = pair(J, J);
    const V rJ = V::ld(rr + J * KP), sk = st(r, 2), sb = st(r, 3);
    V dkv, dbv;
#pragma unroll
    for (int c = 0; c < CW; ++c) {  // f = exp(sum of w_s, J < s <= i0 + R - 1): exp(Omega_J) = fex f
      const float eO = fex.v[c] * f.v[c];
      dkv.v[c] = dd.x * rJ.v[c] + dk[r].v[c] * f.v[c] + tk.v[c] + sk.v[c] * eO;
      dbv.v[c] = dd.y * rJ.v[c] + db[r].v[c] * f.v[c] + tb.v[c] + sb.v[c] * eO;
    }
    dkv.st(sm + L.dk_rows + J * KP + d), dbv.st(sm + L.db_rows + J * KP + d);
  }
}

}  // namespace dplr_chunk_detail
}  // namespace fla
