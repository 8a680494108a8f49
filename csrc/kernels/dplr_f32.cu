#include "dplr_launch.cuh"
namespace fla {
template cudaError_t launch_dplr<float>(const DplrPass&, cudaStream_t);
}
