// Element access shared by the CUDA engines: dtype conversion and strided VecArg / MatArg
// addressing (all arithmetic is fp32; inputs are read and outputs written in their own dtype).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "tensor_args.h"  // DType, VecArg, MatArg

namespace fla {
namespace elements {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

// Element offset of (b, t, h, d) in v: one offset serves several arrays that share strides.
__device__ __forceinline__ int64_t voff(const VecArg& v, int64_t b, int64_t t, int h, int d) {
  return b * v.sb + t * v.st + h * v.sh + d * v.sd;
}
template <typename T>
__device__ __forceinline__ T* vptr(const VecArg& v, int64_t b, int64_t t, int h, int d) {
  return const_cast<T*>(static_cast<const T*>(v.ptr)) + voff(v, b, t, h, d);
}
template <typename T>
__device__ __forceinline__ float ld(const VecArg& v, int64_t b, int64_t t, int h, int d) {
  return to_f(*vptr<T>(v, b, t, h, d));
}
// An output element in the output dtype, or in fp32 where `acc` (an o / dq written from the
// accumulators: ChunkPass::o_acc / dq_acc, RecurrentPass::out_acc).
template <typename T>
__device__ __forceinline__ void put(const VecArg& v, bool acc, int64_t b, int64_t t, int h, int d,
                                    float x) {
  if (acc) *vptr<float>(v, b, t, h, d) = x;
  else *vptr<T>(v, b, t, h, d) = from_f<T>(x);
}
__device__ __forceinline__ float* fptr(const void* p, int64_t i) {
  return const_cast<float*>(static_cast<const float*>(p)) + i;
}
__device__ __forceinline__ float ldu(const void* u, int64_t i, DType dt) {
  switch (dt) {
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(u)[i]);
    case DType::f16: return __half2float(static_cast<const __half*>(u)[i]);
    default: return static_cast<const float*>(u)[i];
  }
}
FLA_HD bool aligned16(const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; }
// Whether every row of v (n elements of e to a 16-byte piece) is whole pieces at 16-byte aligned
// addresses: rows can then move 16 bytes at a time.
FLA_HD bool rows_in_pieces(const VecArg& v, int n, int e) {
  return v.sd == 1 && n % e == 0 && v.sb % e == 0 && v.st % e == 0 && v.sh % e == 0 && aligned16(v.ptr);
}
__device__ __forceinline__ float* mptr(const MatArg& m, int n, int h, int r, int c) {
  return static_cast<float*>(m.ptr) + n * m.sn + h * m.sh + int64_t(r) * m.sr + int64_t(c) * m.sc;
}

}  // namespace elements
}  // namespace fla
