// Runs CUDA kernels written for this project on the CPU, for checking kernel logic where no GPU
// is at hand: every CTA thread is a std::thread, __syncthreads a std::barrier, shared memory a
// host array, and the CTAs of a grid run one after another. Include this before the kernel
// header, then launch with emu::launch. Host branches (#ifndef __CUDA_ARCH__) of the kernels
// replace their inline PTX. Not a timing tool. Between two barriers the warps of a CTA run one
// at a time, in ascending or descending order (emu::warp_order), so that a read of another
// warp's write that no barrier separates from it sees the stale or poisoned value every time,
// not by the chance of thread scheduling; 0 lets all threads run at once.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define __launch_bounds__(...)
using std::min;
using std::max;

inline thread_local uint3 threadIdx, blockIdx;

// A CTA's barrier with the warp-serial schedule: a warp waits for its turn after each barrier
// (and at the start), and the last of its threads to arrive at the next one passes the turn on.
struct EmuCta {
  struct Reset {
    EmuCta* c;
    void operator()() noexcept {  // every thread is at the barrier: none reads these now
      c->turn = 0;
      for (int w = 0; w < c->nwarps; ++w) c->pending[w] = c->size(w);
    }
  };
  int threads, nwarps, order, turn = 0;
  std::vector<int> pending;
  std::mutex m;
  std::condition_variable cv;
  std::barrier<Reset> bar;
  EmuCta(int threads_, int order_)
      : threads(threads_), nwarps((threads_ + 31) / 32), order(order_), pending(nwarps), bar(threads_, Reset{this}) {
    Reset{this}();
  }
  int size(int w) const { return std::min(32, threads - 32 * w); }
  int slot(int w) const { return order > 0 ? w : nwarps - 1 - w; }
  void begin() {
    if (!order) return;
    std::unique_lock<std::mutex> lk(m);
    cv.wait(lk, [&] { return turn == slot(int(threadIdx.x) / 32); });
  }
  // more = false: the thread's last arrival (it takes no further turn).
  void arrive_and_wait(bool more = true) {
    if (order) {
      std::lock_guard<std::mutex> lk(m);
      if (--pending[int(threadIdx.x) / 32] == 0) ++turn, cv.notify_all();
    }
    bar.arrive_and_wait();
    if (more) begin();
  }
};
inline EmuCta* emu_cta = nullptr;
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
struct EmuMmaLane { float a[8], b[4]; };  // one lane's mma operands (fla::tile::emu_mma)
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
inline float __fdividef(float x, float y) { return x / y; }
inline void __syncthreads() { emu_cta->arrive_and_wait(); }
// __syncthreads_and: a barrier, then every thread reads the AND of the predicates; a third
// barrier keeps the reset of the shared flag after every read.
inline std::atomic<bool> emu_and_fail{false};
inline int __syncthreads_and(int pred) {
  if (!pred) emu_and_fail = true;
  emu_cta->arrive_and_wait();
  const bool all = !emu_and_fail;
  emu_cta->arrive_and_wait();
  if (threadIdx.x == 0) emu_and_fail = false;
  emu_cta->arrive_and_wait();
  return all;
}
// A barrier of the thread's warp (every lane must call it, as the kernels do: full mask).
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warps[int(threadIdx.x) / 32]->arrive_and_wait(); }
// A CTA's threads never add to one element here, and CTAs run one after another.
inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}

namespace fla::tile {
// One warp's mma.sync m16n8 product over P x 8 of k (P = 1: m16n8k8, one TF32 value a register;
// P = 2: m16n8k16, two fp16 values a register, the lower k in the low half), on the lane's
// operands as floats in register order (a0 .. a3, b0 b1; with P = 2 each register's low then high
// value). Lane (row % 8, (k % 4P) / P) holds a(row, k) in register (row >= 8) + 2 (k >= 4P) and
// b(k, col) for lane (col, (k % 4P) / P) in register k >= 4P. The products are summed in fp32 in
// the order of k (the hardware's order may differ).
template <int P>
inline void emu_mma(float* d, const float (&a)[4 * P], const float (&b)[2 * P]) {
  const int t = int(threadIdx.x), lane = t % 32, g = lane / 4, q = lane % 4;
  std::barrier<>& bar = *emu_warps[t / 32];
  std::copy_n(a, 4 * P, emu_lanes[t].a), std::copy_n(b, 2 * P, emu_lanes[t].b);
  bar.arrive_and_wait();
  const EmuMmaLane* w = &emu_lanes[t - lane];
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * q + e % 2;
    float acc = d[e];
    for (int k = 0; k < 8 * P; ++k) {
      const int kq = k % (4 * P) / P, kh = k >= 4 * P, kp = k % P;
      acc += w[(row % 8) * 4 + kq].a[P * ((row >= 8) + 2 * kh) + kp] * w[col * 4 + kq].b[P * kh + kp];
    }
    out[e] = acc;
  }
  bar.arrive_and_wait();  // every lane has read the operands before any overwrites them
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}
// mma.sync m16n8k8 (tile_mma.cuh's mma_tf32) with the operands cut to TF32's 10 mantissa bits, as
// the tensor cores read them.
inline void emu_mma_tf32(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                         uint32_t b1) {
  auto tf = [](uint32_t u) {
    u &= 0xffffe000u;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  emu_mma<1>(d, {tf(a0), tf(a1), tf(a2), tf(a3)}, {tf(b0), tf(b1)});
}
// mma.sync m16n8k16 with fp16 operands (tile_mma.cuh's mma_f16).
inline void emu_mma_f16(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                        uint32_t b1) {
  auto lo = [](uint32_t u) { return __half2float(__ushort_as_half((unsigned short)(u & 0xffffu))); };
  auto hi = [](uint32_t u) { return __half2float(__ushort_as_half((unsigned short)(u >> 16))); };
  emu_mma<2>(d, {lo(a0), hi(a0), lo(a1), hi(a1), lo(a2), hi(a2), lo(a3), hi(a3)}, {lo(b0), hi(b0), lo(b1), hi(b1)});
}
}  // namespace fla::tile

namespace emu {

// The schedule of the warps between barriers (see the top): 1 ascending, -1 descending, 0 all at
// once.
inline int warp_order = 1;

// kernel() once per thread of every CTA of `grid` (x fastest), `threads` threads per CTA.
inline void launch(dim3 grid, int threads, const std::function<void()>& kernel) {
  EmuCta cta(threads, warp_order);
  emu_cta = &cta;
  emu_warps.clear();
  for (int w = 0; w < (threads + 31) / 32; ++w) emu_warps.push_back(std::make_unique<std::barrier<>>(32));
  emu_lanes.assign(size_t(threads), {});
  emu_shfl.assign(size_t(threads), 0.f);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      threadIdx = {unsigned(t), 0, 0};
      cta.begin();
      for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
          for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = {x, y, z};
            kernel();
            // The CTA's end: its shared memory is reused.
            cta.arrive_and_wait(x + 1 < grid.x || y + 1 < grid.y || z + 1 < grid.z);
          }
    });
  for (auto& th : pool) th.join();
  emu_cta = nullptr;
}

}  // namespace emu
