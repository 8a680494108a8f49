#include "dispatch.cuh"
#include "dplr.h"

namespace fla {

FLA_DECLARE_LAUNCH(launch_dplr, DplrPass)

const char* dplr_cuda(const DplrPass& p, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  return launch_for_dtype(p.dtype, [&](auto t) { return launch_dplr<decltype(t)>(p, s); });
}

}  // namespace fla
