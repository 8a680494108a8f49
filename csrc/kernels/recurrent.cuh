// CUDA engine for the recurrent sweep of kernels/recurrent.h.
//
// One CTA per (sequence, head, 32-column tile); lane = column, warp w owns rows
// [w*RPT, (w+1)*RPT) of the fp32 state in registers, so the read S^T q needs no shuffles, only a
// KS-way sum through shared memory. Time advances in chunks of TC steps: all operands of a chunk
// are staged into shared memory with coalesced loads (decays already exponentiated, exponents
// are always <= 0), then the serial loop touches only registers and broadcast shared reads.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "recurrent.h"
#include "sequence.h"

namespace fla {
namespace recurrent_detail {

constexpr int KS = 8;   // warps per CTA, splitting the rows
constexpr int BC = 32;  // columns per CTA
constexpr int TC = 16;  // time steps per staged chunk

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

template <typename T>
__device__ __forceinline__ T* vptr(const VecArg& v, int64_t b, int64_t t, int h, int d) {
  return const_cast<T*>(static_cast<const T*>(v.ptr)) + b * v.sb + t * v.st + h * v.sh + d * v.sd;
}
template <typename T>
__device__ __forceinline__ float ld(const VecArg& v, int64_t b, int64_t t, int h, int d) {
  return to_f(*vptr<T>(v, b, t, h, d));
}
__device__ __forceinline__ float* fptr(const void* p, int64_t i) {
  return const_cast<float*>(static_cast<const float*>(p)) + i;
}
__device__ __forceinline__ float* mptr(const MatArg& m, int n, int h, int r, int c) {
  return static_cast<float*>(m.ptr) + n * m.sn + h * m.sh + int64_t(r) * m.sr + int64_t(c) * m.sc;
}

// Shared memory per CTA for chunks of `tc` steps (runtime: decode uses tc = 1).
template <int RPT>
__host__ __device__ constexpr size_t smem_floats(int tc) {
  constexpr int DrP = KS * RPT;
  return size_t(tc) * (3 * DrP + 5 * BC + KS * BC + DrP / (DrP < 32 ? DrP : 32)) + KS * BC;
}

// Loads of one chunk, held in registers so that they are in flight during the serial loop of
// the previous chunk (the loop needs ~1 us; a global load ~0.6 us: without this every chunk
// paid several exposed load latencies).
template <int RPT>
struct Prefetch {
  static constexpr int DrP = KS * RPT, NT = KS * 32;
  static constexpr int NR = (TC * DrP + NT - 1) / NT;  // row elements per thread
  static constexpr int NC = (TC * BC + NT - 1) / NT;   // column elements per thread
  float q[NR], a[NR], l[NR], x[NR];
  float b[NC], d[NC], y[NC], z[NC], w[NC];
};

template <typename T, int RPT>
__device__ __forceinline__ void prefetch(Prefetch<RPT>& f, const RecurrentPass& p, const SeqSpan& s,
                                         int64_t base, int tc, int h, int ct) {
  using F = Prefetch<RPT>;
  const int nt = s.len - base < tc ? int(s.len - base) : tc;
#pragma unroll
  for (int j = 0; j < F::NR; ++j) {
    const int e = j * F::NT + threadIdx.x, tau = e / F::DrP, r = e % F::DrP;
    f.q[j] = f.a[j] = f.x[j] = 0.f, f.l[j] = 0.f;
    if (tau < nt && r < p.Dr) {
      const int64_t step = base + tau;
      const int64_t t = s.bos + (p.reverse ? s.len - 1 - step : step);
      f.q[j] = ld<T>(p.q, s.b, t, h, r);
      f.a[j] = ld<T>(p.a, s.b, t, h, r);
      if (p.decay_on_rows) f.l[j] = ld<T>(p.decay, s.b, t, h, r);
      if (p.x.on()) f.x[j] = ld<T>(p.x, s.b, t, h, r);
    }
  }
#pragma unroll
  for (int j = 0; j < F::NC; ++j) {
    const int e = j * F::NT + threadIdx.x, tau = e / BC, cc = ct * BC + e % BC;
    f.b[j] = f.d[j] = f.y[j] = f.z[j] = f.w[j] = 0.f;
    if (tau < nt && cc < p.Dc) {
      const int64_t step = base + tau;
      const int64_t t = s.bos + (p.reverse ? s.len - 1 - step : step);
      f.b[j] = ld<T>(p.b, s.b, t, h, cc);
      if (!p.decay_on_rows) f.d[j] = ld<T>(p.decay, s.b, t, h, cc);
      if (p.x.on()) f.y[j] = ld<T>(p.y, s.b, t, h, cc);
      if (p.gate != GateGrad::None) f.z[j] = ld<T>(p.z, s.b, t, h, cc);
      if (p.gate == GateGrad::Consume) f.w[j] = *vptr<float>(p.ws, s.b, t, h, cc);
    }
  }
}

template <int N>
__device__ __forceinline__ void lds(float (&dst)[N], const float* src) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int j = 0; j < N; j += 4) {
      const float4 v = *reinterpret_cast<const float4*>(src + j);
      dst[j] = v.x, dst[j + 1] = v.y, dst[j + 2] = v.z, dst[j + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) dst[j] = src[j];
  }
}

