// Runs CUDA kernels written for this project on the CPU, for checking kernel logic where no GPU
// is at hand: every CTA thread is a std::thread, __syncthreads a std::barrier, shared memory a
// host array, and the CTAs of a grid run one after another. Include this before the kernel
// header, then launch with emu::launch. Host branches (#ifndef __CUDA_ARCH__) of the kernels
// replace their inline PTX. Not a timing tool, and a race that the barrier order hides on the
// CPU may still show on a GPU.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __launch_bounds__(...)
using std::min;
using std::max;

inline thread_local uint3 threadIdx, blockIdx;
inline std::barrier<>* emu_barrier = nullptr;
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Warp collectives: a barrier per warp and each thread's operands of the current one.
inline std::vector<std::unique_ptr<std::barrier<>>> emu_warps;
struct EmuMmaLane { float a[4], b[2]; };
inline std::vector<EmuMmaLane> emu_lanes;
inline std::vector<float> emu_shfl;
// __shfl_sync over the thread's warp (every lane must call it, as on the GPU with a full mask).
inline float __shfl_sync(unsigned, float v, int src, int width = 32) {
  const int t = int(threadIdx.x), lane = t % 32;
  std::barrier<>& bar = *emu_warps[t / 32];
  emu_shfl[t] = v;
  bar.arrive_and_wait();
  const float r = emu_shfl[t - lane + lane / width * width + src % width];
  bar.arrive_and_wait();
  return r;
}
inline float __shfl_xor_sync(unsigned mask, float v, int lanes, int width = 32) {
  const int lane = int(threadIdx.x) % 32;
  return __shfl_sync(mask, v, lane ^ lanes, width);
}
inline float __fmul_rn(float a, float b) { return a * b; }  // g++ does not contract a lone product
inline void __syncthreads() { emu_barrier->arrive_and_wait(); }
// A barrier of the thread's warp (every lane must call it, as the kernels do: full mask).
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warps[int(threadIdx.x) / 32]->arrive_and_wait(); }
// A CTA's threads never add to one element here, and CTAs run one after another.
inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}

namespace fla::tile {
// mma.sync m16n8k8 (tile_mma.cuh's layout) with the operands cut to TF32's 10 mantissa bits, as
// the tensor cores read them; the products are summed in fp32 (the hardware's order may differ).
inline void emu_mma_tf32(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                         uint32_t b1) {
  auto tf = [](uint32_t u) {
    u &= 0xffffe000u;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  const int t = int(threadIdx.x), lane = t % 32, g = lane / 4, q = lane % 4;
  std::barrier<>& bar = *emu_warps[t / 32];
  emu_lanes[t] = {{tf(a0), tf(a1), tf(a2), tf(a3)}, {tf(b0), tf(b1)}};
  bar.arrive_and_wait();
  const EmuMmaLane* w = &emu_lanes[t - lane];
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * q + e % 2;
    float acc = d[e];
    for (int k = 0; k < 8; ++k)
      acc += w[(row % 8) * 4 + k % 4].a[(row >= 8) + 2 * (k >= 4)] * w[col * 4 + k % 4].b[k >= 4];
    out[e] = acc;
  }
  bar.arrive_and_wait();  // every lane has read the operands before any overwrites them
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}
}  // namespace fla::tile

namespace emu {

// kernel() once per thread of every CTA of `grid` (x fastest), `threads` threads per CTA.
inline void launch(dim3 grid, int threads, const std::function<void()>& kernel) {
  std::barrier<> bar(threads);
  emu_barrier = &bar;
  emu_warps.clear();
  for (int w = 0; w < (threads + 31) / 32; ++w) emu_warps.push_back(std::make_unique<std::barrier<>>(32));
  emu_lanes.assign(size_t(threads), {});
  emu_shfl.assign(size_t(threads), 0.f);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      threadIdx = {unsigned(t), 0, 0};
      for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
          for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = {x, y, z};
            kernel();
            bar.arrive_and_wait();  // the CTA's end: its shared memory is reused
          }
    });
  for (auto& th : pool) th.join();
  emu_barrier = nullptr;
}

}  // namespace emu
