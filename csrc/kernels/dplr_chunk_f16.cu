#include "dplr_chunk.cuh"
namespace fla {
template cudaError_t launch_dplr_chunk<__half>(const DplrChunkPass&, cudaStream_t);
}
