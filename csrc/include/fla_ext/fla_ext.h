// Public C++ API of fla_ext for LibTorch programs: typed calls through the dispatcher, so they
// run the registered CPU/CUDA kernels and record autograd (gradients flow in C++ as in Python).
//
// Link the program against fla_ext's library (or load fla_ext/_C*.so) so that the `fla::` ops
// are registered; CMakeLists.txt builds `fla_ext_ops` for this.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace fla_ext {
namespace detail {
// The typed dispatcher handle of a registered fla op.
template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}
}  // namespace detail

// RWKV6 fused recurrent op; see fla_ext.ops.fused_recurrent_rwkv6 for shapes. Returns
// (o, final_state); final_state is an empty tensor unless output_final_state.
inline std::tuple<at::Tensor, at::Tensor> fused_recurrent_rwkv6(
    const at::Tensor& r, const at::Tensor& k, const at::Tensor& v, const at::Tensor& w,
    const at::Tensor& u, std::optional<double> scale = std::nullopt,
    const std::optional<at::Tensor>& initial_state = std::nullopt,
    bool output_final_state = false, bool reverse = false,
    const std::optional<at::Tensor>& cu_seqlens = std::nullopt, bool head_first = false) {
  static auto op =
      detail::op<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, std::optional<double>, const std::optional<at::Tensor>&, bool,
              bool, const std::optional<at::Tensor>&, bool)>("fla::fused_recurrent_rwkv6");
  return op.call(r, k, v, w, u, scale, initial_state, output_final_state, reverse, cu_seqlens,
                 head_first);
}

// GLA fused recurrent op (gk: key-side log decay [.., K], gv: value-side log decay [.., V]; each
// nullopt for none); see fla_ext.ops.fused_recurrent_gla. Returns (o, final_state).
inline std::tuple<at::Tensor, at::Tensor> fused_recurrent_gla(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& gk = std::nullopt,
    const std::optional<at::Tensor>& gv = std::nullopt, std::optional<double> scale = std::nullopt,
    const std::optional<at::Tensor>& initial_state = std::nullopt,
    bool output_final_state = false, bool reverse = false,
    const std::optional<at::Tensor>& cu_seqlens = std::nullopt, bool head_first = false) {
  static auto op =
      detail::op<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
              std::optional<double>, const std::optional<at::Tensor>&, bool, bool,
              const std::optional<at::Tensor>&, bool)>("fla::fused_recurrent_gla");
  return op.call(q, k, v, gk, gv, scale, initial_state, output_final_state, reverse, cu_seqlens,
                 head_first);
}

// Chunked GLA (training path); see fla_ext.ops.chunk_gla. g: key-side log decay [.., K], gv:
// value-side log decay [.., V] (GSA pass 1), each optional. Returns (o, final_state).
inline std::tuple<at::Tensor, at::Tensor> chunk_gla(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& g, const std::optional<at::Tensor>& gv = std::nullopt,
    std::optional<double> scale = std::nullopt,
    const std::optional<at::Tensor>& initial_state = std::nullopt,
    bool output_final_state = false, const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
    bool head_first = false) {
  static auto op = detail::op<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                           std::optional<double>, const std::optional<at::Tensor>&, bool,
                           const std::optional<at::Tensor>&, bool)>("fla::chunk_gla");
  return op.call(q, k, v, g, gv, scale, initial_state, output_final_state, cu_seqlens,
                 head_first);
}

// Chunked RWKV6 (training path); see fla_ext.ops.chunk_rwkv6. Returns (o, final_state).
inline std::tuple<at::Tensor, at::Tensor> chunk_rwkv6(
    const at::Tensor& r, const at::Tensor& k, const at::Tensor& v, const at::Tensor& w,
    const at::Tensor& u, std::optional<double> scale = std::nullopt,
    const std::optional<at::Tensor>& initial_state = std::nullopt,
    bool output_final_state = false, const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
    bool head_first = false) {
  static auto op = detail::op<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, std::optional<double>,
                           const std::optional<at::Tensor>&, bool,
                           const std::optional<at::Tensor>&, bool)>("fla::chunk_rwkv6");
  return op.call(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens,
                 head_first);
}

