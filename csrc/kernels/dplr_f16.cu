#include "dplr_launch.cuh"
namespace fla {
template cudaError_t launch_dplr<__half>(const DplrPass&, cudaStream_t);
}
