// GLA (ALGORITHMS.md §4), fused recurrent: h_t = diag(exp(g_t)) h_{t-1} + k_t v_t^T,
// o_t = scale * h_t^T q_t (inclusive read). g (fla's gk) is optional: None means no decay.
//
// Forward is one sweep (ReadLast). Backward is three (kernels/recurrent.h):
//   A (op direction, S = h^T):  dq = scale h_t dO_t, ws = q * dq, zeta = rowsum(h_T * dh_T)
//   B (reverse, S = dh, DecayLast: D += scale q dO^T, read, D = diag(a_t) D):  dv, dh0
//   C (reverse, S = dh^T, DecayLast):  dk, and dg by the closed form
//        dg_t = sum_{t'>=t} (q*dq - k*dk) + zeta,  exact-zero where exp(g_t) == 0.
#include "gla.h"

#include "autograd_state.h"

#include <torch/autograd.h>
#include <torch/library.h>

namespace fla::ops {
std::tuple<Tensor, Tensor> fused_recurrent_gla_fwd(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& gk,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, bool reverse, const std::optional<Tensor>& cu_seqlens,
    bool head_first, Runner run) {
  c10::OptionalDeviceGuard guard(q.device());
  const Tensor g = opt(gk);
  const auto a = check_diag(q, "q", k, v, g, "gk", scale, initial_state, cu_seqlens, head_first);
  const Layout& L = a.L;
  Tensor o = L.empty_like_with_dim(v, a.V, q.scalar_type());
  Tensor hT = new_output({output_final_state ? a.N : 0, a.H, a.K, a.V}, q.options().dtype(acc_type(q)));
  RecurrentPass p = base_pass(a, q);
  p.Dr = int(a.K), p.Dc = int(a.V), p.reverse = reverse, p.order = Order::ReadLast;
  p.decay_on_rows = true, p.scale = a.scale;
  p.q = L.vec(q), p.a = L.vec(k), p.b = L.vec(v);
  if (g.defined()) p.decay = L.vec(g);
  p.out = L.vec(o);
  if (has(initial_state)) p.h0 = mat(*initial_state);
  if (output_final_state) p.hT = mat(hT);
  run(p);
  return {o, hT};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> fused_recurrent_gla_bwd(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& gk,
    const Tensor& grad_o, const std::optional<Tensor>& grad_final_state,
    std::optional<double> scale, const std::optional<Tensor>& initial_state, bool reverse,
    const std::optional<Tensor>& cu_seqlens, bool head_first, Runner run) {
  c10::OptionalDeviceGuard guard(q.device());
  const Tensor g = opt(gk);
  const auto a = check_diag(q, "q", k, v, g, "gk", scale, initial_state, cu_seqlens, head_first);
  const Layout& L = a.L;
  check_activation(grad_o, "grad_o", q, "q");
  TORCH_CHECK_VALUE(grad_o.sizes() == v.sizes(), "fla_ext: `grad_o` must have the shape of `v` ",
                    shape_str(v), ", got ", shape_str(grad_o));
  const bool has_dht = has(grad_final_state), has_h0 = has(initial_state), gated = g.defined();
  if (has_dht) check_state(*grad_final_state, "grad_final_state", q, a.N, a.H, a.K, a.V);

  const auto acc = q.options().dtype(acc_type(q));
  Tensor dq = new_output(q.sizes(), q.options()), dk = new_output(k.sizes(), k.options());
  Tensor dv = new_output(v.sizes(), v.options());
  Tensor dg = gated ? new_output(g.sizes(), g.options()) : new_output({0}, q.options());
  Tensor dh0 = new_output({has_h0 ? a.N : 0, a.H, a.K, a.V}, acc);
  Tensor ws = gated ? new_output(q.sizes(), acc) : Tensor();    // q * dq
  Tensor zeta = gated ? new_output({a.N, a.H, a.K}, acc) : Tensor();

  const RecurrentPass base = base_pass(a, q);
  RecurrentPass pa = base;  // S = h^T [V x K]
  pa.Dr = int(a.V), pa.Dc = int(a.K), pa.reverse = reverse, pa.order = Order::ReadLast;
  pa.decay_on_rows = false, pa.scale = a.scale;
  pa.q = L.vec(grad_o), pa.a = L.vec(v), pa.b = L.vec(k), pa.out = L.vec(dq);
  if (has_h0) pa.h0 = mat(*initial_state, /*transpose=*/true);
  if (gated) {
    pa.decay = L.vec(g);
    pa.gate = GateGrad::Produce, pa.z = L.vec(q), pa.ws = L.vec(ws), pa.zeta = zeta.data_ptr();
    if (has_dht) pa.zdot = mat(*grad_final_state, true);
  }
  run(pa);

  RecurrentPass pb = base;  // S = dh [K x V]
  pb.Dr = int(a.K), pb.Dc = int(a.V), pb.reverse = !reverse, pb.order = Order::DecayLast;
  pb.decay_on_rows = true, pb.a_scale = a.scale;
  pb.q = L.vec(k), pb.a = L.vec(q), pb.b = L.vec(grad_o), pb.out = L.vec(dv);
  if (gated) pb.decay = L.vec(g);
  if (has_dht) pb.h0 = mat(*grad_final_state);
  if (has_h0) pb.hT = mat(dh0);
  run(pb);

  RecurrentPass pc = base;  // S = dh^T [V x K]
  pc.Dr = int(a.V), pc.Dc = int(a.K), pc.reverse = !reverse, pc.order = Order::DecayLast;
  pc.decay_on_rows = false, pc.b_scale = a.scale;
  pc.q = L.vec(v), pc.a = L.vec(grad_o), pc.b = L.vec(q), pc.out = L.vec(dk);
  if (has_dht) pc.h0 = mat(*grad_final_state, true);
  if (gated) {
    pc.decay = L.vec(g);
    pc.gate = GateGrad::Consume, pc.ws_inclusive = true, pc.z = L.vec(k), pc.ws = L.vec(ws);
    pc.zeta = zeta.data_ptr(), pc.dlam = L.vec(dg);
  }
  run(pc);
  return {dq, dk, dv, dg, dh0};
}

// ---------------------------------------------------------------------------------------------
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class FusedRecurrentGla : public torch::autograd::Function<FusedRecurrentGla> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, const std::optional<Tensor>& gk,
                               std::optional<double> scale,
                               const std::optional<Tensor>& initial_state,
                               bool output_final_state, bool reverse,
                               const std::optional<Tensor>& cu_seqlens, bool head_first) {
    at::AutoDispatchBelowADInplaceOrView below;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fla::fused_recurrent_gla", "")
                         .typed<decltype(fused_recurrent_gla_impl<nullptr>)>();
    auto [o, hT] = op.call(q, k, v, gk, scale, initial_state, output_final_state, reverse,
                           cu_seqlens, head_first);
    ctx->save_for_backward({q, k, v, opt(gk), opt(initial_state), opt(cu_seqlens)});
    SweepFlags{scale, reverse, head_first, output_final_state}.save(ctx);
    if (!output_final_state) ctx->mark_non_differentiable({hT});
    return {o, hT};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fla::fused_recurrent_gla_bwd", "")
                         .typed<decltype(fused_recurrent_gla_bwd_impl<nullptr>)>();
    const auto s = ctx->get_saved_variables();
    const auto f = SweepFlags::load(ctx);
    Tensor go = grads[0].defined() ? grads[0] : at::zeros_like(s[2]);
    auto [dq, dk, dv, dg, dh0] = op.call(s[0], s[1], s[2], some(s[3]), go, f.dht(grads), f.scale,
                                         some(s[4]), f.reverse, some(s[5]), f.head_first);
    return {dq, dk, dv, s[3].defined() ? dg : Tensor(), Tensor(), s[4].defined() ? dh0 : Tensor(),
            Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> fused_recurrent_gla_autograd(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& gk,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, bool reverse, const std::optional<Tensor>& cu_seqlens,
    bool head_first) {
  auto out = FusedRecurrentGla::apply(q, k, v, gk, scale, initial_state, output_final_state,
                                      reverse, cu_seqlens, head_first);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fla, Autograd, m) {
  m.impl("fused_recurrent_gla", &fused_recurrent_gla_autograd);
}

}  // namespace fla::ops
