#include "dispatch.cuh"
#include "dplr_chunk.h"

namespace fla {

FLA_DECLARE_LAUNCH(launch_dplr_chunk, DplrChunkPass)

const char* dplr_chunk_cuda(const DplrChunkPass& p, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  return launch_for_dtype(p.dtype, [&](auto t) { return launch_dplr_chunk<decltype(t)>(p, s); });
}

}  // namespace fla
