#include "dplr_chunk_launch.cuh"
namespace fla {
template cudaError_t launch_dplr_chunk<float>(const DplrChunkPass&, cudaStream_t);
}
