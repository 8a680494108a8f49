// RWKV6 ops: argument checks, kernel views, and the sweeps that make up forward and backward.
#pragma once
#include <tuple>

#include "common.h"

namespace fla::ops {

struct Rwkv6Args : DiagArgs {
  Tensor uc;  // u contiguous [H, K], own dtype (float64 inputs: float64)
};
// The shared checks of the RWKV6 ops (fused recurrent and chunk).
Rwkv6Args check_rwkv6(const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w,
                      const Tensor& u, std::optional<double> scale,
                      const std::optional<Tensor>& h0, const std::optional<Tensor>& cu_seqlens,
                      bool head_first);

std::tuple<Tensor, Tensor> fused_recurrent_rwkv6_fwd(
    const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& u,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, bool reverse, const std::optional<Tensor>& cu_seqlens,
    bool head_first, Runner run);

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> fused_recurrent_rwkv6_bwd(
    const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& u,
    const Tensor& grad_o, const std::optional<Tensor>& grad_final_state,
    std::optional<double> scale, const std::optional<Tensor>& initial_state, bool reverse,
    const std::optional<Tensor>& cu_seqlens, bool head_first, Runner run);

// Backend adaptors with the exact schema signatures, instantiated by cpu/ and cuda/.
template <Runner R>
std::tuple<Tensor, Tensor> fused_recurrent_rwkv6_impl(
    const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& u,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, bool reverse, const std::optional<Tensor>& cu_seqlens,
    bool head_first) {
  return fused_recurrent_rwkv6_fwd(r, k, v, w, u, scale, initial_state, output_final_state,
                                   reverse, cu_seqlens, head_first, R);
}

template <Runner R>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> fused_recurrent_rwkv6_bwd_impl(
    const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& u,
    const Tensor& grad_o, const std::optional<Tensor>& grad_final_state,
    std::optional<double> scale, const std::optional<Tensor>& initial_state, bool reverse,
    const std::optional<Tensor>& cu_seqlens, bool head_first) {
  return fused_recurrent_rwkv6_bwd(r, k, v, w, u, grad_o, grad_final_state, scale, initial_state,
                                   reverse, cu_seqlens, head_first, R);
}

}  // namespace fla::ops
