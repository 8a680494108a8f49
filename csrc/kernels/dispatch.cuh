// The one dtype switch of the CUDA engines. Each engine instantiates launch<T> in its per-dtype
// .cu files (parallel compilation) and maps the runtime DType to T here.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "tensor_args.h"  // DType

// Declares an engine's launch<T>(const Pass&, cudaStream_t) and its three instantiations.
#define FLA_DECLARE_LAUNCH(fn, Pass)                                          \
  template <typename T>                                                        \
  cudaError_t fn(const Pass& p, cudaStream_t stream);                          \
  extern template cudaError_t fn<float>(const Pass&, cudaStream_t);            \
  extern template cudaError_t fn<__nv_bfloat16>(const Pass&, cudaStream_t);    \
  extern template cudaError_t fn<__half>(const Pass&, cudaStream_t);

namespace fla {

// Calls launch(T{}) for the kernel type of `dt`; nullptr on success, else the CUDA error string.
template <typename Launch>
const char* launch_for_dtype(DType dt, Launch&& launch) {
  cudaError_t e = cudaErrorInvalidValue;
  switch (dt) {
    case DType::f32: e = launch(float{}); break;
    case DType::bf16: e = launch(__nv_bfloat16{}); break;
    case DType::f16: e = launch(__half{}); break;
    case DType::f64: return "float64 is not supported on CUDA";
  }
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace fla

// Defines an engine's host entry `const char* entry(const Pass&, void* stream)`: its launch
// template, declared here and instantiated in the engine's per-dtype .cu files, for the pass's
// dtype. (One line per engine: the entries differ only by these three names.)
#define FLA_ENGINE_ENTRY(entry, launch, Pass)                                              \
  FLA_DECLARE_LAUNCH(launch, Pass)                                                         \
  const char* entry(const Pass& p, void* stream) {                                         \
    const auto s = static_cast<cudaStream_t>(stream);                                      \
    return launch_for_dtype(p.dtype, [&](auto t) { return launch<decltype(t)>(p, s); });   \
  }
