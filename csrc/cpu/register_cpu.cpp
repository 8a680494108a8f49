// CPU backend: every engine's CPU implementation (at::parallel_for over sequences, heads, tiles).
#include <torch/library.h>

#include "../ops/backend_kernels.h"

namespace fla {
namespace {
struct CpuEngines {
  static constexpr ops::Runner recurrent = &recurrent_cpu;
  static constexpr ops::ChunkRunner chunk = &chunk_cpu;
  static constexpr ops::DplrRunner dplr = &dplr_cpu;
  static constexpr ops::DplrChunkRunner dplr_chunk = &dplr_chunk_cpu;
};
}  // namespace

TORCH_LIBRARY_IMPL(fla, CPU, m) { ops::register_backend_kernels<CpuEngines>(m); }

}  // namespace fla
