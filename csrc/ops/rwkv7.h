// RWKV7 (DPLR) fused-recurrent ops: argument checks, kernel views, workspaces, dispatch.
#pragma once
#include <tuple>

#include "../kernels/dplr.h"
#include "common.h"

namespace fla::ops {

using DplrRunner = void (*)(const DplrPass&);

std::tuple<Tensor, Tensor> fused_recurrent_rwkv7_fwd(
    const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v, const Tensor& a,
    const Tensor& b, std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, bool reverse, const std::optional<Tensor>& cu_seqlens,
    bool head_first, DplrRunner run);

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> fused_recurrent_rwkv7_bwd(
    const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v, const Tensor& a,
    const Tensor& b, const Tensor& grad_o, const std::optional<Tensor>& grad_final_state,
    std::optional<double> scale, const std::optional<Tensor>& initial_state, bool reverse,
    const std::optional<Tensor>& cu_seqlens, bool head_first, DplrRunner run);

// Backend adaptors with the exact schema signatures, instantiated by cpu/ and cuda/.
template <DplrRunner R>
std::tuple<Tensor, Tensor> fused_recurrent_rwkv7_impl(
    const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v, const Tensor& a,
    const Tensor& b, std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, bool reverse, const std::optional<Tensor>& cu_seqlens,
    bool head_first) {
  return fused_recurrent_rwkv7_fwd(r, w, k, v, a, b, scale, initial_state, output_final_state,
                                   reverse, cu_seqlens, head_first, R);
}

template <DplrRunner R>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> fused_recurrent_rwkv7_bwd_impl(
    const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v, const Tensor& a,
    const Tensor& b, const Tensor& grad_o, const std::optional<Tensor>& grad_final_state,
    std::optional<double> scale, const std::optional<Tensor>& initial_state, bool reverse,
    const std::optional<Tensor>& cu_seqlens, bool head_first) {
  return fused_recurrent_rwkv7_bwd(r, w, k, v, a, b, grad_o, grad_final_state, scale,
                                   initial_state, reverse, cu_seqlens, head_first, R);
}

}  // namespace fla::ops
