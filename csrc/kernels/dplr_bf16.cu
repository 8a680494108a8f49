#include "dplr_launch.cuh"
namespace fla {
template cudaError_t launch_dplr<__nv_bfloat16>(const DplrPass&, cudaStream_t);
}
