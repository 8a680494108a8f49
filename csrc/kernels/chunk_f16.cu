#include "chunk_vdecay.cuh"
namespace fla {
template cudaError_t launch_chunk<__half>(const ChunkPass&, cudaStream_t);
template cudaError_t launch_chunk_vdecay<__half>(const ChunkPass&, cudaStream_t);
}
