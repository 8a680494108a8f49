// RWKV7 (docs/algorithms.md §6), fused recurrent: h_t = diag(exp(w_t)) h_{t-1} + b_t (a_t^T h_{t-1})
// + k_t v_t^T, o_t = scale * h_t^T r_t (inclusive read). The engine (kernels/dplr.h) runs the
// forward, and the backward as checkpointed recompute plus a reverse sweep; this file checks the
// arguments, lays out the workspaces and adds the per-column-tile partial gradients.
#include "rwkv7.h"

#include <torch/library.h>


namespace fla::ops {

Tensor kgrad_sum(const Tensor& kg, int g, const Tensor& r) {
  const Tensor parts = kg.select(1, g);
  const int64_t n = parts.size(0);
  if (n == 1) return parts[0].to(r.scalar_type(), false, /*copy=*/true);  // no aliases
  // add() into an output of another dtype computes in fp32 and rounds once on the store (a sum()
  // into it would round every partial first): one pass for two slabs.
  const Tensor head = n == 2 ? parts[0] : parts.narrow(0, 0, n - 1).sum(0);
  Tensor out = at::empty(r.sizes(), r.options());
  return at::add_out(out, head, parts[n - 1]);
}

void pass_state_gradient(Tensor& dh0, const std::optional<Tensor>& grad_final_state) {
  if (dh0.numel() == 0) return;
  has(grad_final_state) ? dh0.copy_(*grad_final_state) : dh0.zero_();
}

DiagArgs check_rwkv7(const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v,
                     const Tensor& a, const Tensor& b, std::optional<double> scale,
                     const std::optional<Tensor>& h0, const std::optional<Tensor>& cu_seqlens,
                     bool head_first) {
  TORCH_CHECK_VALUE(w.defined(), "fla_ext: `w` must be a tensor, got None");
  DiagArgs d = check_diag(r, "r", k, v, w, "w", scale, h0, cu_seqlens, head_first);
  for (auto [t, name] : {std::pair<const Tensor&, const char*>{a, "a"}, {b, "b"}}) {
    TORCH_CHECK_VALUE(t.defined(), "fla_ext: `", name, "` must be a tensor, got None");
    check_same_shape(t, name, r, "r", d.L);
    if (value_checks_enabled()) check_finite(t, name);
  }
  return d;
}

void set_dplr_args(DplrArgs& p, const DiagArgs& d, const Tensor& r, const Tensor& w,
                   const Tensor& k, const Tensor& v, const Tensor& a, const Tensor& b,
                   const std::optional<Tensor>& h0) {
  const Layout& L = d.L;
  p.dtype = kernel_dtype(r);
  p.N = int(d.N), p.H = int(d.H), p.T = int(d.T), p.K = int(d.K), p.V = int(d.V);
  p.cu_seqlens = d.cu.defined() ? d.cu.data_ptr<int64_t>() : nullptr;
  p.scale = d.scale;
  p.r = L.vec(r), p.w = L.vec(w), p.k = L.vec(k), p.v = L.vec(v), p.a = L.vec(a), p.b = L.vec(b);
  if (has(h0)) p.h0 = mat(*h0);
}

namespace {

DplrPass rwkv7_pass(const DiagArgs& d, const Tensor& r, const Tensor& w, const Tensor& k,
                    const Tensor& v, const Tensor& a, const Tensor& b, bool reverse,
                    const std::optional<Tensor>& h0) {
  DplrPass p;
  set_dplr_args(p, d, r, w, k, v, a, b, h0);
  p.reverse = reverse;
  return p;
}

}  // namespace

std::tuple<Tensor, Tensor> fused_recurrent_rwkv7_fwd(
    const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v, const Tensor& a,
    const Tensor& b, std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, bool reverse, const std::optional<Tensor>& cu_seqlens,
    bool head_first, DplrRunner run) {
  c10::OptionalDeviceGuard guard(device_of(r, "r"));
  const auto d = check_rwkv7(r, w, k, v, a, b, scale, initial_state, cu_seqlens, head_first);
  Tensor o = d.L.empty_like_with_dim(v, d.V, r.scalar_type());
  Tensor hT = new_output({output_final_state ? d.N : 0, d.H, d.K, d.V},
                         r.options().dtype(acc_type(r)));
  DplrPass p = rwkv7_pass(d, r, w, k, v, a, b, reverse, initial_state);
  p.o = d.L.vec(o);
  if (output_final_state) p.hT = mat(hT);
  run(p);
  return {o, hT};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> fused_recurrent_rwkv7_bwd(
    const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v, const Tensor& a,
    const Tensor& b, const Tensor& grad_o, const std::optional<Tensor>& grad_final_state,
    std::optional<double> scale, const std::optional<Tensor>& initial_state, bool reverse,
    const std::optional<Tensor>& cu_seqlens, bool head_first, DplrRunner run) {
  c10::OptionalDeviceGuard guard(device_of(r, "r"));
  const auto d = check_rwkv7(r, w, k, v, a, b, scale, initial_state, cu_seqlens, head_first);
  check_incoming_grads(d, grad_o, grad_final_state, r, "r", v);
  const bool has_dht = has(grad_final_state), has_h0 = has(initial_state);

  const auto acc = r.options().dtype(acc_type(r));
  const int tiles = dplr_tiles(int(d.V));
  auto kg_sizes = r.sizes().vec();
  kg_sizes.insert(kg_sizes.begin(), {int64_t(tiles), int64_t(kNumKGrads)});
  Tensor kg = new_output(kg_sizes, acc);  // [tiles, grad, <r's shape>]: per-tile partial sums
  Tensor dv = new_output(v.sizes(), v.options());
  Tensor dh0 = new_output({has_h0 ? d.N : 0, d.H, d.K, d.V}, acc);
  const int64_t slots = dplr_slots(d.T, d.N, d.cu.defined());
  Tensor chk = at::empty({d.B, slots, d.H, d.K, d.V}, acc);
  Tensor seg = at::empty({d.N, d.H, kDplrSeg, d.K, d.V}, acc);

  DplrPass p = rwkv7_pass(d, r, w, k, v, a, b, reverse, initial_state);
  p.dout = d.L.vec(grad_o), p.dv = d.L.vec(dv);
  if (has_dht) p.dht = mat(*grad_final_state);
  if (has_h0) p.dh0 = mat(dh0);
  p.kg = d.L.vec(kg[0][0]), p.kg_tile = kg.stride(0), p.kg_grad = kg.stride(1);
  p.chk = chk.data_ptr(), p.seg = seg.data_ptr();
  if (d.T > 0) run(p);
  else pass_state_gradient(dh0, grad_final_state);

  auto grad = [&](int g) { return kgrad_sum(kg, g, r); };
  return {grad(kGradR), grad(kGradW), grad(kGradK), dv, grad(kGradA), grad(kGradB), dh0};
}

}  // namespace fla::ops
