// GLA fused-recurrent ops (docs/algorithms.md §4): sweeps of the recurrent engine. gk (key side) and
// gv (value side) are optional log decays.
#pragma once
#include <tuple>

#include "common.h"

namespace fla::ops {

std::tuple<Tensor, Tensor> fused_recurrent_gla_fwd(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& gk,
    const std::optional<Tensor>& gv, std::optional<double> scale,
    const std::optional<Tensor>& initial_state, bool output_final_state, bool reverse,
    const std::optional<Tensor>& cu_seqlens, bool head_first, Runner run);

// Returns (dq, dk, dv, dgk, dgv, dh0); dgk / dgv / dh0 are empty when gk / gv / h0 are absent.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> fused_recurrent_gla_bwd(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& gk,
    const std::optional<Tensor>& gv, const Tensor& grad_o,
    const std::optional<Tensor>& grad_final_state, std::optional<double> scale,
    const std::optional<Tensor>& initial_state, bool reverse,
    const std::optional<Tensor>& cu_seqlens, bool head_first, Runner run);

template <Runner R>
std::tuple<Tensor, Tensor> fused_recurrent_gla_impl(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& gk,
    const std::optional<Tensor>& gv, std::optional<double> scale,
    const std::optional<Tensor>& initial_state, bool output_final_state, bool reverse,
    const std::optional<Tensor>& cu_seqlens, bool head_first) {
  return fused_recurrent_gla_fwd(q, k, v, gk, gv, scale, initial_state, output_final_state,
                                 reverse, cu_seqlens, head_first, R);
}

template <Runner R>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> fused_recurrent_gla_bwd_impl(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& gk,
    const std::optional<Tensor>& gv, const Tensor& grad_o,
    const std::optional<Tensor>& grad_final_state, std::optional<double> scale,
    const std::optional<Tensor>& initial_state, bool reverse,
    const std::optional<Tensor>& cu_seqlens, bool head_first) {
  return fused_recurrent_gla_bwd(q, k, v, gk, gv, grad_o, grad_final_state, scale, initial_state,
                                 reverse, cu_seqlens, head_first, R);
}

}  // namespace fla::ops
