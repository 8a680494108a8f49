// One-step specialisation of the recurrent sweep (kernels/recurrent.h) for decoding: T == 1, no
// cu_seqlens, no gate gradients. Decode is a pass over the fp32 states (read h0, write hT), so
// its layout is chosen for bytes in flight: a thread owns 4 consecutive columns (16-byte state
// accesses) of RPT rows, 16 row groups x 64 columns per 256-thread CTA, few registers.
#pragma once
#include "recurrent.cuh"

namespace fla {
namespace decode_detail {

using recurrent_detail::ld;
using recurrent_detail::ldu;
using recurrent_detail::vptr;
using recurrent_detail::from_f;
using recurrent_detail::put;

constexpr int NT = 256, CQ = 16, COLS = 4 * CQ, RGS = NT / CQ;  // 16 quads x 16 row groups

// A state every 16-byte access of the decode kernels can address (or none).
inline bool vec4_state(const MatArg& m) {
  return !m.on() || (m.sc == 1 && m.sr % 4 == 0 && m.sh % 4 == 0 && m.sn % 4 == 0 &&
                     elements::aligned16(m.ptr));
}

// The sweep is a decode step this kernel can take: one token, plain outputs, 16-byte state rows.
inline bool fits(const RecurrentPass& p) {
  const bool order = p.order == Order::ReadFirst || p.order == Order::ReadLast ||
                     p.order == Order::DecayLast;  // the exact-gradient orders: the sweep kernel
  return p.T == 1 && p.cu_seqlens == nullptr && p.gate == GateGrad::None && p.Dc % 4 == 0 &&
         order && vec4_state(p.h0) && vec4_state(p.hT);
}

__device__ __forceinline__ float4 mload(const MatArg& m, int n, int h, int r, int c) {
  return *reinterpret_cast<const float4*>(static_cast<const float*>(m.ptr) + n * m.sn + h * m.sh +
                                          int64_t(r) * m.sr + c);
}
__device__ __forceinline__ void mstore(const MatArg& m, int n, int h, int r, int c, float4 v) {
  *reinterpret_cast<float4*>(static_cast<float*>(m.ptr) + n * m.sn + h * m.sh + int64_t(r) * m.sr + c) = v;
}

template <typename T, int RPT>
__global__ void __launch_bounds__(NT) decode_kernel(const __grid_constant__ RecurrentPass p) {
  const int ctiles = (p.Dc + COLS - 1) / COLS;
  const int ct = blockIdx.x % ctiles, nh = blockIdx.x / ctiles;
  const int h = nh % p.H, n = nh / p.H;
  const int tid = threadIdx.x, quad = tid % CQ, rg = tid / CQ;
  const int c0 = ct * COLS + quad * 4;
  const bool cok = c0 < p.Dc;
  const int64_t b = n, t = 0;

  // The state loads go out first: everything else is small and overlaps with them.
  float4 S[RPT];
#pragma unroll
  for (int j = 0; j < RPT; ++j) {
    const int r = rg * RPT + j;
    S[j] = (p.h0.on() && cok && r < p.Dr) ? mload(p.h0, n, h, r, c0) : make_float4(0.f, 0.f, 0.f, 0.f);
  }

  __shared__ float sq[RGS * RPT], sa[RGS * RPT], sl[RGS * RPT];
  __shared__ float sb[COLS], sdc[COLS], sy[COLS], sred[NT / 32][COLS], sbon[NT / 32];
  const bool bonus = p.x.on();
  float bon = 0.f;
  for (int r = tid; r < RGS * RPT; r += NT) {
    float q = 0.f, a = 0.f, l = 1.f;
    if (r < p.Dr) {
      q = ld<T>(p.q, b, t, h, r);
      a = ld<T>(p.a, b, t, h, r) * float(p.a_scale);
      if (p.row_decay.on()) l = expf(ld<T>(p.row_decay, b, t, h, r));
      if (bonus) bon += q * ld<T>(p.x, b, t, h, r) * (p.ux ? ldu(p.ux, h * p.Dr + r, p.udtype) : 1.f);
    }
    sq[r] = q, sa[r] = a, sl[r] = l;
  }
  if (tid < COLS) {
    const int c = ct * COLS + tid;
    const bool ok = c < p.Dc;
    sb[tid] = ok ? ld<T>(p.b, b, t, h, c) * float(p.b_scale) : 0.f;
    sdc[tid] = (ok && p.col_decay.on()) ? expf(ld<T>(p.col_decay, b, t, h, c)) : 1.f;
    sy[tid] = (ok && bonus) ? ld<T>(p.y, b, t, h, c) * (p.uy ? ldu(p.uy, h * p.Dc + c, p.udtype) : 1.f) : 0.f;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) bon += __shfl_xor_sync(0xffffffffu, bon, o);
  if (tid % 32 == 0) sbon[tid / 32] = bon;
  __syncthreads();

  const int cl = quad * 4;
  const float4 bv = make_float4(sb[cl], sb[cl + 1], sb[cl + 2], sb[cl + 3]);
  const float4 dc = make_float4(sdc[cl], sdc[cl + 1], sdc[cl + 2], sdc[cl + 3]);
  float4 part = make_float4(0.f, 0.f, 0.f, 0.f);
  auto read = [&] {
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const float q = sq[rg * RPT + j];
      part.x = fmaf(q, S[j].x, part.x), part.y = fmaf(q, S[j].y, part.y);
      part.z = fmaf(q, S[j].z, part.z), part.w = fmaf(q, S[j].w, part.w);
    }
  };
  const bool decay_last = p.order == Order::DecayLast;
  if (p.order == Order::ReadFirst) read();
#pragma unroll
  for (int j = 0; j < RPT; ++j) {
    const float a = sa[rg * RPT + j], l = decay_last ? 1.f : sl[rg * RPT + j];
    const float4 d = decay_last ? make_float4(1.f, 1.f, 1.f, 1.f) : dc;
    S[j].x = fmaf(l * d.x, S[j].x, a * bv.x), S[j].y = fmaf(l * d.y, S[j].y, a * bv.y);
    S[j].z = fmaf(l * d.z, S[j].z, a * bv.z), S[j].w = fmaf(l * d.w, S[j].w, a * bv.w);
  }
  if (p.order != Order::ReadFirst) read();
  if (decay_last) {
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const float l = sl[rg * RPT + j];
      S[j].x *= l * dc.x, S[j].y *= l * dc.y, S[j].z *= l * dc.z, S[j].w *= l * dc.w;
    }
  }
  if (p.hT.on() && cok) {
#pragma unroll
    for (int j = 0; j < RPT; ++j)
      if (rg * RPT + j < p.Dr) mstore(p.hT, n, h, rg * RPT + j, c0, S[j]);
  }

