// Picks the DPLR kernel for a pass: the one-token decode kernel when it applies, else the
// sequential engine with the fewest rows per thread that cover K.
#pragma once
#include "dplr.cuh"
#include "dplr_decode.cuh"

namespace fla {

template <typename T>
cudaError_t launch_dplr(const DplrPass& p, cudaStream_t stream) {
  if (dplr_decode_detail::fits(p)) return dplr_decode_detail::launch<T>(p, stream);
  using dplr_detail::launch;
  if (p.K <= 8) return launch<T, 1>(p, stream);
  if (p.K <= 16) return launch<T, 2>(p, stream);
  if (p.K <= 32) return launch<T, 4>(p, stream);
  if (p.K <= 64) return launch<T, 8>(p, stream);
  if (p.K <= 128) return launch<T, 16>(p, stream);
  return launch<T, 32>(p, stream);
}

}  // namespace fla
