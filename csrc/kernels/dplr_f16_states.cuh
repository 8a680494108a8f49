// Chunk-start states as the RWKV7 single-pass backward reads them (DplrKept::f16_states): the
// fused training forward stores every chunk's start state in this form and the backward loads
// it straight into its registers, so that it makes no state again (benchmarks/NOTES.md c69).
//
// The backward's warp w holds the value columns 16w .. 16w + 15 of a state transposed (HeldLane),
// and the state products read them as fp16 scaled by the power of two of the warp's largest
// magnitude. Stored with that block's scale times 2^15 (the largest magnitude in [2^14, 2^15):
// fp16's normal range, so an element keeps 11 bits down to 2^-24 of the block's largest instead
// of 2^-10), the products' operands are the ones an fp32 state gives, and zeta's rowsum(S * dS+)
// reads S at the state products' precision (docs/algorithms.md §6.4).
#pragma once
#include <cuda_fp16.h>

#include "async_copy.cuh"  // prefetch_l2

#include "dplr_chunk_fused_steps.cuh"

namespace fla {
namespace dplr_fused_detail {

// Where a lane's elements of a held quantity sit: the warp's per-column quantities are held
// transposed, as m16n8 accumulator tiles whose m is the warp's 16 value columns (x0 = 16 warp);
// element e of tile t is at column col(e) and channel (or row) chan(t, e) = 8t + 2q + e % 2.
struct HeldLane {
  int g, q, x0;
  __device__ explicit HeldLane(int tid) : g(tid % 32 / 4), q(tid % 4), x0(16 * (tid / 32)) {}
  __device__ int col(int e) const { return x0 + g + 8 * (e / 2); }
  __device__ int chan(int t, int e) const { return 8 * t + 2 * q + e % 2; }
};

// The largest magnitude of a warp's accumulator tiles x[t][0..4) (every lane returns it).
template <int n>
__device__ inline float warp_amax(const float (&x)[n][4]) {
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < n; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) m = fmaxf(m, fabsf(x[i][e]));
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// One (chunk slot, head) record (DplrF16States::kFloats floats): thread t's 32 held elements of
// the 128 as four 16-byte pieces at uint4 [i][t] (piece i: tiles 2i and 2i + 1; coalesced), then
// the four warps' inverse scales.
static_assert(DplrF16States::kFloats == K * V / 2 + V / 16, "the record's size");
constexpr int kF16StateScales = K * V / 2;

// The forward's state S ([K][LB] fp32 in shared memory) into `record`, by 128 threads (tid), each
// its own HeldLane elements. Reads S alone: after the barrier that wrote it.
__device__ inline void store_f16_state(float* record, const float* S, int tid) {
  const HeldLane ln(tid);
  float ht[K / 8][4];
  // Elements c and c + 2 share a channel, columns col(0) and col(0) + 8. Lanes with q >= 2 read the
  // second first: rows 2q + c of LB (8 mod 32) floats put q and q + 2 on one bank, and the swap
  // moves one of them 8 banks on, so every load's lanes fall on 32 banks (benchmarks/NOTES.md c70).
  const bool swap = ln.q >= 2;
#pragma unroll
  for (int t = 0; t < K / 8; ++t)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float* const at = S + ln.chan(t, c) * LB + ln.col(0);
      const float first = at[swap ? 8 : 0], second = at[swap ? 0 : 8];
      ht[t][c] = swap ? second : first, ht[t][c + 2] = swap ? first : second;
    }
  const float s = tile::pow2_scale<15>(warp_amax(ht));  // (the largest magnitude into [2^14, 2^15))
  uint4* const out = reinterpret_cast<uint4*>(record) + tid;
#pragma unroll
  for (int i = 0; i < K / 16; ++i) {
    const float(&a)[4] = ht[2 * i], (&b)[4] = ht[2 * i + 1];
    out[i * NTF] = make_uint4(tile::f16_pair(s * a[0], s * a[1]), tile::f16_pair(s * a[2], s * a[3]),
                              tile::f16_pair(s * b[0], s * b[1]), tile::f16_pair(s * b[2], s * b[3]));
  }
  if (tid % 32 == 0) record[kF16StateScales + tid / 32] = tile::inverse_pow2(s);
}

// The record's 128-byte lines asked of L2 by threads 0 .. kF16StateLines - 1, a chunk before
// load_f16_state reads them: that load then waits on L2 instead of DRAM (benchmarks/NOTES.md c70).
// Every address stays inside the record (the last line's at its last float).
constexpr int kF16StateBytes = int(DplrF16States::kFloats) * 4, kF16StateLines = (kF16StateBytes + 127) / 128 + 1;
__device__ inline void prefetch_f16_state(const float* record, int tid) {
  if (tid < kF16StateLines) {
    const int at = tid * 128 < kF16StateBytes ? tid * 128 : kF16StateBytes - 4;
    prefetch_l2(reinterpret_cast<const char*>(record) + at);
  }
}

// store_f16_state's record back as this thread's held elements (exact: fp16 times a power of two).
__device__ inline void load_f16_state(float (&ht)[K / 8][4], const float* record, int tid) {
  const uint4* const in = reinterpret_cast<const uint4*>(record) + tid;
  const float inv = record[kF16StateScales + tid / 32];
  auto half = [](uint32_t u) { return __half2float(__ushort_as_half((unsigned short)(u & 0xffffu))); };
  auto put = [&](float(&x)[4], uint32_t lo, uint32_t hi) {
    x[0] = half(lo) * inv, x[1] = half(lo >> 16) * inv, x[2] = half(hi) * inv, x[3] = half(hi >> 16) * inv;
  };
#pragma unroll
  for (int i = 0; i < K / 16; ++i) {
    const uint4 u = in[i * NTF];
    put(ht[2 * i], u.x, u.y), put(ht[2 * i + 1], u.z, u.w);
  }
}

}  // namespace dplr_fused_detail
}  // namespace fla
