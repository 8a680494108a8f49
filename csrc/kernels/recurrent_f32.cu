#include "recurrent_launch.cuh"
namespace fla {
template cudaError_t launch_recurrent<float>(const RecurrentPass&, cudaStream_t);
}
