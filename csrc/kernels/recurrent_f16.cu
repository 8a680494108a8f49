#include "recurrent_launch.cuh"
namespace fla {
template cudaError_t launch_recurrent<__half>(const RecurrentPass&, cudaStream_t);
}
