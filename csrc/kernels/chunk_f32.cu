#include "chunk.cuh"
namespace fla {
template cudaError_t launch_chunk<float>(const ChunkPass&, cudaStream_t);
}
