#include "dispatch.cuh"
#include "dplr.h"

namespace fla {

FLA_ENGINE_ENTRY(dplr_cuda, launch_dplr, DplrPass)

}  // namespace fla
