// Asynchronous global -> shared copies (cp.async) shared by the CUDA engines. The host branches
// (synchronous copies) serve tests/cuda_emu, which runs the kernels on the CPU.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

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

// Asks L2 for the 128-byte line holding `p` (a hint: nothing waits on it; the host does nothing).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifdef __CUDA_ARCH__
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}

// Bulk copies (sm_90: cp.async.bulk, the copy engine; one instruction moves a whole row, so a
// CTA's fetch costs one warp a few instructions instead of every thread an address computation
// per 16-byte piece) completing on an mbarrier in shared memory. FLA_BULK_COPY is 1 where they
// exist (and on the host, where they are synchronous copies); older GPUs keep cp.async.
// (Defined beforehand, it picks the path: the CUDA emulator runs the cp.async fallback too.)
#ifndef FLA_BULK_COPY
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define FLA_BULK_COPY 1
#else
#define FLA_BULK_COPY 0
#endif
#endif
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(unsigned(__cvta_generic_to_shared(bar))), "r"(count));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#else
  *bar = count;
#endif
}
// One arrival that also expects `bytes` more of transfers in the barrier's current phase.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               ::"r"(unsigned(__cvta_generic_to_shared(bar))), "r"(bytes) : "memory");
#endif
}
// Waits until the barrier's phase of the given parity (0, 1, 0, .. for its uses) has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n.reg .pred p;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra wait_%=;\n}" ::"r"(unsigned(__cvta_generic_to_shared(bar))), "r"(parity) : "memory");
#endif
}
// Orders this thread's earlier generic accesses of shared memory (made visible to it by a CTA
// barrier) before its later bulk copies into it: the copy engine writes through the async proxy.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory,
// completing on `bar` (whose phase must expect them: mbar_expect_tx).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(unsigned(__cvta_generic_to_shared(dst))), "l"(src), "r"(bytes),
               "r"(unsigned(__cvta_generic_to_shared(bar))) : "memory");
#elif !defined(__CUDA_ARCH__)
  std::memcpy(dst, src, bytes);
  (void)bar;
#endif
}

}  // namespace fla
