#include "dplr.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace fla {

template <typename T>
cudaError_t launch_dplr(const DplrPass& p, cudaStream_t stream);
extern template cudaError_t launch_dplr<float>(const DplrPass&, cudaStream_t);
extern template cudaError_t launch_dplr<__nv_bfloat16>(const DplrPass&, cudaStream_t);
extern template cudaError_t launch_dplr<__half>(const DplrPass&, cudaStream_t);

const char* dplr_cuda(const DplrPass& p, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::f32: e = launch_dplr<float>(p, s); break;
    case DType::bf16: e = launch_dplr<__nv_bfloat16>(p, s); break;
    case DType::f16: e = launch_dplr<__half>(p, s); break;
    case DType::f64: return "float64 is not supported on CUDA";
  }
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace fla
