#include "dispatch.cuh"
#include "recurrent.h"

namespace fla {

FLA_ENGINE_ENTRY(recurrent_cuda, launch_recurrent, RecurrentPass)

}  // namespace fla
