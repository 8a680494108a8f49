// GSA's chunked core (ops/chunk_gsa_core.cpp): both GLA passes and the softmax between them as one op
// with its own backward, so that the slot logits ok and their gradient dp go between the passes
// in float32 straight from the engine's accumulators (ChunkPass o_acc / dq_acc), with no casts.
// fla::chunk_gsa (ops/gsa.cpp) checks the arguments, forms fla's g=None gate and repeats grouped
// heads, then calls it.
#pragma once
#include <tuple>

#include "chunk.h"

namespace fla::ops {

// FLA_EXT_CHECKS value checks of GSA's arguments under their user-facing names (g: a log decay;
// g may be undefined), all before either pass runs.
void check_gsa_values(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& s,
                      const Tensor& g, const std::optional<Tensor>& hk0,
                      const std::optional<Tensor>& hv0);

// (o, hk, hv, p, hst1, hst2, amat2): p is the float32 softmax (empty unless `train`), the rest
// the passes' kept workspaces (empty where the backend keeps none).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_gsa_core_train(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& s, const Tensor& g,
    std::optional<double> scale, const std::optional<Tensor>& hk0,
    const std::optional<Tensor>& hv0, bool output_final_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first, bool train, ChunkRunner run);

// (dq, dk, dv, ds, dg, dhk0, dhv0).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_gsa_core_bwd(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& s, const Tensor& g,
    const Tensor& p, const Tensor& grad_o, const std::optional<Tensor>& grad_hk,
    const std::optional<Tensor>& grad_hv, std::optional<double> scale,
    const std::optional<Tensor>& hk0, const std::optional<Tensor>& hv0,
    const std::optional<Tensor>& cu_seqlens, bool head_first, const std::optional<Tensor>& hst1,
    const std::optional<Tensor>& hst2, const std::optional<Tensor>& amat2, ChunkRunner run);

// Backend adaptors with the exact schema signatures, instantiated by cpu/ and cuda/.
template <ChunkRunner R>
std::tuple<Tensor, Tensor, Tensor> chunk_gsa_core_impl(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& s, const Tensor& g,
    std::optional<double> scale, const std::optional<Tensor>& hk0,
    const std::optional<Tensor>& hv0, bool output_final_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first) {
  auto r = chunk_gsa_core_train(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens,
                                head_first, false, R);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
}

template <ChunkRunner R>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_gsa_core_train_impl(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& s, const Tensor& g,
    std::optional<double> scale, const std::optional<Tensor>& hk0,
    const std::optional<Tensor>& hv0, bool output_final_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first) {
  return chunk_gsa_core_train(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens,
                              head_first, true, R);
}

template <ChunkRunner R>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_gsa_core_bwd_impl(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& s, const Tensor& g,
    const Tensor& p, const Tensor& grad_o, const std::optional<Tensor>& grad_hk,
    const std::optional<Tensor>& grad_hv, std::optional<double> scale,
    const std::optional<Tensor>& hk0, const std::optional<Tensor>& hv0,
    const std::optional<Tensor>& cu_seqlens, bool head_first, const std::optional<Tensor>& hst1,
    const std::optional<Tensor>& hst2, const std::optional<Tensor>& amat2) {
  return chunk_gsa_core_bwd(q, k, v, s, g, p, grad_o, grad_hk, grad_hv, scale, hk0, hv0,
                            cu_seqlens, head_first, hst1, hst2, amat2, R);
}

}  // namespace fla::ops