  // Sum the 16 row groups: the two in a warp by a shuffle, the 8 warps through shared memory.
  part.x += __shfl_xor_sync(0xffffffffu, part.x, 16), part.y += __shfl_xor_sync(0xffffffffu, part.y, 16);
  part.z += __shfl_xor_sync(0xffffffffu, part.z, 16), part.w += __shfl_xor_sync(0xffffffffu, part.w, 16);
  if (tid % 32 < CQ) {
    float* dst = sred[tid / 32] + cl;
    dst[0] = part.x, dst[1] = part.y, dst[2] = part.z, dst[3] = part.w;
  }
  __syncthreads();
  if (tid < COLS && p.out.on() && ct * COLS + tid < p.Dc) {
    float sum = 0.f, bsum = 0.f;
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) sum += sred[w][tid], bsum += sbon[w];
    const float o = sum * float(p.scale) + float(p.bonus_scale) * bsum * sy[tid];
    put<T>(p.out, p.out_acc, b, t, h, ct * COLS + tid, o);
  }
}

template <typename T>
cudaError_t launch(const RecurrentPass& p, cudaStream_t stream) {
  const int64_t blocks = int64_t(p.N) * p.H * ((p.Dc + COLS - 1) / COLS);
  if (blocks == 0) return cudaSuccess;
  auto go = [&](auto kernel) {
    kernel<<<unsigned(blocks), NT, 0, stream>>>(p);
    return cudaGetLastError();
  };
  if (p.Dr <= RGS * 1) return go(decode_kernel<T, 1>);
  if (p.Dr <= RGS * 2) return go(decode_kernel<T, 2>);
  if (p.Dr <= RGS * 4) return go(decode_kernel<T, 4>);
  if (p.Dr <= RGS * 8) return go(decode_kernel<T, 8>);
  return go(decode_kernel<T, 16>);
}

}  // namespace decode_detail
}  // namespace fla
