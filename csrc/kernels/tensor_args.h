// How every engine sees a tensor: its element type and a pointer with strides (in elements).
// Torch-free, shared by the CPU and CUDA backends of all four engines (recurrent, chunk, dplr,
// dplr_chunk); the op layer (ops/common.h Layout::vec, mat) fills them from at::Tensor.
#pragma once
#include <cstdint>

#include "sequence.h"  // FLA_HD

namespace fla {

enum class DType : int { f32 = 0, bf16 = 1, f16 = 2, f64 = 3 };

// A per-step vector stored as [B, T, H, D] (any strides, in elements). The batch index is the
// sequence index without cu_seqlens and 0 with it; t is the absolute time index.
struct VecArg {
  const void* ptr = nullptr;
  int64_t sb = 0, st = 0, sh = 0, sd = 1;
  FLA_HD bool on() const { return ptr != nullptr; }
};

// "acc" buffers (states, workspaces) are fp32, or fp64 when the inputs are fp64 (CPU only).
// A per-(sequence, head) acc matrix [N, H, rows, cols] (any strides): states and their grads.
struct MatArg {
  void* ptr = nullptr;
  int64_t sn = 0, sh = 0, sr = 0, sc = 0;
  FLA_HD bool on() const { return ptr != nullptr; }
};

}  // namespace fla
