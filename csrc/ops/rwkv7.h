// RWKV7 (DPLR) ops, fused recurrent (fused_recurrent_rwkv7.cpp) and chunked (chunk_rwkv7.cpp): argument
// checks, kernel views, workspaces, dispatch.
#pragma once
#include <tuple>

#include "../kernels/dplr.h"
#include "../kernels/dplr_chunk.h"
#include "common.h"

namespace fla::ops {

using DplrRunner = void (*)(const DplrPass&);
// The operands of either RWKV7 engine (kernels/dplr.h DplrArgs) from checked arguments.
void set_dplr_args(DplrArgs& p, const DiagArgs& d, const Tensor& r, const Tensor& w,
                   const Tensor& k, const Tensor& v, const Tensor& a, const Tensor& b,
                   const std::optional<Tensor>& h0);
using DplrChunkRunner = void (*)(const DplrChunkPass&);
// Gradient g (DplrKGrad) from the fp32 partial slabs kg [slabs, kNumKGrads, <r's shape>] of
// either RWKV7 backward: the slabs added in fp32 and rounded once to r's dtype.
Tensor kgrad_sum(const Tensor& kg, int g, const Tensor& r);

// The backward of a call without rows (T = 0: every sequence empty): no pass runs (an empty grad_o
// has no data pointer, so a pass would read as a forward) and dh0 = dht, or 0 without one.
void pass_state_gradient(Tensor& dh0, const std::optional<Tensor>& grad_final_state);

// Shapes, dtypes, devices of (r, w, k, v, a, b, h0, cu_seqlens) and, with FLA_EXT_CHECKS, their
// values (w a log decay <= 0, the rest finite).
DiagArgs check_rwkv7(const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v,
                     const Tensor& a, const Tensor& b, std::optional<double> scale,
                     const std::optional<Tensor>& h0, const std::optional<Tensor>& cu_seqlens,
                     bool head_first);

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

// The chunked forward; `keep` (the training forward on CUDA) also returns what its backward
// reuses, `saved` (fp32, flat): the chunk-start states [chunk_slots<kDplrChunk>, H, K, V], then
// the engine's per-chunk workspace (DplrWorkspaceLayout, the pair matrices included); else an empty tensor.
std::tuple<Tensor, Tensor, Tensor> chunk_rwkv7_fwd(
    const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v, const Tensor& a,
    const Tensor& b, std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, const std::optional<Tensor>& cu_seqlens, bool head_first, bool keep,
    DplrChunkRunner run);

// saved: the training forward's (the backward then runs neither prep nor the forward sweep), or
// none / empty.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_rwkv7_bwd(
    const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v, const Tensor& a,
    const Tensor& b, const Tensor& grad_o, const std::optional<Tensor>& grad_final_state,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first, const std::optional<Tensor>& saved,
    DplrChunkRunner run);

template <DplrChunkRunner R>
std::tuple<Tensor, Tensor> chunk_rwkv7_impl(
    const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v, const Tensor& a,
    const Tensor& b, std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, const std::optional<Tensor>& cu_seqlens, bool head_first) {
  auto [o, hT, saved] = chunk_rwkv7_fwd(r, w, k, v, a, b, scale, initial_state, output_final_state,
                                      cu_seqlens, head_first, false, R);
  return {o, hT};
}

template <DplrChunkRunner R>
std::tuple<Tensor, Tensor, Tensor> chunk_rwkv7_train_impl(
    const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v, const Tensor& a,
    const Tensor& b, std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, const std::optional<Tensor>& cu_seqlens, bool head_first) {
  return chunk_rwkv7_fwd(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens,
                         head_first, r.is_cuda(), R);
}

template <DplrChunkRunner R>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_rwkv7_bwd_impl(
    const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v, const Tensor& a,
    const Tensor& b, const Tensor& grad_o, const std::optional<Tensor>& grad_final_state,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first, const std::optional<Tensor>& saved) {
  return chunk_rwkv7_bwd(r, w, k, v, a, b, grad_o, grad_final_state, scale, initial_state,
                         cu_seqlens, head_first, saved, R);
}

}  // namespace fla::ops
