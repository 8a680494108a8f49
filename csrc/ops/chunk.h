// Chunked GLA and RWKV6 ops (docs/algorithms.md §4-§5, §7.1): one chunk engine (kernels/chunk.h) with
// an inclusive (GLA) or exclusive-plus-bonus (RWKV6) reader. GLA's decays are optional and on
// either side of the state: g (keys, [.., K]) and gv (values, [.., V]; GSA pass 1).
#pragma once
#include <tuple>

#include "../kernels/chunk.h"
#include "common.h"

namespace fla::ops {

using ChunkRunner = void (*)(const ChunkPass&);

// One chunk pass of the engine (ops/chunk_gla_rwkv6.cpp), for the families built on it (GLA, RWKV6, GSA).
// Forward: (o, final state, hst, amat), the last two empty unless `keep`; o_acc: o in the acc type
// (float32, float64 for float64 inputs) from the accumulators. Under autograd on CUDA a forward
// keeps its workspaces for the backward (keeps_workspaces): a key-side pass hst and amat, a
// value-side pass hst alone (its backward's pair matrices are of dO).
bool keeps_workspaces(const Tensor& q);
std::tuple<Tensor, Tensor, Tensor, Tensor> chunk_forward(
    const DiagArgs& a, Reader reader, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& g, const Tensor& gv, const Tensor& uc, const std::optional<Tensor>& h0,
    bool output_final_state, bool keep, ChunkRunner run, bool o_acc, bool o_softmax = false,
    const Tensor& o_softmax_acc = Tensor());
struct ChunkGrads {
  Tensor dq, dk, dv, dg, dgv, du, dh0;
};
// Backward; dq_acc: dq in the acc type. hst_in / amat_in: the forward's kept workspaces, or none.
// dv_into / dgv_into (where defined): tensors of v's / gv's size and dtype that dv / dgv are
// added into and returned as (ChunkPass dv_adds / dgv_adds), instead of new ones.
// dq_softmax_w (where defined): the acc-type softmax weights, q's size, whose backward dq's rows
// go through (ChunkPass::dq_softmax_w; dq then in q's dtype, dq_acc off).
ChunkGrads chunk_backward(const DiagArgs& a, Reader reader, const Tensor& q, const Tensor& k,
                          const Tensor& v, const Tensor& g, const Tensor& gv, const Tensor& uc,
                          const Tensor& grad_o, const std::optional<Tensor>& dht,
                          const std::optional<Tensor>& h0, const std::optional<Tensor>& hst_in,
                          const std::optional<Tensor>& amat_in, const char* qn,
                          ChunkRunner run, bool dq_acc, const Tensor& dv_into = Tensor(),
                          const Tensor& dgv_into = Tensor(), const Tensor& dq_softmax_w = Tensor());

std::tuple<Tensor, Tensor> chunk_gla_fwd(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& g,
    const std::optional<Tensor>& gv, std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, const std::optional<Tensor>& cu_seqlens, bool head_first,
    ChunkRunner run);

// The forward plus the workspaces the backward reuses (hst, amat; empty tensors when the
// backend keeps none: only CUDA does, and only for key-side passes).
std::tuple<Tensor, Tensor, Tensor, Tensor> chunk_gla_train(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& g,
    const std::optional<Tensor>& gv, std::optional<double> scale,
    const std::optional<Tensor>& initial_state, bool output_final_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first, ChunkRunner run);

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_gla_bwd(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& g,
    const std::optional<Tensor>& gv, const Tensor& grad_o,
    const std::optional<Tensor>& grad_final_state, std::optional<double> scale,
    const std::optional<Tensor>& initial_state, const std::optional<Tensor>& cu_seqlens,
    bool head_first, const std::optional<Tensor>& hst, const std::optional<Tensor>& amat,
    ChunkRunner run);

std::tuple<Tensor, Tensor> chunk_rwkv6_fwd(
    const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& u,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, const std::optional<Tensor>& cu_seqlens, bool head_first,
    ChunkRunner run);

std::tuple<Tensor, Tensor, Tensor, Tensor> chunk_rwkv6_train(
    const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& u,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, const std::optional<Tensor>& cu_seqlens, bool head_first,
    ChunkRunner run);

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_rwkv6_bwd(
    const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& u,
    const Tensor& grad_o, const std::optional<Tensor>& grad_final_state,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first, const std::optional<Tensor>& hst,
    const std::optional<Tensor>& amat, ChunkRunner run);

// Backend adaptors with the exact schema signatures, instantiated by cpu/ and cuda/.
template <ChunkRunner R>
std::tuple<Tensor, Tensor> chunk_gla_impl(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const std::optional<Tensor>& g,
                                          const std::optional<Tensor>& gv,
                                          std::optional<double> scale,
                                          const std::optional<Tensor>& initial_state,
                                          bool output_final_state,
                                          const std::optional<Tensor>& cu_seqlens,
                                          bool head_first) {
  return chunk_gla_fwd(q, k, v, g, gv, scale, initial_state, output_final_state, cu_seqlens,
                       head_first, R);
}

template <ChunkRunner R>
std::tuple<Tensor, Tensor, Tensor, Tensor> chunk_gla_train_impl(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& g,
    const std::optional<Tensor>& gv, std::optional<double> scale,
    const std::optional<Tensor>& initial_state, bool output_final_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first) {
  return chunk_gla_train(q, k, v, g, gv, scale, initial_state, output_final_state, cu_seqlens,
                         head_first, R);
}

template <ChunkRunner R>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_gla_bwd_impl(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& g,
    const std::optional<Tensor>& gv, const Tensor& grad_o,
    const std::optional<Tensor>& grad_final_state, std::optional<double> scale,
    const std::optional<Tensor>& initial_state, const std::optional<Tensor>& cu_seqlens,
    bool head_first, const std::optional<Tensor>& hst, const std::optional<Tensor>& amat) {
  return chunk_gla_bwd(q, k, v, g, gv, grad_o, grad_final_state, scale, initial_state,
                       cu_seqlens, head_first, hst, amat, R);
}

template <ChunkRunner R>
std::tuple<Tensor, Tensor> chunk_rwkv6_impl(const Tensor& r, const Tensor& k, const Tensor& v,
                                            const Tensor& w, const Tensor& u,
                                            std::optional<double> scale,
                                            const std::optional<Tensor>& initial_state,
                                            bool output_final_state,
                                            const std::optional<Tensor>& cu_seqlens,
                                            bool head_first) {
  return chunk_rwkv6_fwd(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens,
                         head_first, R);
}

template <ChunkRunner R>
std::tuple<Tensor, Tensor, Tensor, Tensor> chunk_rwkv6_train_impl(
    const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& u,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, const std::optional<Tensor>& cu_seqlens, bool head_first) {
  return chunk_rwkv6_train(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens,
                           head_first, R);
}

template <ChunkRunner R>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_rwkv6_bwd_impl(
    const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& u,
    const Tensor& grad_o, const std::optional<Tensor>& grad_final_state,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first, const std::optional<Tensor>& hst,
    const std::optional<Tensor>& amat) {
  return chunk_rwkv6_bwd(r, k, v, w, u, grad_o, grad_final_state, scale, initial_state,
                         cu_seqlens, head_first, hst, amat, R);
}

}  // namespace fla::ops
