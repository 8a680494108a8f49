// One-token forward of the DPLR recurrence (kernels/dplr.h) for decoding: T == 1, no
// cu_seqlens. Decode is a pass over the fp32 states (read h0, write hT), so the layout is chosen
// for bytes in flight, as in recurrent_decode.cuh: a thread owns 4 consecutive columns (16-byte
// state accesses) of RPT rows, 16 row groups x 64 columns per 256-thread CTA. The two reductions
// over K (a^T h before the update, r^T h after it) go through shuffles and shared memory.
#pragma once
#include "dplr.h"
#include "recurrent_decode.cuh"

namespace fla {
namespace dplr_decode_detail {

using decode_detail::COLS;
using decode_detail::CQ;
using decode_detail::mload;
using decode_detail::mstore;
using decode_detail::NT;
using decode_detail::RGS;
using decode_detail::vec4_state;
using recurrent_detail::from_f;
using recurrent_detail::ld;
using recurrent_detail::vptr;

inline bool fits(const DplrPass& p) {
  return !p.backward() && p.T == 1 && p.cu_seqlens == nullptr && p.V % 4 == 0 &&
         vec4_state(p.h0) && vec4_state(p.hT);
}

__device__ __forceinline__ float4 fma4(float s, float4 x, float4 y) {
  return make_float4(fmaf(s, x.x, y.x), fmaf(s, x.y, y.y), fmaf(s, x.z, y.z), fmaf(s, x.w, y.w));
}

// The sum over the 16 row groups of each thread's float4 `part`, for the thread's columns: the
// two row groups of a warp by a shuffle, the 8 warps through shared memory.
__device__ __forceinline__ float4 sum_rows(float4 part, float (*sred)[COLS], int cl) {
  const int tid = threadIdx.x;
  part.x += __shfl_xor_sync(0xffffffffu, part.x, 16), part.y += __shfl_xor_sync(0xffffffffu, part.y, 16);
  part.z += __shfl_xor_sync(0xffffffffu, part.z, 16), part.w += __shfl_xor_sync(0xffffffffu, part.w, 16);
  __syncthreads();  // a previous reader of sred is done
  if (tid % 32 < CQ) *reinterpret_cast<float4*>(sred[tid / 32] + cl) = part;
  __syncthreads();
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int w = 0; w < NT / 32; ++w) {
    const float4 v = *reinterpret_cast<const float4*>(sred[w] + cl);
    sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
  }
  return sum;
}

template <typename T, int RPT>
__global__ void __launch_bounds__(NT) dplr_decode_kernel(const __grid_constant__ DplrPass p) {
  const int ctiles = (p.V + COLS - 1) / COLS;
  const int ct = blockIdx.x % ctiles, nh = blockIdx.x / ctiles;
  const int h = nh % p.H, n = nh / p.H;
  const int tid = threadIdx.x, quad = tid % CQ, rg = tid / CQ;
  const int cl = quad * 4, c0 = ct * COLS + cl;
  const bool cok = c0 < p.V;  // V % 4 == 0: a quad is all in or all out
  const int64_t b = n, t = 0;

  // The state loads go out first: everything else is small and overlaps with them.
  float4 S[RPT];
#pragma unroll
  for (int j = 0; j < RPT; ++j) {
    const int r = rg * RPT + j;
    S[j] = (p.h0.on() && cok && r < p.K) ? mload(p.h0, n, h, r, c0) : make_float4(0.f, 0.f, 0.f, 0.f);
  }

  __shared__ float sr[RGS * RPT], sl[RGS * RPT], sk[RGS * RPT], sa[RGS * RPT], sb[RGS * RPT];
  __shared__ __align__(16) float sv[COLS];
  __shared__ __align__(16) float sred[NT / 32][COLS];
  for (int i = tid; i < RGS * RPT; i += NT) {
    const bool ok = i < p.K;
    sr[i] = ok ? ld<T>(p.r, b, t, h, i) : 0.f;
    sl[i] = ok ? expf(ld<T>(p.w, b, t, h, i)) : 1.f;
    sk[i] = ok ? ld<T>(p.k, b, t, h, i) : 0.f;
    sa[i] = ok ? ld<T>(p.a, b, t, h, i) : 0.f;
    sb[i] = ok ? ld<T>(p.b, b, t, h, i) : 0.f;
  }
  if (tid < COLS) sv[tid] = ct * COLS + tid < p.V ? ld<T>(p.v, b, t, h, ct * COLS + tid) : 0.f;
  __syncthreads();

  float4 part = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int j = 0; j < RPT; ++j) part = fma4(sa[rg * RPT + j], S[j], part);
  const float4 s_a = sum_rows(part, sred, cl);  // a^T h_{t-1} for the thread's columns
  const float4 v = *reinterpret_cast<const float4*>(sv + cl);
  part = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int j = 0; j < RPT; ++j) {
    const int r = rg * RPT + j;
    const float l = sl[r], bb = sb[r], k = sk[r];
    S[j].x = fmaf(l, S[j].x, fmaf(bb, s_a.x, k * v.x));
    S[j].y = fmaf(l, S[j].y, fmaf(bb, s_a.y, k * v.y));
    S[j].z = fmaf(l, S[j].z, fmaf(bb, s_a.z, k * v.z));
    S[j].w = fmaf(l, S[j].w, fmaf(bb, s_a.w, k * v.w));
    part = fma4(sr[r], S[j], part);
  }
  if (p.hT.on() && cok) {
#pragma unroll
    for (int j = 0; j < RPT; ++j)
      if (rg * RPT + j < p.K) mstore(p.hT, n, h, rg * RPT + j, c0, S[j]);
  }
  const float4 o = sum_rows(part, sred, cl);
  if (rg == 0 && cok) {
    const float s = float(p.scale);
    *vptr<T>(p.o, b, t, h, c0) = from_f<T>(s * o.x), *vptr<T>(p.o, b, t, h, c0 + 1) = from_f<T>(s * o.y);
    *vptr<T>(p.o, b, t, h, c0 + 2) = from_f<T>(s * o.z), *vptr<T>(p.o, b, t, h, c0 + 3) = from_f<T>(s * o.w);
  }
}

template <typename T>
cudaError_t launch(const DplrPass& p, cudaStream_t stream) {
  const int64_t blocks = int64_t(p.N) * p.H * ((p.V + COLS - 1) / COLS);
  if (blocks == 0) return cudaSuccess;
  auto go = [&](auto kernel) {
    kernel<<<unsigned(blocks), NT, 0, stream>>>(p);
    return cudaGetLastError();
  };
  if (p.K <= RGS * 1) return go(dplr_decode_kernel<T, 1>);
  if (p.K <= RGS * 2) return go(dplr_decode_kernel<T, 2>);
  if (p.K <= RGS * 4) return go(dplr_decode_kernel<T, 4>);
  if (p.K <= RGS * 8) return go(dplr_decode_kernel<T, 8>);
  return go(dplr_decode_kernel<T, 16>);
}

}  // namespace dplr_decode_detail
}  // namespace fla
