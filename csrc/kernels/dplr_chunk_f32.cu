#include "dplr_chunk.cuh"
namespace fla {
template cudaError_t launch_dplr_chunk<float>(const DplrChunkPass&, cudaStream_t);
}
