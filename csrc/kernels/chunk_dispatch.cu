#include "dispatch.cuh"
#include "chunk.h"

namespace fla {

FLA_DECLARE_LAUNCH(launch_chunk, ChunkPass)

const char* chunk_cuda(const ChunkPass& p, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  return launch_for_dtype(p.dtype, [&](auto t) { return launch_chunk<decltype(t)>(p, s); });
}

}  // namespace fla
