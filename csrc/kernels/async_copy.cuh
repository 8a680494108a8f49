// Asynchronous global -> shared copies (cp.async) shared by the CUDA engines. The host branches
// (synchronous copies) serve tests/cuda_emu, which runs the kernels on the CPU.
#pragma once
#include <cuda_runtime.h>

namespace fla {

// 16-byte global -> shared copy that does not wait; `on` false writes zeros.
__device__ __forceinline__ void copy16(void* dst, const void* src, bool on) {
#ifdef __CUDA_ARCH__
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(on ? 16 : 0));
#else
  char* o = static_cast<char*>(dst);
  for (int i = 0; i < 16; ++i) o[i] = on ? static_cast<const char*>(src)[i] : 0;
#endif
}
// The same for one float (4-byte destinations, such as the 17-float rows of the 16 x 16 matrices).
__device__ __forceinline__ void copy4(float* dst, const float* src) {
#ifdef __CUDA_ARCH__
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src));
#else
  *dst = *src;
#endif
}
__device__ __forceinline__ void copy_commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;");
#endif
}
template <int Pending>
__device__ __forceinline__ void copy_wait() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending));
#endif
}

}  // namespace fla
