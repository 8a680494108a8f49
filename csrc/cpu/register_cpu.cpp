#include <torch/library.h>

#include "../ops/chunk.h"
#include "../ops/gsa.h"
#include "../ops/gla.h"
#include "../ops/rwkv6.h"
#include "../ops/rwkv7.h"

namespace fla {
namespace {
void run_cpu(const RecurrentPass& p) { recurrent_cpu(p); }
void run_chunk_cpu(const ChunkPass& p) { chunk_cpu(p); }
void run_dplr_cpu(const DplrPass& p) { dplr_cpu(p); }
void run_dplr_chunk_cpu(const DplrChunkPass& p) { dplr_chunk_cpu(p); }
}  // namespace

TORCH_LIBRARY_IMPL(fla, CPU, m) {
  m.impl("fused_recurrent_rwkv6", &ops::fused_recurrent_rwkv6_impl<run_cpu>);
  m.impl("fused_recurrent_rwkv6_bwd", &ops::fused_recurrent_rwkv6_bwd_impl<run_cpu>);
  m.impl("fused_recurrent_gla", &ops::fused_recurrent_gla_impl<run_cpu>);
  m.impl("fused_recurrent_gla_bwd", &ops::fused_recurrent_gla_bwd_impl<run_cpu>);
  m.impl("chunk_gla", &ops::chunk_gla_impl<run_chunk_cpu>);
  m.impl("chunk_gla_bwd", &ops::chunk_gla_bwd_impl<run_chunk_cpu>);
  m.impl("chunk_gla_train", &ops::chunk_gla_train_impl<run_chunk_cpu>);
  m.impl("chunk_rwkv6", &ops::chunk_rwkv6_impl<run_chunk_cpu>);
  m.impl("chunk_rwkv6_bwd", &ops::chunk_rwkv6_bwd_impl<run_chunk_cpu>);
  m.impl("chunk_rwkv6_train", &ops::chunk_rwkv6_train_impl<run_chunk_cpu>);
  m.impl("chunk_gsa_core", &ops::chunk_gsa_core_impl<run_chunk_cpu>);
  m.impl("chunk_gsa_core_train", &ops::chunk_gsa_core_train_impl<run_chunk_cpu>);
  m.impl("chunk_gsa_core_bwd", &ops::chunk_gsa_core_bwd_impl<run_chunk_cpu>);
  m.impl("fused_recurrent_rwkv7", &ops::fused_recurrent_rwkv7_impl<run_dplr_cpu>);
  m.impl("fused_recurrent_rwkv7_bwd", &ops::fused_recurrent_rwkv7_bwd_impl<run_dplr_cpu>);
  m.impl("chunk_rwkv7", &ops::chunk_rwkv7_impl<run_dplr_chunk_cpu>);
  m.impl("chunk_rwkv7_train", &ops::chunk_rwkv7_train_impl<run_dplr_chunk_cpu>);
  m.impl("chunk_rwkv7_bwd", &ops::chunk_rwkv7_bwd_impl<run_dplr_chunk_cpu>);
}

}  // namespace fla
