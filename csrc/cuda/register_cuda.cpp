// CUDA host glue: the sweeps run on the current stream of the inputs' device (the ops set the
// device guard); no host synchronisation, so every op is CUDA-graph safe.
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../ops/chunk.h"
#include "../ops/gsa.h"
#include "../ops/gla.h"
#include "../ops/rwkv6.h"
#include "../ops/rwkv7.h"

namespace fla {
namespace {
// No sequence or no head: every output is empty (a grid of zero blocks is a launch error).
template <class Pass>
bool empty_batch(const Pass& p) {
  return p.N == 0 || p.H == 0;
}

void run_cuda(const RecurrentPass& p) {
  if (empty_batch(p)) return;
  const char* err = recurrent_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, "fla_ext: CUDA recurrent sweep failed: ", err);
}
void run_chunk_cuda(const ChunkPass& p) {
  if (empty_batch(p)) return;
  const char* err = chunk_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, "fla_ext: CUDA chunk kernel failed: ", err);
}
void run_dplr_cuda(const DplrPass& p) {
  if (empty_batch(p)) return;
  const char* err = dplr_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, "fla_ext: CUDA DPLR (RWKV7) kernel failed: ", err);
}
void run_dplr_chunk_cuda(const DplrChunkPass& p) {
  if (empty_batch(p)) return;
  const char* err = dplr_chunk_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, "fla_ext: CUDA chunk_rwkv7 kernel failed: ", err);
}
}  // namespace

TORCH_LIBRARY_IMPL(fla, CUDA, m) {
  m.impl("fused_recurrent_rwkv6", &ops::fused_recurrent_rwkv6_impl<run_cuda>);
  m.impl("fused_recurrent_rwkv6_bwd", &ops::fused_recurrent_rwkv6_bwd_impl<run_cuda>);
  m.impl("fused_recurrent_gla", &ops::fused_recurrent_gla_impl<run_cuda>);
  m.impl("fused_recurrent_gla_bwd", &ops::fused_recurrent_gla_bwd_impl<run_cuda>);
  m.impl("chunk_gla", &ops::chunk_gla_impl<run_chunk_cuda>);
  m.impl("chunk_gla_bwd", &ops::chunk_gla_bwd_impl<run_chunk_cuda>);
  m.impl("chunk_gla_train", &ops::chunk_gla_train_impl<run_chunk_cuda>);
  m.impl("chunk_rwkv6", &ops::chunk_rwkv6_impl<run_chunk_cuda>);
  m.impl("chunk_rwkv6_bwd", &ops::chunk_rwkv6_bwd_impl<run_chunk_cuda>);
  m.impl("chunk_rwkv6_train", &ops::chunk_rwkv6_train_impl<run_chunk_cuda>);
  m.impl("chunk_gsa_core", &ops::chunk_gsa_core_impl<run_chunk_cuda>);
  m.impl("chunk_gsa_core_train", &ops::chunk_gsa_core_train_impl<run_chunk_cuda>);
  m.impl("chunk_gsa_core_bwd", &ops::chunk_gsa_core_bwd_impl<run_chunk_cuda>);
  m.impl("fused_recurrent_rwkv7", &ops::fused_recurrent_rwkv7_impl<run_dplr_cuda>);
  m.impl("fused_recurrent_rwkv7_bwd", &ops::fused_recurrent_rwkv7_bwd_impl<run_dplr_cuda>);
  m.impl("chunk_rwkv7", &ops::chunk_rwkv7_impl<run_dplr_chunk_cuda>);
  m.impl("chunk_rwkv7_train", &ops::chunk_rwkv7_train_impl<run_dplr_chunk_cuda>);
  m.impl("chunk_rwkv7_bwd", &ops::chunk_rwkv7_bwd_impl<run_dplr_chunk_cuda>);
}

}  // namespace fla
