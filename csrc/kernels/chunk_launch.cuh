// Launch sequences of the chunk engine (kernels/chunk.cuh has the overview; the kernels in
// chunk_intra.cuh, chunk_out.cuh, chunk_grad_qk.cuh, chunk_state.cuh) for the key-side decay;
// chunk_vdecay.cuh runs the value-side decay through the same launchers.
#pragma once
#include "chunk_intra.cuh"
#include "chunk_out.cuh"
#include "chunk_grad_qk.cuh"
#include "chunk_state.cuh"
#include "device_sms.cuh"

namespace fla {
namespace chunk_detail {

constexpr size_t kTileBytes = sizeof(float) * C * LD;
constexpr size_t kIntraSmem = 3 * kTileBytes + sizeof(Decays) + sizeof(float) * (DT + 4 * NSC * DT);
constexpr size_t kGradSmem = 6 * kTileBytes + sizeof(Decays) + sizeof(float) * 3 * DT;

template <typename K>
inline cudaError_t set_smem(K kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

// The pair matrices into amat.
template <typename T, Reader RD>
cudaError_t launch_pairs(const ChunkPass& p, int64_t slots, cudaStream_t stream) {
  auto intra = chunk_intra_kernel<T, RD>;
  cudaError_t e = set_smem(intra, kIntraSmem);
  if (e != cudaSuccess) return e;
  if (slots > 0) intra<<<dim3(unsigned(slots), p.H), NTH, kIntraSmem, stream>>>(p, key_rows_vec<T>(p));
  return cudaGetLastError();
}

// The sequential state kernel: NK K tiles per CTA (with OUT, all of K); in windows of the chunk
// index where state_windows (the window the slowest grid index, its flags zeroed first).
template <typename T, Reader RD, bool OUT, int NK, bool BWD = false>
cudaError_t launch_state(const ChunkPass& p, cudaStream_t stream) {
  const int ntk = (p.K + DT - 1) / DT, ntv = (p.V + DT - 1) / DT;
  const unsigned z = unsigned(ntv * ((ntk + NK - 1) / NK));
  if (p.N <= 0 || p.H <= 0 || z == 0) return cudaGetLastError();  // an empty grid is an invalid launch
  const bool vec = state_vec<T>(p, OUT, BWD);
  if (state_windows(p)) {
    auto state = chunk_state_kernel<T, RD, OUT, NK, BWD, true>;
    const size_t smem = state_smem(OUT, NK, true);
    cudaError_t e = set_smem(state, smem);
    if (e != cudaSuccess) return e;
    const int64_t windows = chunk_window_count(p.T, p.window_chunks);
    const size_t flags = sizeof(int) * size_t(windows) * p.N * p.H * z;
    if ((e = cudaMemsetAsync(p.window_flags, 0, flags, stream)) != cudaSuccess) return e;
    state<<<dim3(unsigned(p.N), p.H, unsigned(z * windows)), NTH, smem, stream>>>(p, ntv, vec);
    return cudaGetLastError();
  }
  auto launch = [&](auto state) {
    const size_t smem = state_smem(OUT);
    cudaError_t e = set_smem(state, smem);
    if (e != cudaSuccess) return e;
    state<<<dim3(unsigned(p.N), p.H, z), NTH, smem, stream>>>(p, ntv, vec);
    return cudaGetLastError();
  };
  if constexpr (OUT && NK == 1) {  // more CTAs than one wave at one an SM: two an SM
    if (int64_t(p.N) * p.H * z > device_sm_count()) return launch(chunk_state_kernel<T, RD, OUT, NK, BWD, false, 2>);
  }
  return launch(chunk_state_kernel<T, RD, OUT, NK, BWD>);
}

// Forward state for a backward: (PAIRS) the pair matrices, then hst (and hT).
template <typename T, Reader RD, bool PAIRS>
cudaError_t launch_forward_state(const ChunkPass& p, int64_t slots, cudaStream_t stream) {
  cudaError_t e;
  if (PAIRS && (e = launch_pairs<T, RD>(p, slots, stream)) != cudaSuccess) return e;
  return launch_state<T, RD, false, 1>(p, stream);
}

// Backward: dHst and the zeta partials (the state kernel in reverse).
template <typename T, Reader RD>
cudaError_t launch_backward_state(const ChunkPass& p, cudaStream_t stream) {
  return launch_state<T, RD, false, 1, true>(p, stream);
}

// o (DV = false) or dv (DV) from hst / dhst and amat.
template <typename T, Reader RD, bool DV>
cudaError_t launch_out(const ChunkPass& p, int64_t slots, cudaStream_t stream) {
  auto launch = [&](auto out, int nv) {
    constexpr size_t smem = out_smem(DV);
    cudaError_t e = set_smem(out, smem);
    if (e != cudaSuccess) return e;
    const unsigned z = unsigned((p.V + nv * DT - 1) / (nv * DT));
    if (slots > 0) out<<<dim3(unsigned(slots), p.H, z), NTH, smem, stream>>>(p, out_vec<T>(p, DV));
    return cudaGetLastError();
  };
  return p.V > DT ? launch(chunk_out_kernel<T, RD, DV, 2>, 2) : launch(chunk_out_kernel<T, RD, DV, 1>, 1);
}

// Whether a forward that stores its chunk-start states anyway (a training forward: hst kept)
// splits o off the sequential state kernel into the parallel out kernel. The state kernel with o
// runs a CTA per (sequence, head, V tile) over all of K; split, it runs a CTA per K tile as well
// and each chunk step is shorter (no o), and the out kernel is a pass more. At K = 128 the split
// pair is faster whatever the grid (benchmarks/NOTES.md c60: the walk over both K tiles with o is
// the longest step of the engine). At K <= 64 it splits where the fused grid fills under a
// quarter of the SMs (long sequences, few heads), unless the walks run in windows, which fill the
// SMs by design and form o in their second walk (NOTES c55).
inline bool chunk_split_out(const ChunkPass& p) {
  if (!p.hst) return false;
  if (p.K > DT) return true;
  if (state_windows(p)) return false;
  const int64_t fused_ctas = int64_t(p.N) * p.H * ((p.V + DT - 1) / DT);
  return 4 * fused_ctas <= device_sm_count();
}

// Forward: the pair matrices, then the state kernel with o when K <= 128 (its state fragments for
// all of K stay in registers) unless chunk_split_out; else the state kernel per K tile and the out
// kernel.
template <typename T, Reader RD>
cudaError_t launch_forward(const ChunkPass& p, int64_t slots, cudaStream_t stream) {
  cudaError_t e = launch_pairs<T, RD>(p, slots, stream);
  if (e != cudaSuccess) return e;
  static_assert(chunk_fused_out(2 * DT) && !chunk_fused_out(2 * DT + 1), "NK <= 2 below");
  const bool split = chunk_split_out(p);
  if (p.K <= DT && !split) return launch_state<T, RD, true, 1>(p, stream);
  if (chunk_fused_out(p.K) && !split) return launch_state<T, RD, true, 2>(p, stream);
  if ((e = launch_state<T, RD, false, 1>(p, stream)) != cudaSuccess) return e;
  return launch_out<T, RD, false>(p, slots, stream);
}

template <typename T, Reader RD>
cudaError_t launch_chunk_reader(const ChunkPass& p, cudaStream_t stream) {
  const int ntk = (p.K + DT - 1) / DT, nts = (p.V + kStateCols - 1) / kStateCols;
  const int64_t slots = chunk_slots(p.N, p.T, p.cu_seqlens != nullptr);
  if (!p.dout.on()) return launch_forward<T, RD>(p, slots, stream);
  cudaError_t e;
  // Kept workspaces come together (hst_kept implies amat_kept: ops check it).
  if (!p.hst_kept && (e = launch_forward_state<T, RD, true>(p, slots, stream)) != cudaSuccess)
    return e;
  if ((e = launch_backward_state<T, RD>(p, stream)) != cudaSuccess) return e;
  if ((e = launch_out<T, RD, true>(p, slots, stream)) != cudaSuccess) return e;
  auto dqk = chunk_grad_qk_kernel<T, RD>;
  if constexpr (RD == Reader::Inclusive) {  // GSA's pass 2 (chunk_dispatch.cu checks the rest)
    if (p.dq_softmax_w.on()) dqk = chunk_grad_qk_kernel<T, RD, false, true>;
  }
  if ((e = set_smem(dqk, kGradSmem)) != cudaSuccess) return e;
  if (slots > 0) dqk<<<dim3(unsigned(slots), p.H, ntk), NTH, kGradSmem, stream>>>(p, nts, grad_qk_vec<T>(p));
  return cudaGetLastError();
}

}  // namespace chunk_detail

template <typename T>
cudaError_t launch_chunk(const ChunkPass& p, cudaStream_t stream) {
  return p.reader == Reader::Inclusive
             ? chunk_detail::launch_chunk_reader<T, Reader::Inclusive>(p, stream)
             : chunk_detail::launch_chunk_reader<T, Reader::Exclusive>(p, stream);
}

}  // namespace fla
