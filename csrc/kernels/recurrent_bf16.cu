#include "recurrent_launch.cuh"
namespace fla {
template cudaError_t launch_recurrent<__nv_bfloat16>(const RecurrentPass&, cudaStream_t);
}
