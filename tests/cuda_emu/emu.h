// Runs CUDA kernels written for this project on the CPU, for checking kernel logic where no GPU
// is at hand: every CTA thread is a fiber (its own stack, switched to and from in user space, all
// on the calling thread), __syncthreads and the warp collectives are barriers between fibers,
// shared memory is a host array, and the CTAs of a grid run one after another. Include this
// before the kernel header, then launch with emu::launch. Host branches (#ifndef __CUDA_ARCH__)
// of the kernels replace their inline PTX. Not a timing tool. Between two barriers the warps of a
// CTA run one at a time, in ascending or descending order (emu::warp_order; a warp's lanes in the
// same order, each up to its next barrier), so that a read of another thread's write that no
// barrier separates from it sees the stale or poisoned value every time, not by chance; 0 runs
// the threads of all warps in turn. A barrier some threads never reach (undefined on the GPU)
// aborts with a message.
//
// Fibers, not one OS thread per CUDA thread: a warp collective (every mma, every shuffle) is two
// barriers of 32 threads, and as OS threads each was a round of futex waits and wake-ups across
// the cores, and most of the test suite's time went there (docs/design.md §8).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include <sys/mman.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#define __launch_bounds__(...)
using std::min;
using std::max;

// The running fiber's indices: the scheduler sets them before it resumes a fiber.
inline uint3 threadIdx, blockIdx;

namespace emu_fiber {

#if defined(__x86_64__)
// emu_fiber_switch(save, load): saves the callee-saved registers, the SSE and x87 control words
// and the stack pointer (into *save), then resumes the context whose stack pointer is `load`.
// A new fiber's stack holds such a frame whose return address is emu_fiber_start.
#define EMU_HIDDEN __attribute__((visibility("hidden")))
extern "C" EMU_HIDDEN void emu_fiber_switch(void** save, void* load);
extern "C" EMU_HIDDEN void emu_fiber_start();
extern "C" EMU_HIDDEN void emu_fiber_entry();
asm(R"(
  .text
  .weak emu_fiber_switch
  .hidden emu_fiber_switch
  .type emu_fiber_switch, @function
emu_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_fiber_switch, .-emu_fiber_switch
  .weak emu_fiber_start
  .hidden emu_fiber_start
  .type emu_fiber_start, @function
emu_fiber_start:
  call emu_fiber_entry
  ud2
  .size emu_fiber_start, .-emu_fiber_start
)");
#endif

enum class State { Runnable, AtBarrier, Done };

struct Fiber {
  uint3 bid{};  // its blockIdx while it is switched out (its threadIdx is its index)
  State state = State::Runnable;
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
};

// Stacks stay mapped from launch to launch (pages are committed as touched); a guard page below
// each turns an overflow into a fault.
constexpr size_t kStack = size_t(1) << 20, kGuard = 4096;
struct Stacks {
  std::vector<char*> base;
  char* get(int i) {
    while (int(base.size()) <= i) {
      void* m = mmap(nullptr, kStack + kGuard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (m == MAP_FAILED) std::perror("emu: fiber stack"), std::abort();
      mprotect(m, kGuard, PROT_NONE);
      base.push_back(static_cast<char*>(m) + kGuard);
    }
    return base[size_t(i)];
  }
};
inline Stacks stacks;

struct Scheduler {
  std::vector<Fiber> fibers;
  const std::function<void()>* body = nullptr;  // what every fiber runs
  int current = -1;
  bool progress = false;  // set by any arrival: a round without one is a deadlock
#if defined(__x86_64__)
  void* main_sp = nullptr;
#else
  ucontext_t main_ctx;
#endif