// RWKV7 (DPLR) fused recurrent op, differentiable: h_t = diag(exp(w_t)) h_{t-1} +
// b_t (a_t^T h_{t-1}) + k_t v_t^T, o_t = scale h_t^T r_t; see fla_ext.ops.fused_recurrent_rwkv7.
// scale defaults to K^-0.5 and output_final_state to true, as in fla. Returns (o, final_state).
inline std::tuple<at::Tensor, at::Tensor> fused_recurrent_rwkv7(
    const at::Tensor& r, const at::Tensor& w, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& a, const at::Tensor& b, std::optional<double> scale = std::nullopt,
    const std::optional<at::Tensor>& initial_state = std::nullopt,
    bool output_final_state = true, bool reverse = false,
    const std::optional<at::Tensor>& cu_seqlens = std::nullopt, bool head_first = false) {
  static auto op =
      detail::op<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, const at::Tensor&, std::optional<double>,
              const std::optional<at::Tensor>&, bool, bool, const std::optional<at::Tensor>&,
              bool)>("fla::fused_recurrent_rwkv7");
  return op.call(r, w, k, v, a, b, scale, initial_state, output_final_state, reverse, cu_seqlens,
                 head_first);
}

// Chunked RWKV7 (training path; same map as fused_recurrent_rwkv7); see fla_ext.ops.chunk_rwkv7.
// fla's defaults: scale 1.0, output_final_state false. Returns (o, final_state).
inline std::tuple<at::Tensor, at::Tensor> chunk_rwkv7(
    const at::Tensor& r, const at::Tensor& w, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& a, const at::Tensor& b, std::optional<double> scale = 1.0,
    const std::optional<at::Tensor>& initial_state = std::nullopt,
    bool output_final_state = false, const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
    bool head_first = false) {
  static auto op =
      detail::op<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, const at::Tensor&, std::optional<double>,
              const std::optional<at::Tensor>&, bool, const std::optional<at::Tensor>&, bool)>("fla::chunk_rwkv7");
  return op.call(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens,
                 head_first);
}

// Gated Slot Attention, chunked (training) or step by step (decoding); see fla_ext.ops.chunk_gsa.
// q [B, T, HQ, K]; k [B, T, H, K]; v [B, T, H, V]; s, g [B, T, H, M] (g nullopt: fla's gate derived
// from s); states hk [N, H, K, M], hv [N, H, M, V]. Returns (o, hk, hv); the states are empty
// tensors unless output_final_state.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_gsa(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& s,
    const std::optional<at::Tensor>& g, std::optional<double> scale = std::nullopt,
    const std::optional<at::Tensor>& hk0 = std::nullopt,
    const std::optional<at::Tensor>& hv0 = std::nullopt, bool output_final_state = false,
    const std::optional<at::Tensor>& cu_seqlens = std::nullopt, bool head_first = false) {
  static auto op = detail::op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const std::optional<at::Tensor>&,
                           std::optional<double>, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, bool,
                           const std::optional<at::Tensor>&, bool)>("fla::chunk_gsa");
  return op.call(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens, head_first);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_recurrent_gsa(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& s,
    const std::optional<at::Tensor>& g, std::optional<double> scale = std::nullopt,
    const std::optional<at::Tensor>& hk0 = std::nullopt,
    const std::optional<at::Tensor>& hv0 = std::nullopt, bool output_final_state = false,
    bool reverse = false, const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
    bool head_first = false) {
  static auto op = detail::op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const std::optional<at::Tensor>&,
                           std::optional<double>, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, bool, bool,
                           const std::optional<at::Tensor>&, bool)>("fla::fused_recurrent_gsa");
  return op.call(q, k, v, s, g, scale, hk0, hv0, output_final_state, reverse, cu_seqlens,
                 head_first);
}

}  // namespace fla_ext
