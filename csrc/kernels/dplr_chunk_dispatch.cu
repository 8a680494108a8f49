#include "dispatch.cuh"
#include "dplr_chunk.h"

namespace fla {

FLA_ENGINE_ENTRY(dplr_chunk_cuda, launch_dplr_chunk, DplrChunkPass)

}  // namespace fla
