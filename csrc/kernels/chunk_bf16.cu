#include "chunk_vdecay.cuh"
namespace fla {
template cudaError_t launch_chunk<__nv_bfloat16>(const ChunkPass&, cudaStream_t);
template cudaError_t launch_chunk_vdecay<__nv_bfloat16>(const ChunkPass&, cudaStream_t);
}
