#include "chunk.cuh"
namespace fla {
template cudaError_t launch_chunk<__half>(const ChunkPass&, cudaStream_t);
}
