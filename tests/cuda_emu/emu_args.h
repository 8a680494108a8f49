// Torch tensors as the emulated kernels' arguments, and their NaN-poisoned outputs and shared
// memory: a read of an element no thread (or no kernel) wrote shows in the results.
#pragma once
#include <torch/extension.h>

#include "emu.h"
#include "tensor_args.h"  // VecArg, MatArg

namespace emu {

// A [B, T, H, D] activation / a [N, H, rows, cols] state, any strides.
inline fla::VecArg vec(const torch::Tensor& t) {
  fla::VecArg v;
  v.ptr = t.data_ptr(), v.sb = t.stride(0), v.st = t.stride(1), v.sh = t.stride(2), v.sd = t.stride(3);
  return v;
}
inline fla::MatArg mat(const torch::Tensor& t) {
  fla::MatArg m;
  m.ptr = t.data_ptr(), m.sn = t.stride(0), m.sh = t.stride(1), m.sr = t.stride(2), m.sc = t.stride(3);
  return m;
}
inline torch::Tensor poison(at::IntArrayRef s, at::ScalarType t = torch::kFloat) {
  return torch::full(s, NAN, t);
}

// kernel() as one CTA whose shared memory (the host arrays standing for it) starts NaN-filled.
template <class F, class... Smem>
void poisoned_cta(const F& kernel, Smem&... smem) {
  if (threadIdx.x == 0)
    (std::fill_n(reinterpret_cast<float*>(&smem[0]), sizeof(smem) / sizeof(float), NAN), ...);
  __syncthreads();
  kernel();
}

}  // namespace emu
