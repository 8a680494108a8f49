// Picks the kernel for a sweep: the one-step decode kernel when it applies, else the chunked
// engine with the smallest shape that covers the rows.
#pragma once
#include "recurrent.cuh"
#include "recurrent_decode.cuh"

namespace fla {

// The compile-time shapes: 8 rows per thread up to Dr = 64 (8 warps per head at K = 64 hide
// more latency than 4 warps of 16 rows), then 16 and 32 rows with 8 row groups. One-token sweeps
// that the decode kernel cannot take (V % 4, strided states, gate gradients) keep 16 rows: more
// loads in flight per thread, where a single token gives no sequential work to hide them behind.
template <typename T>
cudaError_t launch_recurrent(const RecurrentPass& p, cudaStream_t stream) {
  if (decode_detail::fits(p)) return decode_detail::launch<T>(p, stream);
  using namespace recurrent_detail;
  const bool decode = p.cu_seqlens == nullptr && p.T <= 1;
  if (decode && p.Dr <= 64) return launch<T, 16, 4>(p, stream);  // more loads in flight per thread
  if (p.Dr <= 8) return launch<T, 8, 1>(p, stream);
  if (p.Dr <= 16) return launch<T, 8, 2>(p, stream);
  if (p.Dr <= 32) return launch<T, 8, 4>(p, stream);
  if (p.Dr <= 64) return launch<T, 8, 8>(p, stream);
  if (p.Dr <= 128) return launch<T, 16, 8>(p, stream);
  return launch<T, 32, 8>(p, stream);
}

}  // namespace fla