template <typename T, int RPT>
__global__ void __launch_bounds__(KS * 32) recurrent_kernel(const __grid_constant__ RecurrentPass p, int tc) {
  constexpr int DrP = KS * RPT, NT = KS * 32;
  constexpr int SEG = DrP < 32 ? DrP : 32;  // lanes sharing one step in the row staging
  constexpr int NSEG = DrP / SEG;
  const int ctiles = (p.Dc + BC - 1) / BC;
  const int ct = blockIdx.x % ctiles;
  const int nh = blockIdx.x / ctiles;
  const int h = nh % p.H, n = nh / p.H;
  const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c = ct * BC + lane;
  const bool cok = c < p.Dc;
  const int row0 = warp * RPT;

  extern __shared__ __align__(16) float sm[];
  float* sq = sm;                     // [tc][DrP]  q
  float* sa = sq + tc * DrP;          // [tc][DrP]  a * a_scale
  float* sl = sa + tc * DrP;          // [tc][DrP]  exp(decay) on rows
  float* sb = sl + tc * DrP;          // [tc][BC]   b * b_scale
  float* sdc = sb + tc * BC;          // [tc][BC]   exp(decay) on columns
  float* sy = sdc + tc * BC;          // [tc][BC]   y
  float* sz = sy + tc * BC;           // [tc][BC]   z
  float* sw = sz + tc * BC;           // [tc][BC]   ws (Consume)
  float* spart = sw + tc * BC;        // [tc][KS][BC] partial reads
  float* sbon = spart + tc * KS * BC; // [tc][NSEG] bonus partial sums
  float* sred = sbon + tc * NSEG;     // [KS][BC]

  const float scale = float(p.scale), a_scale = float(p.a_scale), b_scale = float(p.b_scale),
              bonus_scale = float(p.bonus_scale);
  const bool bonus = p.x.on();
  // Each thread stages one fixed row (NT is a multiple of DrP) and fixed columns.
  const int my_row = threadIdx.x % DrP;
  const float ux = (bonus && p.ux && my_row < p.Dr) ? *fptr(p.ux, h * p.Dr + my_row) : 1.f;
  const float uy = (bonus && p.uy && cok) ? *fptr(p.uy, h * p.Dc + c) : 1.f;

  float S[RPT];
#pragma unroll
  for (int j = 0; j < RPT; ++j) {
    const int r = row0 + j;
    S[j] = (p.h0.on() && cok && r < p.Dr) ? *mptr(p.h0, n, h, r, c) : 0.f;
  }
  float acc = 0.f, du = 0.f;
  if (p.gate == GateGrad::Consume && p.zeta && cok) acc = *fptr(p.zeta, (int64_t(n) * p.H + h) * p.Dc + c);

  Prefetch<RPT> f;
  if (s.len > 0) prefetch<T, RPT>(f, p, s, 0, tc, h, ct);
  for (int64_t base = 0; base < s.len; base += tc) {
    const int nt = s.len - base < tc ? int(s.len - base) : tc;
    __syncthreads();  // the previous epilogue is done with shared memory
#pragma unroll
    for (int j = 0; j < Prefetch<RPT>::NR; ++j) {
      const int e = j * NT + threadIdx.x, tau = e / DrP;
      float bon = f.q[j] * f.x[j] * ux;
#pragma unroll
      for (int o = SEG / 2; o > 0; o >>= 1) bon += __shfl_xor_sync(0xffffffffu, bon, o);
      if (tau < tc) {
        sq[e] = f.q[j], sa[e] = f.a[j] * a_scale, sl[e] = expf(f.l[j]);
        if (e % SEG == 0) sbon[tau * NSEG + (e % DrP) / SEG] = bon;
      }
    }
#pragma unroll
    for (int j = 0; j < Prefetch<RPT>::NC; ++j) {
      const int e = j * NT + threadIdx.x;
      if (e < tc * BC) {
        sb[e] = f.b[j] * b_scale, sdc[e] = expf(f.d[j]), sy[e] = f.y[j], sz[e] = f.z[j], sw[e] = f.w[j];
      }
    }
    __syncthreads();
    if (base + tc < s.len) prefetch<T, RPT>(f, p, s, base + tc, tc, h, ct);

    // The serial part: registers and broadcast shared reads only.
    for (int tau = 0; tau < nt; ++tau) {
      float q[RPT], a[RPT];
      lds(q, sq + tau * DrP + row0);
      lds(a, sa + tau * DrP + row0);
      const float bv = sb[tau * BC + lane];
      float part = 0.f;
      if (p.exclusive) {
#pragma unroll
        for (int j = 0; j < RPT; ++j) part = fmaf(q[j], S[j], part);
      }
      if (p.decay_on_rows) {
        float l[RPT];
        lds(l, sl + tau * DrP + row0);
#pragma unroll
        for (int j = 0; j < RPT; ++j) S[j] = fmaf(l[j], S[j], a[j] * bv);
      } else {
        const float dc = sdc[tau * BC + lane];
#pragma unroll
        for (int j = 0; j < RPT; ++j) S[j] = fmaf(dc, S[j], a[j] * bv);
      }
      if (!p.exclusive) {
#pragma unroll
        for (int j = 0; j < RPT; ++j) part = fmaf(q[j], S[j], part);
      }
      spart[(tau * KS + warp) * BC + lane] = part;
    }
    __syncthreads();

    // Epilogue: sum the KS partial reads. Consume carries a running sum over steps, so one warp
    // walks them in order; otherwise the warps share the steps.
    const bool consume = p.gate == GateGrad::Consume;
    if (cok && (!consume || warp == 0)) {
      for (int tau = consume ? 0 : warp; tau < nt; tau += consume ? 1 : KS) {
        const int64_t step = base + tau;
        const int64_t t = s.bos + (p.reverse ? s.len - 1 - step : step);
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < KS; ++w) sum += spart[(tau * KS + w) * BC + lane];
        const float pc = sum * scale;
        float bsum = 0.f;
#pragma unroll
        for (int g = 0; g < NSEG; ++g) bsum += sbon[tau * NSEG + g];
        const float yb = bonus ? bonus_scale * bsum * sy[tau * BC + lane] : 0.f;
        if (p.out.on()) *vptr<T>(p.out, s.b, t, h, c) = from_f<T>(pc + yb * uy);
        if (p.gate == GateGrad::Produce) {
          *vptr<float>(p.ws, s.b, t, h, c) = sz[tau * BC + lane] * pc;
        } else if (consume) {
          const float z = sz[tau * BC + lane];
          acc -= z * pc;
          if (sdc[tau * BC + lane] == 0.f) acc = 0.f;
          *vptr<T>(p.dlam, s.b, t, h, c) = from_f<T>(acc);
          acc += sw[tau * BC + lane];
          du = fmaf(yb, z, du);
        }
      }
    }
  }

  if (p.hT.on() && cok) {
#pragma unroll
    for (int j = 0; j < RPT; ++j)
      if (row0 + j < p.Dr) *mptr(p.hT, n, h, row0 + j, c) = S[j];
  }
  if (p.gate == GateGrad::Produce && p.zeta) {
    float z = 0.f;
    if (p.zdot.on() && cok) {
#pragma unroll
      for (int j = 0; j < RPT; ++j)
        if (row0 + j < p.Dr) z = fmaf(S[j], *mptr(p.zdot, n, h, row0 + j, c), z);
    }
    __syncthreads();
    sred[warp * BC + lane] = z;
    __syncthreads();
    if (warp == 0 && cok) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < KS; ++w) sum += sred[w * BC + lane];
      *fptr(p.zeta, (int64_t(n) * p.H + h) * p.Dc + c) = sum;
    }
  }
  if (p.gate == GateGrad::Consume && p.du && warp == 0 && cok)
    *fptr(p.du, (int64_t(n) * p.H + h) * p.Dc + c) = du;
}

