#include "dispatch.cuh"
#include "recurrent.h"

namespace fla {

FLA_DECLARE_LAUNCH(launch_recurrent, RecurrentPass)

const char* recurrent_cuda(const RecurrentPass& p, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  return launch_for_dtype(p.dtype, [&](auto t) { return launch_recurrent<decltype(t)>(p, s); });
}

}  // namespace fla
