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

constexpr int KS = 4;   // warps per CTA, splitting the rows
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

template <int RPT>
constexpr size_t smem_floats() {
  return size_t(3) * TC * KS * RPT + size_t(5) * TC * BC + size_t(TC) * KS * BC + TC + KS * BC;
}

template <typename T, int RPT>
__global__ void __launch_bounds__(KS * 32) recurrent_kernel(const __grid_constant__ RecurrentPass p) {
  constexpr int DrP = KS * RPT;
  const int ctiles = (p.Dc + BC - 1) / BC;
  const int ct = blockIdx.x % ctiles;
  const int nh = blockIdx.x / ctiles;
  const int h = nh % p.H, n = nh / p.H;
  const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c = ct * BC + lane;
  const bool cok = c < p.Dc;
  const int row0 = warp * RPT;

  extern __shared__ float sm[];
  float* sq = sm;                 // [TC][DrP]  q
  float* sa = sq + TC * DrP;      // [TC][DrP]  a * a_scale
  float* sl = sa + TC * DrP;      // [TC][DrP]  exp(decay) on rows
  float* sb = sl + TC * DrP;      // [TC][BC]   b * b_scale
  float* sdc = sb + TC * BC;      // [TC][BC]   exp(decay) on columns
  float* sy = sdc + TC * BC;      // [TC][BC]   bonus_scale * s_t * y * uy (0 without bonus)
  float* sz = sy + TC * BC;       // [TC][BC]   z
  float* sw = sz + TC * BC;       // [TC][BC]   ws (Consume)
  float* spart = sw + TC * BC;    // [TC][KS][BC] partial reads
  float* sbon = spart + TC * KS * BC;  // [TC] bonus scalars
  float* sred = sbon + TC;        // [KS][BC]

  float S[RPT];
#pragma unroll
  for (int j = 0; j < RPT; ++j) {
    const int r = row0 + j;
    S[j] = (p.h0.on() && cok && r < p.Dr) ? *mptr(p.h0, n, h, r, c) : 0.f;
  }
  float acc = 0.f, du = 0.f;
  if (p.gate == GateGrad::Consume && p.zeta && cok) acc = *fptr(p.zeta, (int64_t(n) * p.H + h) * p.Dc + c);
  const bool bonus = p.x.on();
  const float scale = float(p.scale), a_scale = float(p.a_scale), b_scale = float(p.b_scale),
              bonus_scale = float(p.bonus_scale);

  for (int64_t base = 0; base < s.len; base += TC) {
    const int nt = s.len - base < TC ? int(s.len - base) : TC;
    // Stage the row operands; warp w takes steps w, w+KS, ... and reduces the bonus scalar.
    for (int tau = warp; tau < TC; tau += KS) {
      const int64_t step = base + tau;
      const int64_t t = s.bos + (p.reverse ? s.len - 1 - step : step);
      float bon = 0.f;
      for (int r = lane; r < DrP; r += 32) {
        float qv = 0.f, av = 0.f, lv = 1.f;
        if (tau < nt && r < p.Dr) {
          qv = ld<T>(p.q, s.b, t, h, r);
          av = ld<T>(p.a, s.b, t, h, r) * a_scale;
          if (p.decay_on_rows) lv = expf(ld<T>(p.decay, s.b, t, h, r));
          if (bonus) bon += qv * ld<T>(p.x, s.b, t, h, r) * (p.ux ? *fptr(p.ux, h * p.Dr + r) : 1.f);
        }
        sq[tau * DrP + r] = qv, sa[tau * DrP + r] = av, sl[tau * DrP + r] = lv;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) bon += __shfl_xor_sync(0xffffffffu, bon, o);
      if (lane == 0) sbon[tau] = bon;
    }
    // Stage the column operands.
    for (int i = threadIdx.x; i < TC * BC; i += KS * 32) {
      const int tau = i / BC, cc = ct * BC + i % BC;
      const int64_t step = base + tau;
      const int64_t t = s.bos + (p.reverse ? s.len - 1 - step : step);
      float bv = 0.f, dv = 1.f, zv = 0.f, wv = 0.f;
      if (tau < nt && cc < p.Dc) {
        bv = ld<T>(p.b, s.b, t, h, cc) * b_scale;
        if (!p.decay_on_rows) dv = expf(ld<T>(p.decay, s.b, t, h, cc));
        if (p.gate != GateGrad::None) zv = ld<T>(p.z, s.b, t, h, cc);
        if (p.gate == GateGrad::Consume) wv = *vptr<float>(p.ws, s.b, t, h, cc);
      }
      sb[i] = bv, sdc[i] = dv, sz[i] = zv, sw[i] = wv;
    }
    __syncthreads();
    // Bonus factor per (step, column), now that the scalars exist.
    for (int i = threadIdx.x; i < TC * BC; i += KS * 32) {
      const int tau = i / BC, cc = ct * BC + i % BC;
      const int64_t step = base + tau;
      const int64_t t = s.bos + (p.reverse ? s.len - 1 - step : step);
      float yv = 0.f;
      if (bonus && tau < nt && cc < p.Dc)
        yv = bonus_scale * sbon[tau] * ld<T>(p.y, s.b, t, h, cc);
      sy[i] = yv;
    }
    // The serial part: registers and broadcast shared reads only.
    for (int tau = 0; tau < nt; ++tau) {
      const float* q = sq + tau * DrP + row0;
      const float* a = sa + tau * DrP + row0;
      const float* l = sl + tau * DrP + row0;
      const float bv = sb[tau * BC + lane];
      float part = 0.f;
      if (p.exclusive) {
#pragma unroll
        for (int j = 0; j < RPT; ++j) part = fmaf(q[j], S[j], part);
      }
      if (p.decay_on_rows) {
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
    // Epilogue: warp 0 sums the KS partial reads in step order (Consume needs the order).
    if (warp == 0 && cok) {
      for (int tau = 0; tau < nt; ++tau) {
        const int64_t step = base + tau;
        const int64_t t = s.bos + (p.reverse ? s.len - 1 - step : step);
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < KS; ++w) sum += spart[(tau * KS + w) * BC + lane];
        const float pc = sum * scale;
        const float yb = sy[tau * BC + lane];
        if (p.out.on())
          *vptr<T>(p.out, s.b, t, h, c) = from_f<T>(pc + yb * (p.uy ? *fptr(p.uy, h * p.Dc + c) : 1.f));
        if (p.gate == GateGrad::Produce) {
          *vptr<float>(p.ws, s.b, t, h, c) = sz[tau * BC + lane] * pc;
        } else if (p.gate == GateGrad::Consume) {
          const float z = sz[tau * BC + lane];
          acc -= z * pc;
          if (sdc[tau * BC + lane] == 0.f) acc = 0.f;
          *vptr<T>(p.dlam, s.b, t, h, c) = from_f<T>(acc);
          acc += sw[tau * BC + lane];
          du = fmaf(yb, z, du);
        }
      }
    }
    __syncthreads();
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
  const size_t smem = smem_floats<RPT>() * sizeof(float);
  auto kernel = recurrent_kernel<T, RPT>;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
  }
  kernel<<<unsigned(blocks), KS * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace recurrent_detail

// Rows per thread is the only compile-time size: the smallest of 4..64 that covers Dr.
template <typename T>
cudaError_t launch_recurrent(const RecurrentPass& p, cudaStream_t stream) {
  using namespace recurrent_detail;
  if (p.Dr <= KS * 4) return launch<T, 4>(p, stream);
  if (p.Dr <= KS * 8) return launch<T, 8>(p, stream);
  if (p.Dr <= KS * 16) return launch<T, 16>(p, stream);
  if (p.Dr <= KS * 32) return launch<T, 32>(p, stream);
  return launch<T, 64>(p, stream);
}

}  // namespace fla
