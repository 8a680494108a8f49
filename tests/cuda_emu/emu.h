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
#include <functional>
#include <thread>
#include <vector>

#define __launch_bounds__(...)
using std::min;
using std::max;

inline thread_local uint3 threadIdx, blockIdx;
inline std::barrier<>* emu_barrier = nullptr;
inline void __syncthreads() { emu_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) {}
// A CTA's threads never add to one element here, and CTAs run one after another.
inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}

namespace emu {

// kernel() once per thread of every CTA of `grid` (x fastest), `threads` threads per CTA.
inline void launch(dim3 grid, int threads, const std::function<void()>& kernel) {
  std::barrier<> bar(threads);
  emu_barrier = &bar;
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
