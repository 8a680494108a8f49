// GSA's chunked core (ops/gsa.h, docs/algorithms.md §7): pass 1 (value-side decay) takes the
// softmax of its float32 output rows itself where the engine can (else writes them, ok, in
// float32 for ATen's softmax); the float32 softmax p feeds pass 2 in the inputs' dtype (as fla
// does); pass 2's backward writes dp in float32, the softmax backward forms dok = p ⊙ (dp − ⟨p, dp⟩) in
// float32 and rounds the result (after the cancellation, not before) for pass 1's backward.
// A training forward keeps p and the passes' workspaces (pass 1: hst; pass 2: hst and amat).
#include "gsa.h"

#include <torch/library.h>

namespace fla::ops {
namespace {

// Pass 1: GLA(q, k, v := s, gv := g); pass 2: GLA(q := p, k := s, v, g), scale 1.
DiagArgs pass1_args(const Tensor& q, const Tensor& k, const Tensor& s, const Tensor& g,
                    std::optional<double> scale, const std::optional<Tensor>& hk0,
                    const std::optional<Tensor>& cu_seqlens, bool head_first) {
  DiagArgs a = check_diag(q, "q", k, s, Tensor(), "g", scale, hk0, cu_seqlens, head_first);
  check_same_shape(g, "g", s, "s", a.L);
  return a;
}

DiagArgs pass2_args(const Tensor& p, const Tensor& s, const Tensor& v, const Tensor& g,
                    const std::optional<Tensor>& hv0, const std::optional<Tensor>& cu_seqlens,
                    bool head_first) {
  return check_diag(p, "p", s, v, g, "g", 1.0, hv0, cu_seqlens, head_first);
}

// Whether the passes' engine takes the softmax over the M slots and its backward itself
// (ChunkPass::o_softmax in pass 1, dq_softmax_w in pass 2): the CPU always, CUDA at M <= 64.
bool softmax_in_passes(const Tensor& q, int64_t M) {
  return !q.is_cuda() || chunk_softmax_on_cuda(int(M));
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_gsa_core_train(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& s, const Tensor& g,
    std::optional<double> scale, const std::optional<Tensor>& hk0,
    const std::optional<Tensor>& hv0, bool output_final_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first, bool train, ChunkRunner run) {
  c10::OptionalDeviceGuard guard(device_of(q, "q"));
  if (value_checks_enabled()) check_gsa_values(q, k, v, s, g, hk0, hv0);
  ValueChecksDone checked;  // the passes' own checks would name internal tensors (p, gv)
  const DiagArgs a1 = pass1_args(q, k, s, g, scale, hk0, cu_seqlens, head_first);
  const bool keep = train && keeps_workspaces(q);
  // In the passes, pass 1's o is pq and p (for the backward) its unrounded twin: the logits never
  // reach memory. Else o is the fp32 logits ok for ATen's softmax.
  const bool in_passes = softmax_in_passes(q, a1.V);
  Tensor p = in_passes && train ? a1.L.empty_like_with_dim(s, a1.V, acc_type(q)) : Tensor();
  auto [o1, hk, hst1, amat1] = chunk_forward(a1, Reader::Inclusive, q, k, s, Tensor(), g, Tensor(),
                                             hk0, output_final_state, keep, run, !in_passes,
                                             in_passes, p);
  Tensor pq;
  if (in_passes) {
    pq = std::move(o1);
  } else {
    // Pass 2 is the forward's peak: what is dead by then is released before it (the fp32 logits
    // ok before the cast, and p itself where no backward keeps it and pq is a copy), each the
    // size of p.
    p = at::softmax(o1, -1);
    o1 = Tensor();
    pq = p.to(q.scalar_type());
  }
  if (!train) p = new_output({0}, q.options().dtype(acc_type(q)));
  const DiagArgs a2 = pass2_args(pq, s, v, g, hv0, cu_seqlens, head_first);
  auto [o, hv, hst2, amat2] = chunk_forward(a2, Reader::Inclusive, pq, s, v, g, Tensor(), Tensor(),
                                            hv0, output_final_state, keep, run, false);
  return {o, hk, hv, p, hst1, hst2, amat2};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_gsa_core_bwd(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& s, const Tensor& g,
    const Tensor& p, const Tensor& grad_o, const std::optional<Tensor>& grad_hk,
    const std::optional<Tensor>& grad_hv, std::optional<double> scale,
    const std::optional<Tensor>& hk0, const std::optional<Tensor>& hv0,
    const std::optional<Tensor>& cu_seqlens, bool head_first, const std::optional<Tensor>& hst1,
    const std::optional<Tensor>& hst2, const std::optional<Tensor>& amat2, ChunkRunner run) {
  c10::OptionalDeviceGuard guard(device_of(q, "q"));
  const DiagArgs a1 = pass1_args(q, k, s, g, scale, hk0, cu_seqlens, head_first);
  check_defined({{p, "p"}});
  check_device(p, "p", q.device());
  TORCH_CHECK_VALUE(p.scalar_type() == acc_type(q) && p.sizes() == s.sizes(),
                    "fla_ext: `p` must be the ", acc_type(q), " softmax ", shape_str(s),
                    " returned by chunk_gsa_core_train, got ", p.scalar_type(), " ", shape_str(p));
  Tensor pq = p.to(q.scalar_type());
  const DiagArgs a2 = pass2_args(pq, s, v, g, hv0, cu_seqlens, head_first);
  // dok = p ⊙ (dp − ⟨p, dp⟩) in float32, rounded once to the inputs' dtype: pass 2 forms it from
  // its dp rows itself where its engine can (ChunkPass::dq_softmax_w), else writes dp in float32
  // for ATen's softmax backward and a cast (ATen's fused half-to-float form takes fp16 on CUDA
  // only, not bf16). pq is dead after pass 2: released before pass 1's backward, the peak.
  const bool in_passes = softmax_in_passes(q, a2.K);
  ChunkGrads r2 = chunk_backward(a2, Reader::Inclusive, pq, s, v, g, Tensor(), Tensor(), grad_o,
                                 grad_hv, hv0, hst2, amat2, "p", run, !in_passes, Tensor(),
                                 Tensor(), in_passes ? p : Tensor());
  const Tensor dok = in_passes ? r2.dq
                     : at::_softmax_backward_data(r2.dq, p, -1, p.scalar_type()).to(q.scalar_type());
  r2.dq = Tensor();
  pq = Tensor();
  // ds and dg are the sums of both passes' gradients: pass 1 adds its own into pass 2's.
  ChunkGrads r1 = chunk_backward(a1, Reader::Inclusive, q, k, s, Tensor(), g, Tensor(), dok,
                                 grad_hk, hk0, hst1, std::nullopt, "q", run, false, r2.dk, r2.dg);
  return {r1.dq, r1.dk, r2.dv, r1.dv, r1.dgv, r1.dh0, r2.dh0};
}

}  // namespace fla::ops