template <typename T, int RPT>
cudaError_t launch(const RecurrentPass& p, cudaStream_t stream) {
  const int ctiles = (p.Dc + BC - 1) / BC;
  const int64_t blocks = int64_t(p.N) * p.H * ctiles;
  if (blocks == 0) return cudaSuccess;
  // Without cu_seqlens the longest sequence is T: short ones (decode) get small chunks.
  const int tc = (p.cu_seqlens == nullptr && p.T < TC) ? (p.T > 0 ? p.T : 1) : TC;
  const size_t smem = smem_floats<RPT>(tc) * sizeof(float);
  auto kernel = recurrent_kernel<T, RPT>;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
  }
  kernel<<<unsigned(blocks), KS * 32, smem, stream>>>(p, tc);
  return cudaGetLastError();
}

}  // namespace recurrent_detail

// Rows per thread is the only compile-time size: the smallest of 2..32 that covers Dr.
template <typename T>
cudaError_t launch_recurrent(const RecurrentPass& p, cudaStream_t stream) {
  using namespace recurrent_detail;
  if (p.Dr <= KS * 2) return launch<T, 2>(p, stream);
  if (p.Dr <= KS * 4) return launch<T, 4>(p, stream);
  if (p.Dr <= KS * 8) return launch<T, 8>(p, stream);
  if (p.Dr <= KS * 16) return launch<T, 16>(p, stream);
  return launch<T, 32>(p, stream);
}

}  // namespace fla
