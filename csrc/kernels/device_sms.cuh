// The current device's SM count, for launches that pick a kernel variant by how many CTAs fill
// the GPU (a cudaDeviceGetAttribute call: no synchronisation).
#pragma once
#include <cuda_runtime.h>

namespace fla {

inline int device_sm_count() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return 1;
  return n;
}

}  // namespace fla