  void resume(int i) {
    Fiber& f = fibers[size_t(i)];
    threadIdx = {unsigned(i), 0, 0}, blockIdx = f.bid, current = i;
#if defined(__x86_64__)
    emu_fiber_switch(&main_sp, f.sp);
#else
    swapcontext(&main_ctx, &f.ctx);
#endif
  }
  // Back to the scheduler; returns when the scheduler resumes this fiber.
  void yield() {
    Fiber& f = fibers[size_t(current)];
    f.bid = blockIdx;
#if defined(__x86_64__)
    emu_fiber_switch(&f.sp, main_sp);
#else
    swapcontext(&f.ctx, &main_ctx);
#endif
  }
};
inline Scheduler sched;

[[noreturn]] inline void fiber_main() {
  (*sched.body)();
  sched.fibers[size_t(sched.current)].state = State::Done;
  sched.progress = true;
  sched.yield();
  std::abort();  // a finished fiber is never resumed
}

#if defined(__x86_64__)
// used: only the assembly above calls it
extern "C" __attribute__((used)) EMU_HIDDEN inline void emu_fiber_entry() { fiber_main(); }
#else
inline void ucontext_entry() { fiber_main(); }
#endif

inline void start(Fiber& f, int i) {
  char* top = stacks.get(i) + kStack;
#if defined(__x86_64__)
  // The frame emu_fiber_switch pops: control words, r15 .. r12, rbx, rbp, return address; after
  // its ret the stack pointer is 16-byte aligned, as a call instruction expects.
  uint64_t* sp = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15)) - 80);
  std::memset(sp, 0, 64);
  uint32_t mxcsr;
  uint16_t fcw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fcw));
  std::memcpy(sp, &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(sp) + 4, &fcw, 2);
  sp[7] = reinterpret_cast<uint64_t>(&emu_fiber_start);
  f.sp = sp;
#else
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = top - kStack;
  f.ctx.uc_stack.ss_size = kStack;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, ucontext_entry, 0);
#endif
}

// A barrier of `size` fibers (a warp's lanes): each arrival but the last yields until the last
// one arrives, which goes on; the scheduler resumes the others in its order.
struct Barrier {
  int size = 0, arrived = 0;
  unsigned generation = 0;
  void arrive_and_wait() {
    const unsigned g = generation;
    sched.progress = true;
    if (++arrived == size) arrived = 0, ++generation;
    else
      while (generation == g) sched.yield();
  }
};

}  // namespace emu_fiber

