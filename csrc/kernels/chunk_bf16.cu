#include "chunk.cuh"
namespace fla {
template cudaError_t launch_chunk<__nv_bfloat16>(const ChunkPass&, cudaStream_t);
}
