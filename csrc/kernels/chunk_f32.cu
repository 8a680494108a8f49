#include "chunk_vdecay.cuh"
namespace fla {
template cudaError_t launch_chunk<float>(const ChunkPass&, cudaStream_t);
template cudaError_t launch_chunk_vdecay<float>(const ChunkPass&, cudaStream_t);
}
