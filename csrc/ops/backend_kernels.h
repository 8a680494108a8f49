// The backend kernels of every op, for one backend: `Engines` names the runner of each engine
// (recurrent, chunk, dplr, dplr_chunk) on that backend; cpu/ and cuda/ register this one list at
// their dispatch key, so a new op is added in one place.
#pragma once
#include <torch/library.h>

#include "chunk.h"
#include "gla.h"
#include "gsa.h"
#include "rwkv6.h"
#include "rwkv7.h"

namespace fla::ops {

template <class Engines>
void register_backend_kernels(torch::Library& m) {
  constexpr Runner rec = Engines::recurrent;
  constexpr ChunkRunner chunk = Engines::chunk;
  constexpr DplrRunner dplr = Engines::dplr;
  constexpr DplrChunkRunner dplr_chunk = Engines::dplr_chunk;
  m.impl("fused_recurrent_rwkv6", &fused_recurrent_rwkv6_impl<rec>);
  m.impl("fused_recurrent_rwkv6_bwd", &fused_recurrent_rwkv6_bwd_impl<rec>);
  m.impl("fused_recurrent_gla", &fused_recurrent_gla_impl<rec>);
  m.impl("fused_recurrent_gla_bwd", &fused_recurrent_gla_bwd_impl<rec>);
  m.impl("chunk_gla", &chunk_gla_impl<chunk>);
  m.impl("chunk_gla_bwd", &chunk_gla_bwd_impl<chunk>);
  m.impl("chunk_gla_train", &chunk_gla_train_impl<chunk>);
  m.impl("chunk_rwkv6", &chunk_rwkv6_impl<chunk>);
  m.impl("chunk_rwkv6_bwd", &chunk_rwkv6_bwd_impl<chunk>);
  m.impl("chunk_rwkv6_train", &chunk_rwkv6_train_impl<chunk>);
  m.impl("chunk_gsa_core", &chunk_gsa_core_impl<chunk>);
  m.impl("chunk_gsa_core_train", &chunk_gsa_core_train_impl<chunk>);
  m.impl("chunk_gsa_core_bwd", &chunk_gsa_core_bwd_impl<chunk>);
  m.impl("fused_recurrent_rwkv7", &fused_recurrent_rwkv7_impl<dplr>);
  m.impl("fused_recurrent_rwkv7_bwd", &fused_recurrent_rwkv7_bwd_impl<dplr>);
  m.impl("chunk_rwkv7", &chunk_rwkv7_impl<dplr_chunk>);
  m.impl("chunk_rwkv7_train", &chunk_rwkv7_train_impl<dplr_chunk>);
  m.impl("chunk_rwkv7_bwd", &chunk_rwkv7_bwd_impl<dplr_chunk>);
}

}  // namespace fla::ops
