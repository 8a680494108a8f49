// CUDA engine for the recurrent sweep of kernels/recurrent.h.
//
// One CTA per (sequence, head, 32-column tile); each thread owns RPT rows of one column of the
// fp32 state in registers (layout: Shape below). Time advances in chunks of TC steps: all operands of a chunk
// are staged into shared memory with coalesced loads (decays already exponentiated, exponents
// are always <= 0), then the serial loop touches only registers and broadcast shared reads.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "elements.cuh"
#include "recurrent.h"
#include "sequence.h"

namespace fla {
namespace recurrent_detail {
using namespace elements;

constexpr int BC = 32;  // state columns per CTA
constexpr int TC = 16;  // time steps per staged chunk (1 for decode: T == 1)

// Thread layout: RG row groups x CW columns per warp (RG * CW = 32), RG warps per CTA covering
// BC columns. A thread holds RPT consecutive rows of one column; the read S^T q is finished by
// log2(RG) shuffles and the lanes of row group 0 write the outputs inline.
template <int RPT, int RG, int TCN>
struct Shape {
  static constexpr int CW = 32 / RG, NW = BC / CW, NT = NW * 32, DrP = RG * RPT;
  static constexpr int SEG = DrP < 32 ? DrP : 32, NSEG = DrP / SEG;
  static constexpr int NR = (TCN * DrP + NT - 1) / NT;  // staged row elements per thread
  static constexpr int NC = (TCN * BC + NT - 1) / NT;   // staged column elements per thread
  static_assert(NT % DrP == 0, "each thread stages one fixed row");
};

template <int RPT, int RG>
__host__ __device__ constexpr size_t smem_floats(int tc) {
  using Sh = Shape<RPT, RG, TC>;
  return size_t(tc) * (3 * Sh::DrP + 5 * BC + Sh::NSEG + 1);
}

// One chunk's loads, held in registers so that they are in flight during the serial loop of the
// previous chunk instead of exposing a global-load latency per staging step.
template <int RPT, int RG, int TCN>
struct Prefetch {
  using Sh = Shape<RPT, RG, TCN>;
  float q[Sh::NR], a[Sh::NR], l[Sh::NR], x[Sh::NR];
  float b[Sh::NC], d[Sh::NC], y[Sh::NC], z[Sh::NC], w[Sh::NC];
};

template <typename T, int RPT, int RG, int TCN>
__device__ __forceinline__ void prefetch(Prefetch<RPT, RG, TCN>& f, const RecurrentPass& p, const SeqSpan& s,
                                         int64_t base, int tc, int h, int ct) {
  using Sh = Shape<RPT, RG, TCN>;
  const int nt = s.len - base < tc ? int(s.len - base) : tc;
#pragma unroll
  for (int j = 0; j < Sh::NR; ++j) {
    const int e = j * Sh::NT + threadIdx.x, tau = e / Sh::DrP, r = e % Sh::DrP;
    f.q[j] = f.a[j] = f.x[j] = f.l[j] = 0.f;
    if (tau < nt && r < p.Dr) {
      const int64_t step = base + tau;
      const int64_t t = s.bos + (p.reverse ? s.len - 1 - step : step);
      f.q[j] = ld<T>(p.q, s.b, t, h, r);
      f.a[j] = ld<T>(p.a, s.b, t, h, r);
      if (p.row_decay.on()) f.l[j] = ld<T>(p.row_decay, s.b, t, h, r);
      if (p.x.on()) f.x[j] = ld<T>(p.x, s.b, t, h, r);
    }
  }
#pragma unroll
  for (int j = 0; j < Sh::NC; ++j) {
    const int e = j * Sh::NT + threadIdx.x, tau = e / BC, cc = ct * BC + e % BC;
    f.b[j] = f.d[j] = f.y[j] = f.z[j] = f.w[j] = 0.f;
    if (tau < nt && cc < p.Dc) {
      const int64_t step = base + tau;
      const int64_t t = s.bos + (p.reverse ? s.len - 1 - step : step);
      f.b[j] = ld<T>(p.b, s.b, t, h, cc);
      if (p.col_decay.on()) f.d[j] = ld<T>(p.col_decay, s.b, t, h, cc);
      if (p.x.on()) f.y[j] = ld<T>(p.y, s.b, t, h, cc);
      if (p.gate != GateGrad::None) f.z[j] = ld<T>(p.z, s.b, t, h, cc);
      if (p.gate == GateGrad::Consume) f.w[j] = *vptr<float>(p.ws, s.b, t, h, cc);
    }
  }
}

template <int N>
__device__ __forceinline__ void lds(float (&dst)[N], const float* src) {
  static_assert(N % 4 == 0, "vector shared loads");
#pragma unroll
  for (int j = 0; j < N; j += 4) {
    const float4 v = *reinterpret_cast<const float4*>(src + j);
    dst[j] = v.x, dst[j + 1] = v.y, dst[j + 2] = v.z, dst[j + 3] = v.w;
  }
}

template <int RG>
__device__ __forceinline__ float sum_row_groups(float v) {
#pragma unroll
  for (int o = 16; o >= 32 / RG; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T, int RPT, int RG, int TCN>
__global__ void __launch_bounds__(Shape<RPT, RG, TCN>::NT, (TCN == 1 || (RPT <= 8 && RG == 8)) ? 512 / Shape<RPT, RG, TCN>::NT : 1) recurrent_kernel(const __grid_constant__ RecurrentPass p, int tc) {
  using Sh = Shape<RPT, RG, TCN>;
  constexpr int DrP = Sh::DrP, NT = Sh::NT, SEG = Sh::SEG, NSEG = Sh::NSEG, CW = Sh::CW;
  const int ctiles = (p.Dc + BC - 1) / BC;
  const int ct = blockIdx.x % ctiles;
  const int nh = blockIdx.x / ctiles;
  const int h = nh % p.H, n = nh / p.H;
  const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rg = lane / CW, cl = warp * CW + lane % CW;  // row group; column within the tile
  const int c = ct * BC + cl;
  const bool cok = c < p.Dc;
  const bool writer = cok && rg == 0;
  const int row0 = rg * RPT;

  extern __shared__ __align__(16) float sm[];
  float* sq = sm;                    // [tc][DrP]  q
  float* sa = sq + tc * DrP;         // [tc][DrP]  a * a_scale
  float* sl = sa + tc * DrP;         // [tc][DrP]  exp(decay) on rows
  float* sb = sl + tc * DrP;         // [tc][BC]   b * b_scale
  float* sdc = sb + tc * BC;         // [tc][BC]   exp(decay) on columns
  float* sy = sdc + tc * BC;         // [tc][BC]   y
  float* sz = sy + tc * BC;          // [tc][BC]   z
  float* sw = sz + tc * BC;          // [tc][BC]   ws (Consume)
  float* sbon = sw + tc * BC;        // [tc][NSEG] bonus partial sums
  float* sbt = sbon + tc * NSEG;     // [tc]       bonus_scale * bonus sum

  const float scale = float(p.scale), a_scale = float(p.a_scale), b_scale = float(p.b_scale);
  const bool bonus = p.x.on();
  const bool consume = p.gate == GateGrad::Consume;
  const bool row_dec = p.row_decay.on(), col_dec = p.col_decay.on();
  const int my_row = threadIdx.x % DrP;
  const float ux = (bonus && p.ux && my_row < p.Dr) ? ldu(p.ux, h * p.Dr + my_row, p.udtype) : 1.f;
  const float uy = (bonus && p.uy && cok) ? ldu(p.uy, h * p.Dc + c, p.udtype) : 1.f;

  float S[RPT];
#pragma unroll
  for (int j = 0; j < RPT; ++j) {
    const int r = row0 + j;
    S[j] = (p.h0.on() && cok && r < p.Dr) ? *mptr(p.h0, n, h, r, c) : 0.f;
  }
  // zeta[c] = sum_r S[r][c] zdot[r][c] (Produce); every thread of the CTA calls it.
  const bool produce_zeta = p.gate == GateGrad::Produce && p.zeta;
  auto zeta_of = [&](const float* St) {
    float z = 0.f;
    if (p.zdot.on() && cok) {
#pragma unroll
      for (int j = 0; j < RPT; ++j)
        if (row0 + j < p.Dr) z = fmaf(St[j], *mptr(p.zdot, n, h, row0 + j, c), z);
    }
    return sum_row_groups<RG>(z);
  };
  float zeta_pre = 0.f;

  float acc = 0.f, du = 0.f;
  if (consume && p.zeta && writer) acc = *fptr(p.zeta, (int64_t(n) * p.H + h) * p.Dc + c);

  Prefetch<RPT, RG, TCN> f;
  if (s.len > 0) prefetch<T, RPT, RG, TCN>(f, p, s, 0, tc, h, ct);
  for (int64_t base = 0; base < s.len; base += tc) {
    const int nt = s.len - base < tc ? int(s.len - base) : tc;
    __syncthreads();  // the previous chunk is done with shared memory
#pragma unroll
    for (int j = 0; j < Sh::NR; ++j) {
      const int e = j * NT + threadIdx.x, tau = e / DrP;
      float bon = f.q[j] * f.x[j] * ux;
#pragma unroll
      for (int o = SEG / 2; o > 0; o >>= 1) bon += __shfl_xor_sync(0xffffffffu, bon, o);
      if (tau < tc) {
        sq[e] = f.q[j], sa[e] = f.a[j] * a_scale, sl[e] = expf(f.l[j]);
        if (e % SEG == 0) sbon[tau * NSEG + (e % DrP) / SEG] = bon;
      }
    }
#pragma unroll
    for (int j = 0; j < Sh::NC; ++j) {
      const int e = j * NT + threadIdx.x;
      if (e < tc * BC)
        sb[e] = f.b[j] * b_scale, sdc[e] = expf(f.d[j]), sy[e] = f.y[j], sz[e] = f.z[j], sw[e] = f.w[j];
    }
    __syncthreads();
    if (threadIdx.x < tc) {
      float t = 0.f;
#pragma unroll
      for (int g = 0; g < NSEG; ++g) t += sbon[threadIdx.x * NSEG + g];
      sbt[threadIdx.x] = float(p.bonus_scale) * t;
    }
    if (base + tc < s.len) prefetch<T, RPT, RG, TCN>(f, p, s, base + tc, tc, h, ct);
    __syncthreads();

    // The serial part: registers, shuffles and broadcast shared reads.
    for (int tau = 0; tau < nt; ++tau) {
      float q[RPT], a[RPT];
      lds(q, sq + tau * DrP + row0);
      lds(a, sa + tau * DrP + row0);
      const float bv = sb[tau * BC + cl];
      float part0 = 0.f, part1 = 0.f;  // two chains halve the latency of the read
      auto read = [&] {
#pragma unroll
        for (int j = 0; j < RPT; j += 2) part0 = fmaf(q[j], S[j], part0), part1 = fmaf(q[j + 1], S[j + 1], part1);
      };
      // Order (recurrent.h): rwd and mid read without this step's write; both decay apart.
      const bool rwd = p.order == Order::ReadWriteDecay, mid = p.order == Order::DecayReadWrite;
      const bool decay_apart = p.order == Order::DecayLast || rwd || mid;
      if (p.order == Order::ReadFirst || rwd) read();
      if (p.order == Order::DecayLast || rwd) {
#pragma unroll
        for (int j = 0; j < RPT; ++j) S[j] = fmaf(a[j], bv, S[j]);
        if (!rwd) read();
      }
      // decay(S) = diag(row factors) S diag(column factor); an absent side is 1 (uniform branches;
      // without any decay the row path runs with factors exp(0) = 1). With both sides (GLA's gk
      // and gv) the column factor goes on first: the old state only, as the decay is due.
      if (row_dec && col_dec) {
        const float dc = sdc[tau * BC + cl];
#pragma unroll
        for (int j = 0; j < RPT; ++j) S[j] *= dc;
      }
      if (row_dec || !col_dec) {
        float l[RPT];
        lds(l, sl + tau * DrP + row0);
        if (decay_apart) {
#pragma unroll
          for (int j = 0; j < RPT; ++j) S[j] *= l[j];
        } else {
#pragma unroll
          for (int j = 0; j < RPT; ++j) S[j] = fmaf(l[j], S[j], a[j] * bv);
        }
      } else {
        const float dc = sdc[tau * BC + cl];
        if (decay_apart) {
#pragma unroll
          for (int j = 0; j < RPT; ++j) S[j] *= dc;
        } else {
#pragma unroll
          for (int j = 0; j < RPT; ++j) S[j] = fmaf(dc, S[j], a[j] * bv);
        }
      }
      if (mid) {
        read();
        if (produce_zeta && base + tau == s.len - 1) zeta_pre = zeta_of(S);  // before the write
#pragma unroll
        for (int j = 0; j < RPT; ++j) S[j] = fmaf(a[j], bv, S[j]);
      }
      if (p.order == Order::ReadLast) read();
      const float pc = sum_row_groups<RG>(part0 + part1) * scale;
      if (writer) {
        const int64_t step = base + tau;
        const int64_t t = s.bos + (p.reverse ? s.len - 1 - step : step);
        const float yb = bonus ? sbt[tau] * sy[tau * BC + cl] : 0.f;
        if (p.out.on()) put<T>(p.out, p.out_acc, s.b, t, h, c, pc + yb * uy);
        if (p.gate == GateGrad::Produce) {
          *vptr<float>(p.ws, s.b, t, h, c) = sz[tau * BC + cl] * pc;
        } else if (consume) {
          const float z = sz[tau * BC + cl], ws = sw[tau * BC + cl];
          if (p.ws_inclusive) acc += ws;
          if (!rwd || step > 0) acc -= z * pc;
          if (sdc[tau * BC + cl] == 0.f) acc = 0.f;
          *vptr<T>(p.dlam, s.b, t, h, c) = from_f<T>(acc);
          if (!p.ws_inclusive) acc += ws;
          du = fmaf(yb, z, du);
        }
      }
    }
  }

  if (p.hT.on() && cok) {
#pragma unroll
    for (int j = 0; j < RPT; ++j)
      if (row0 + j < p.Dr) *mptr(p.hT, n, h, row0 + j, c) = S[j];
  }
  if (produce_zeta) {
    const float z = p.order == Order::DecayReadWrite && s.len > 0 ? zeta_pre : zeta_of(S);
    if (writer) *fptr(p.zeta, (int64_t(n) * p.H + h) * p.Dc + c) = z;
  }
  if (consume && p.du && writer) *fptr(p.du, (int64_t(n) * p.H + h) * p.Dc + c) = du;
}

template <typename T, int RPT, int RG, int TCN>
cudaError_t launch_tc(const RecurrentPass& p, int tc, cudaStream_t stream) {
  const int ctiles = (p.Dc + BC - 1) / BC;
  const size_t smem = smem_floats<RPT, RG>(tc) * sizeof(float);
  auto kernel = recurrent_kernel<T, RPT, RG, TCN>;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
  }
  kernel<<<unsigned(int64_t(p.N) * p.H * ctiles), Shape<RPT, RG, TCN>::NT, smem, stream>>>(p, tc);
  return cudaGetLastError();
}

template <typename T, int RPT, int RG>
cudaError_t launch(const RecurrentPass& p, cudaStream_t stream) {
  const int ctiles = (p.Dc + BC - 1) / BC;
  const int64_t blocks = int64_t(p.N) * p.H * ctiles;
  if (blocks == 0) return cudaSuccess;
  // Without cu_seqlens the longest sequence is T: short ones (decode) get small chunks.
  // Decode (every sequence one token) has its own instantiation: prefetch registers for a
  // 16-step chunk would cost it most of its occupancy.
  const int tc = (p.cu_seqlens == nullptr && p.T < TC) ? (p.T > 0 ? p.T : 1) : TC;
  if (tc == 1) return launch_tc<T, RPT, RG, 1>(p, 1, stream);
  return launch_tc<T, RPT, RG, TC>(p, tc, stream);
}

}  // namespace recurrent_detail

}  // namespace fla