// A CTA's barrier (__syncthreads): the fiber waits at it until all have arrived; the scheduler
// then runs the warps again in their order (emu::launch).
struct EmuCta {
  int arrived = 0;
  void arrive_and_wait() {
    using emu_fiber::sched;
    ++arrived;
    sched.progress = true;
    sched.fibers[size_t(sched.current)].state = emu_fiber::State::AtBarrier;
    sched.yield();
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
inline std::vector<emu_fiber::Barrier> emu_warps;
struct EmuMmaLane { float a[8], b[4]; };  // one lane's mma operands (fla::tile::emu_mma)
inline std::vector<EmuMmaLane> emu_lanes;
inline std::vector<float> emu_shfl;
inline std::vector<uint32_t> emu_words;  // one 32-bit register a thread (movmatrix)
inline std::vector<const void*> emu_rows;  // one address a thread (ldmatrix)
// __shfl_sync over the thread's warp (every lane must call it, as on the GPU with a full mask).
inline float __shfl_sync(unsigned, float v, int src, int width = 32) {
  const int t = int(threadIdx.x), lane = t % 32;
  emu_fiber::Barrier& bar = emu_warps[size_t(t / 32)];
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
inline bool emu_and_fail = false;
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
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warps[size_t(threadIdx.x / 32)].arrive_and_wait(); }
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
  emu_fiber::Barrier& bar = emu_warps[size_t(t / 32)];
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
// movmatrix.sync.aligned.m8n8.trans.b16 (tile_mma.cuh's movmatrix_trans): element (r, c) of the
// warp's 8 x 8 matrix is half c % 2 of lane 4r + c / 2's register; lane (g, q) gets (2q, g) and
// (2q + 1, g).
inline uint32_t emu_movmatrix_trans(uint32_t x) {
  const int t = int(threadIdx.x), lane = t % 32, g = lane / 4, q = lane % 4;
  emu_fiber::Barrier& bar = emu_warps[size_t(t / 32)];
  emu_words[size_t(t)] = x;
  bar.arrive_and_wait();
  const uint32_t* w = &emu_words[size_t(t - lane)];
  auto half = [&](int r, int c) { return (w[4 * r + c / 2] >> (16 * (c % 2))) & 0xffffu; };
  const uint32_t y = half(2 * q, g) | (half(2 * q + 1, g) << 16);
  bar.arrive_and_wait();  // every lane has read before any lane's next write
  return y;
}
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (tile_mma.cuh's ldmatrix_x4): lane l gives
// the address of row l % 8 of matrix l / 8 (eight 16-bit values); lane (g, q) gets, in r[i],
// matrix i's elements (g, 2q) and (g, 2q + 1), or with TRANS (2q, g) and (2q + 1, g).
template <bool TRANS>
inline void emu_ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const int t = int(threadIdx.x), lane = t % 32, g = lane / 4, q = lane % 4;
  emu_fiber::Barrier& bar = emu_warps[size_t(t / 32)];
  emu_rows[size_t(t)] = row;
  bar.arrive_and_wait();
  const void* const* w = &emu_rows[size_t(t - lane)];
  auto at = [&](int m, int i, int j) {  // matrix m, row i, column j
    uint16_t v;
    std::memcpy(&v, static_cast<const char*>(w[8 * m + i]) + 2 * j, 2);
    return uint32_t(v);
  };
  for (int m = 0; m < 4; ++m)
    r[m] = TRANS ? at(m, 2 * q, g) | (at(m, 2 * q + 1, g) << 16) : at(m, g, 2 * q) | (at(m, g, 2 * q + 1) << 16);
  bar.arrive_and_wait();
}
}  // namespace fla::tile

namespace emu {

// The schedule of the warps (and of each warp's lanes) between barriers (see the top): 1
// ascending, -1 descending, 0 the threads of all warps in turn, ascending.
inline int warp_order = 1;

// kernel() once per thread of every CTA of `grid` (x fastest), `threads` threads per CTA.
inline void launch(dim3 grid, int threads, const std::function<void()>& kernel) {
  using namespace emu_fiber;
  EmuCta cta;
  emu_cta = &cta;
  const int nwarps = (threads + 31) / 32;
  emu_warps.assign(size_t(nwarps), Barrier{});
  for (int w = 0; w < nwarps; ++w) emu_warps[size_t(w)].size = std::min(32, threads - 32 * w);
  emu_lanes.assign(size_t(threads), {});
  emu_shfl.assign(size_t(threads), 0.f);
  emu_words.assign(size_t(threads), 0u);
  emu_rows.assign(size_t(threads), nullptr);
  const std::function<void()> body = [&] {
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          blockIdx = {x, y, z};
          kernel();
          cta.arrive_and_wait();  // the CTA's end: its shared memory is reused
        }
  };
  sched.body = &body;
  sched.fibers.assign(size_t(threads), Fiber{});
  for (int t = 0; t < threads; ++t) start(sched.fibers[size_t(t)], t);
  // Runs threads [first, last) in turn (descending where the warps are) until each is at the CTA
  // barrier or done. A thread runs until it waits at a barrier, so a lane reading what another
  // lane of its warp writes without a __syncwarp between sees the stale value in one of the two
  // orders.
  auto run = [&](int first, int last) {
    for (;;) {
      bool any = false;
      sched.progress = false;
      for (int i = first; i < last; ++i) {
        const int t = warp_order < 0 ? first + last - 1 - i : i;
        if (sched.fibers[size_t(t)].state == State::Runnable) any = true, sched.resume(t);
      }
      if (!any) return;
      if (!sched.progress) {
        std::fprintf(stderr, "emu: deadlock: threads %d-%d wait at a warp barrier others never reach\n", first, last - 1);
        std::abort();
      }
    }
  };
  for (;;) {
    if (warp_order == 0) {
      run(0, threads);
    } else {
      for (int i = 0; i < nwarps; ++i) {
        const int w = warp_order > 0 ? i : nwarps - 1 - i;
        run(32 * w, std::min(threads, 32 * w + 32));
      }
    }
    if (cta.arrived == 0) break;  // every thread is done
    if (cta.arrived != threads) {
      std::fprintf(stderr, "emu: deadlock: %d of %d threads at __syncthreads, the others done\n", cta.arrived, threads);
      std::abort();
    }
    cta.arrived = 0;
    for (Fiber& f : sched.fibers) f.state = State::Runnable;
  }
  emu_cta = nullptr;
  sched.body = nullptr;
}

}  // namespace emu
