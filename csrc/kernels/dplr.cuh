// CUDA engine for the DPLR recurrence of kernels/dplr.h (the loops of cpu/dplr.cpp).
//
// One CTA per (sequence, head, tile of BC = kDplrTileCols state columns). Thread layout as the
// diagonal engine's (recurrent.cuh Shape): RG = 8 row groups x 4 columns per warp, 8 warps; a
// thread keeps RPT rows of one column of the fp32 state in registers. Reductions over K (a^T h,
// r^T h, ...) are shuffles across the row groups of a warp. Time advances in chunks of
// kDplrSeg steps whose operands are staged in shared memory (decay already exponentiated); in the
// backward a chunk is exactly one checkpoint segment.
#pragma once
#include "dplr.h"
#include "recurrent.cuh"

namespace fla {
namespace dplr_detail {

using recurrent_detail::from_f;
using recurrent_detail::ld;
using recurrent_detail::mptr;
using recurrent_detail::sum_row_groups;
using recurrent_detail::vptr;

constexpr int BC = kDplrTileCols, RG = 8, CW = 32 / RG, NW = BC / CW, NT = NW * 32, TC = kDplrSeg;
static_assert(BC == 32, "the thread layout covers 32 columns");

// Shared memory of one chunk: five K-vectors [TC][DrP] (r, exp(w), k, a, b) and two column
// vectors [TC][BC] (v, dO), then the backward's column-sum buffers [2][5][NW][DrP].
template <int RPT>
struct Smem {
  static constexpr int DrP = RG * RPT;
  static constexpr size_t stage = size_t(TC) * (5 * DrP + 2 * BC);
  static constexpr size_t reduce = size_t(2) * kNumKGrads * NW * DrP;
  static constexpr size_t fwd_bytes = stage * sizeof(float);
  static constexpr size_t bwd_bytes = (stage + reduce) * sizeof(float);
};

struct Ctx {
  int n, h, ct, c, row0, rg;
  bool cok, writer;
  SeqSpan s;
};

template <int RPT>
__device__ __forceinline__ Ctx context(const DplrPass& p) {
  const int ctiles = dplr_tiles(p.V);
  Ctx x;
  x.ct = blockIdx.x % ctiles;
  const int nh = blockIdx.x / ctiles;
  x.h = nh % p.H, x.n = nh / p.H;
  x.s = seq_span(p.cu_seqlens, x.n, p.T);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  x.rg = lane / CW;
  x.c = x.ct * BC + warp * CW + lane % CW;
  x.cok = x.c < p.V;
  x.writer = x.cok && x.rg == 0;
  x.row0 = x.rg * RPT;
  return x;
}

__device__ __forceinline__ int64_t time_of(const DplrPass& p, const SeqSpan& s, int64_t step) {
  return s.bos + (p.reverse ? s.len - 1 - step : step);
}

// Stages steps [base, base + nt) into shared memory. Padding (rows >= K, columns >= V, steps
// >= nt) is 0 with exp(w) = 1, so padded state entries stay exactly 0.
template <typename T, int RPT>
__device__ __forceinline__ void stage(float* sm, const DplrPass& p, const Ctx& x, int64_t base,
                                      int nt) {
  constexpr int DrP = Smem<RPT>::DrP;
  float *sr = sm, *sl = sr + TC * DrP, *sk = sl + TC * DrP, *sa = sk + TC * DrP;
  float *sb = sa + TC * DrP, *sv = sb + TC * DrP, *sd = sv + TC * BC;
  const int64_t b = x.s.b;
  for (int e = threadIdx.x; e < TC * DrP; e += NT) {
    const int tau = e / DrP, i = e % DrP;
    float r = 0.f, w = 0.f, k = 0.f, a = 0.f, bb = 0.f;
    if (tau < nt && i < p.K) {
      const int64_t t = time_of(p, x.s, base + tau);
      r = ld<T>(p.r, b, t, x.h, i), w = ld<T>(p.w, b, t, x.h, i), k = ld<T>(p.k, b, t, x.h, i);
      a = ld<T>(p.a, b, t, x.h, i), bb = ld<T>(p.b, b, t, x.h, i);
    }
    sr[e] = r, sl[e] = expf(w), sk[e] = k, sa[e] = a, sb[e] = bb;
  }
  for (int e = threadIdx.x; e < TC * BC; e += NT) {
    const int tau = e / BC, c = x.ct * BC + e % BC;
    float v = 0.f, d = 0.f;
    if (tau < nt && c < p.V) {
      const int64_t t = time_of(p, x.s, base + tau);
      v = ld<T>(p.v, b, t, x.h, c);
      if (p.backward()) d = ld<T>(p.dout, b, t, x.h, c);
    }
    sv[e] = v, sd[e] = d;
  }
}

// The staged operands of step tau, for this thread's rows and column.
template <int RPT>
struct StepOps {
  float r[RPT], al[RPT], k[RPT], a[RPT], b[RPT], v, dout;
  __device__ __forceinline__ StepOps(const float* sm, const Ctx& x, int tau) {
    constexpr int DrP = Smem<RPT>::DrP;
    const int o = tau * DrP + x.row0;
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      r[j] = sm[o + j], al[j] = sm[TC * DrP + o + j], k[j] = sm[2 * TC * DrP + o + j];
      a[j] = sm[3 * TC * DrP + o + j], b[j] = sm[4 * TC * DrP + o + j];
    }
    const int cl = x.c - x.ct * BC;
    v = sm[5 * TC * DrP + tau * BC + cl], dout = sm[5 * TC * DrP + TC * BC + tau * BC + cl];
  }
};

// S <- diag(al) S + b (a^T S) + k v^T for this thread's column.
template <int RPT>
__device__ __forceinline__ void advance(float (&S)[RPT], const StepOps<RPT>& o) {
  float sa = 0.f;
#pragma unroll
  for (int j = 0; j < RPT; ++j) sa = fmaf(o.a[j], S[j], sa);
  sa = sum_row_groups<RG>(sa);
#pragma unroll
  for (int j = 0; j < RPT; ++j) S[j] = fmaf(o.al[j], S[j], fmaf(o.b[j], sa, o.k[j] * o.v));
}

template <int RPT>
__device__ __forceinline__ void load_state(float (&S)[RPT], const MatArg& m, const DplrPass& p,
                                           const Ctx& x) {
#pragma unroll
  for (int j = 0; j < RPT; ++j)
    S[j] = (m.on() && x.cok && x.row0 + j < p.K) ? *mptr(m, x.n, x.h, x.row0 + j, x.c) : 0.f;
}
template <int RPT>
__device__ __forceinline__ void store_state(const float (&S)[RPT], const MatArg& m,
                                            const DplrPass& p, const Ctx& x) {
  if (!m.on() || !x.cok) return;
#pragma unroll
  for (int j = 0; j < RPT; ++j)
    if (x.row0 + j < p.K) *mptr(m, x.n, x.h, x.row0 + j, x.c) = S[j];
}

// This thread's rows of a contiguous [K, V] state in a workspace.
__device__ __forceinline__ float* ws_state(void* base, int64_t index, const DplrPass& p,
                                           const Ctx& x) {
  return static_cast<float*>(base) + index * int64_t(p.K) * p.V + int64_t(x.row0) * p.V + x.c;
}

template <typename T, int RPT>
__global__ void __launch_bounds__(NT) dplr_fwd_kernel(const __grid_constant__ DplrPass p) {
  extern __shared__ __align__(16) float sm[];
  const Ctx x = context<RPT>(p);
  float S[RPT];
  load_state(S, p.h0, p, x);
  const float scale = float(p.scale);
  for (int64_t base = 0; base < x.s.len; base += TC) {
    const int nt = x.s.len - base < TC ? int(x.s.len - base) : TC;
    __syncthreads();  // the previous chunk is done with shared memory
    stage<T, RPT>(sm, p, x, base, nt);
    __syncthreads();
    for (int tau = 0; tau < nt; ++tau) {
      const StepOps<RPT> o(sm, x, tau);
      advance(S, o);
      float part0 = 0.f, part1 = 0.f;  // two chains halve the latency of the read
#pragma unroll
      for (int j = 0; j < RPT; j += 2) {
        part0 = fmaf(o.r[j], S[j], part0);
        if (j + 1 < RPT) part1 = fmaf(o.r[j + 1], S[j + 1], part1);
      }
      const float out = sum_row_groups<RG>(part0 + part1) * scale;
      if (x.writer) *vptr<T>(p.o, x.s.b, time_of(p, x.s, base + tau), x.h, x.c) = from_f<T>(out);
    }
  }
  store_state(S, p.hT, p, x);
}

// Sum over the 4 columns of a warp (lanes with the same row group).
__device__ __forceinline__ float sum_warp_columns(float v) {
#pragma unroll
  for (int o = 1; o < CW; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T, int RPT>
__global__ void __launch_bounds__(NT) dplr_bwd_kernel(const __grid_constant__ DplrPass p) {
  constexpr int DrP = Smem<RPT>::DrP;
  extern __shared__ __align__(16) float sm[];
  float* red = sm + Smem<RPT>::stage;  // [2][kNumKGrads][NW][DrP]
  const Ctx x = context<RPT>(p);
  const bool varlen = p.cu_seqlens != nullptr;
  const int64_t slots = dplr_slots(p.T, p.N, varlen);
  auto checkpoint = [&](int64_t j) {
    return ws_state(p.chk, (x.s.b * slots + dplr_slot(x.s, x.n, varlen, j)) * p.H + x.h, p, x);
  };
  auto scratch = [&](int j) {
    return ws_state(p.seg, (int64_t(x.n) * p.H + x.h) * kDplrSeg + j, p, x);
  };
  const int64_t V = p.V;
  auto in_rows = [&](int j) { return x.cok && x.row0 + j < p.K; };

  // Forward sweep: a checkpoint at the start of every segment.
  float S[RPT], D[RPT], hp[RPT];
  load_state(S, p.h0, p, x);
  for (int64_t base = 0; base < x.s.len; base += TC) {
    const int nt = x.s.len - base < TC ? int(x.s.len - base) : TC;
    float* cp = checkpoint(base / TC);
#pragma unroll
    for (int j = 0; j < RPT; ++j)
      if (in_rows(j)) cp[j * V] = S[j];
    __syncthreads();
    stage<T, RPT>(sm, p, x, base, nt);
    __syncthreads();
    for (int tau = 0; tau < nt; ++tau) advance(S, StepOps<RPT>(sm, x, tau));
  }

  // Reverse sweep, one segment at a time: recompute its states into the scratch, then go back.
  load_state(D, p.dht, p, x);
  const float scale = float(p.scale);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int parity = 0;
  for (int64_t seg = (x.s.len + TC - 1) / TC - 1; seg >= 0; --seg) {
    const int64_t base = seg * TC;
    const int nt = x.s.len - base < TC ? int(x.s.len - base) : TC;
    __syncthreads();
    stage<T, RPT>(sm, p, x, base, nt);
    __syncthreads();
    const float* cp = checkpoint(seg);
#pragma unroll
    for (int j = 0; j < RPT; ++j) S[j] = in_rows(j) ? cp[j * V] : 0.f;
    for (int tau = 0; tau < nt; ++tau) {
      float* sp = scratch(tau);
#pragma unroll
      for (int j = 0; j < RPT; ++j)
        if (in_rows(j)) sp[j * V] = S[j];
      advance(S, StepOps<RPT>(sm, x, tau));
    }
    for (int tau = nt - 1; tau >= 0; --tau) {  // S = h_t
      const StepOps<RPT> o(sm, x, tau);
      const int64_t t = time_of(p, x.s, base + tau);
      const float* sp = scratch(tau);
#pragma unroll
      for (int j = 0; j < RPT; ++j) hp[j] = in_rows(j) ? sp[j * V] : 0.f;
      float dv = 0.f, cv = 0.f, e = 0.f;
#pragma unroll
      for (int j = 0; j < RPT; ++j) {
        D[j] = fmaf(scale * o.r[j], o.dout, D[j]);
        dv = fmaf(D[j], o.k[j], dv), cv = fmaf(o.a[j], hp[j], cv), e = fmaf(o.b[j], D[j], e);
      }
      dv = sum_row_groups<RG>(dv), cv = sum_row_groups<RG>(cv), e = sum_row_groups<RG>(e);
      if (x.writer) *vptr<T>(p.dv, x.s.b, t, x.h, x.c) = from_f<T>(dv);
      // Column sums of the K-vector gradients: the warp's 4 columns by shuffles, then the 8
      // warps through shared memory (double-buffered by step, so one barrier per step).
      float* rb = red + parity * (kNumKGrads * NW * DrP);
#pragma unroll
      for (int j = 0; j < RPT; ++j) {
        const float g[kNumKGrads] = {scale * S[j] * o.dout, o.al[j] * D[j] * hp[j], D[j] * o.v,
                                     hp[j] * e, D[j] * cv};
#pragma unroll
        for (int q = 0; q < kNumKGrads; ++q) {
          const float sum = sum_warp_columns(g[q]);
          if (lane % CW == 0) rb[(q * NW + warp) * DrP + x.row0 + j] = sum;
        }
        D[j] = fmaf(o.al[j], D[j], o.a[j] * e);
        S[j] = hp[j];
      }
      __syncthreads();
      for (int i = threadIdx.x; i < kNumKGrads * p.K; i += NT) {
        const int q = i / p.K, row = i % p.K;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) sum += rb[(q * NW + w) * DrP + row];
        float* dst = vptr<float>(p.kg, x.s.b, t, x.h, row) + x.ct * p.kg_tile + q * p.kg_grad;
        *dst = sum;
      }
      parity ^= 1;
    }
  }
  store_state(D, p.dh0, p, x);
}

template <typename T, int RPT>
cudaError_t launch(const DplrPass& p, cudaStream_t stream) {
  const int64_t blocks = int64_t(p.N) * p.H * dplr_tiles(p.V);
  if (blocks == 0) return cudaSuccess;
  const bool bwd = p.backward();
  const size_t smem = bwd ? Smem<RPT>::bwd_bytes : Smem<RPT>::fwd_bytes;
  auto kernel = bwd ? dplr_bwd_kernel<T, RPT> : dplr_fwd_kernel<T, RPT>;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
  }
  kernel<<<unsigned(blocks), NT, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dplr_detail
}  // namespace fla
