// Launches of the chunked RWKV7 kernels (dplr_chunk.cuh), kept apart so that the kernels also
// compile as host code (tests/cuda_emu runs them on the CPU).
#pragma once
#include "dplr_chunk_grad.cuh"
#include "dplr_chunk_sweep.cuh"

namespace fla {
namespace dplr_chunk_detail {

template <typename K>
cudaError_t launch_with_smem(K kernel, dim3 grid, int threads, size_t bytes, const DplrChunkPass& p,
                             cudaStream_t stream) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  // All of the unified L1 as shared memory: the driver may otherwise pick a carveout that holds
  // fewer CTAs than registers and shared memory allow (these kernels stream; L1 hits are rare).
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             int(cudaSharedmemCarveoutMaxShared));
  if (e != cudaSuccess) return e;
  kernel<<<grid, threads, bytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int KC>
cudaError_t launch_k(const DplrChunkPass& p_in, cudaStream_t stream) {
  DplrChunkPass p = p_in;
  pick_paths<T>(p);
  const int64_t slots = chunk_slots<C>(p.N, p.T, p.cu_seqlens != nullptr);
  cudaError_t e = cudaSuccess;
  if (!(p.backward() && p.kept))
    e = launch_with_smem(prep_kernel<T, KC>, dim3(unsigned(slots), p.H), NT, Smem(p.K, false).bytes(), p, stream);
  if (e != cudaSuccess) return e;
  const size_t sweep_bytes = StateSmem(DplrWs(p.K, p.V), p.K, !std::is_same<T, float>::value).bytes();
  const dim3 sweeps(unsigned(int64_t(p.N) * p.H * state_tiles(p.V)));
  if (!p.backward()) return launch_with_smem(sweep_kernel<T, false, true, KC>, sweeps, NTS, sweep_bytes, p, stream);
  // The forward sweep of a backward call writes only hst (its o and hT are off), unless the
  // training forward kept them.
  if (!p.kept) {
    e = launch_with_smem(sweep_kernel<T, false, false, KC>, sweeps, NTS, sweep_bytes, p, stream);
    if (e != cudaSuccess) return e;
  }
  e = launch_with_smem(sweep_kernel<T, true, false, KC>, sweeps, NTS, sweep_bytes, p, stream);
  if (e != cudaSuccess) return e;
  return launch_with_smem(grad_kernel<T, KC>, dim3(unsigned(slots), p.H, dplr_chunk_tiles(p.K, p.V)), NT,
                          Smem(p.K, true).bytes(), p, stream);
}

// K = 64 (RWKV-7's head size) and 128 with every index derived from K a compile-time constant:
// ncu had integer multiply-adds at 22-35 % of the sweep's and prep's instructions.
template <typename T>
cudaError_t launch(const DplrChunkPass& p, cudaStream_t stream) {
  if (int64_t(p.N) * p.H == 0) return cudaSuccess;
  return p.K == 64 ? launch_k<T, 64>(p, stream) : p.K == 128 ? launch_k<T, 128>(p, stream) : launch_k<T, 0>(p, stream);
}

}  // namespace dplr_chunk_detail

template <typename T>
cudaError_t launch_dplr_chunk(const DplrChunkPass& p, cudaStream_t stream) {
  return dplr_chunk_detail::launch<T>(p, stream);
}

}  // namespace fla
