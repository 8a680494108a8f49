// CUDA host glue: the kernels run on the current stream of the inputs' device (the ops set the
// device guard; chunk_rwkv7's windows also on a second stream, which the current one waits for
// before the op returns); no host synchronisation, so every op is CUDA-graph safe.
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../ops/backend_kernels.h"

namespace fla {
namespace {

const char* engine_name(const RecurrentPass&) { return "recurrent sweep"; }
const char* engine_name(const ChunkPass&) { return "chunk kernel"; }
const char* engine_name(const DplrPass&) { return "DPLR (RWKV7) kernel"; }
const char* engine_name(const DplrChunkPass&) { return "chunk_rwkv7 kernel"; }

template <class Pass, const char* (*Launch)(const Pass&, void*)>
void run_on_current_stream(const Pass& p) {
  // No sequence or no head: every output is empty (a grid of zero blocks is a launch error).
  if (p.N == 0 || p.H == 0) return;
  const char* err = Launch(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, "fla_ext: CUDA ", engine_name(p), " failed: ", err);
}

// chunk_rwkv7 in windows of the chunk index (DplrChunkPass::window_chunks) runs its sequential
// kernels on a second stream: a pool stream of high priority, so that the block scheduler gives
// the sweeps' few long-lived CTAs the SM slots that the parallel kernels' short ones free.
void run_dplr_chunk(const DplrChunkPass& pass) {
  DplrChunkPass p = pass;
  if (p.window_chunks > 0) p.side_stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/true).stream();
  run_on_current_stream<DplrChunkPass, dplr_chunk_cuda>(p);
}

struct CudaEngines {
  static constexpr ops::Runner recurrent = &run_on_current_stream<RecurrentPass, recurrent_cuda>;
  static constexpr ops::ChunkRunner chunk = &run_on_current_stream<ChunkPass, chunk_cuda>;
  static constexpr ops::DplrRunner dplr = &run_on_current_stream<DplrPass, dplr_cuda>;
  static constexpr ops::DplrChunkRunner dplr_chunk = &run_dplr_chunk;
};

}  // namespace

TORCH_LIBRARY_IMPL(fla, CUDA, m) { ops::register_backend_kernels<CudaEngines>(m); }

}  // namespace fla
