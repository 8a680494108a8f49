#include "recurrent.cuh"
namespace fla {
template cudaError_t launch_recurrent<float>(const RecurrentPass&, cudaStream_t);
}
