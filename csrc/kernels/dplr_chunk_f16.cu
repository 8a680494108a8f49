#include "dplr_chunk_launch.cuh"
namespace fla {
template cudaError_t launch_dplr_chunk<__half>(const DplrChunkPass&, cudaStream_t);
}
