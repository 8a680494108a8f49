// GLA (docs/algorithms.md §4), fused recurrent, with fla's key- and value-side decays:
//   h_t = diag(exp(gk_t)) h_{t-1} diag(exp(gv_t)) + k_t v_t^T,   o_t = scale * h_t^T q_t
// (inclusive read). gk [.., K] and gv [.., V] are each optional: None means no decay on that side.
//
// Forward is one sweep (ReadLast) decaying rows by gk and columns by gv. Backward is three sweeps
// of the same engine (kernels/recurrent.h), four with gv; the two decays commute, so each sweep
// carries both and each decay gradient comes from its own closed form (docs/algorithms.md §3):
//   A  (op direction, S = h^T):  dq = scale h_t dO_t; with gk: ws_k = q * dq, zeta_k = rowsum(h_T * dh_T)
//   A' (op direction, S = h, gv only):  o recomputed in fp32; ws_v = dO * o, zeta_v = colsum(h_T * dh_T)
//   B  (reverse, S = dh, DecayLast: D += scale q dO^T, read, D = decay(D)):  dv, dh0; with gv:
//        dgv_t = sum_{t'>=t} (o*dO - v*dv) + zeta_v
//   C  (reverse, S = dh^T, DecayLast):  dk; with gk:
//        dgk_t = sum_{t'>=t} (q*dq - k*dk) + zeta_k
// Both are exact-zero where the step's factor exp(g_t) == 0 (a -inf log decay stays exact).
#include "gla.h"


#include <torch/library.h>

namespace fla::ops {

namespace {

// check_diag plus the value-side decay: gv is an activation shaped exactly like v.
DiagArgs check_gla(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gk,
                   const Tensor& gv, std::optional<double> scale,
                   const std::optional<Tensor>& initial_state,
                   const std::optional<Tensor>& cu_seqlens, bool head_first) {
  DiagArgs a =
      check_diag(q, "q", k, v, gk, "gk", scale, initial_state, cu_seqlens, head_first, true);
  if (gv.defined()) {
    check_same_shape(gv, "gv", v, "v", a.L);
    if (value_checks_enabled()) check_log_decay(gv, "gv");
  }
  return a;
}

}  // namespace

std::tuple<Tensor, Tensor> fused_recurrent_gla_fwd(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& gk,
    const std::optional<Tensor>& gv, std::optional<double> scale,
    const std::optional<Tensor>& initial_state, bool output_final_state, bool reverse,
    const std::optional<Tensor>& cu_seqlens, bool head_first, Runner run) {
  c10::OptionalDeviceGuard guard(device_of(q, "q"));
  const Tensor g = opt(gk), gvt = opt(gv);
  const auto a = check_gla(q, k, v, g, gvt, scale, initial_state, cu_seqlens, head_first);
  const Layout& L = a.L;
  Tensor o = L.empty_like_with_dim(v, a.V, q.scalar_type());
  Tensor hT = new_output({output_final_state ? a.N : 0, a.H, a.K, a.V}, q.options().dtype(acc_type(q)));
  const Tensor qk = kernel_input(a, q, k);
  RecurrentPass p = base_pass(a, k);
  p.Dr = int(a.K), p.Dc = int(a.V), p.reverse = reverse, p.order = Order::ReadLast;
  p.scale = a.scale;
  p.q = L.vec(qk), p.a = L.vec(k), p.b = L.vec(v);
  if (g.defined()) p.row_decay = L.vec(g);
  if (gvt.defined()) p.col_decay = L.vec(gvt);
  p.out = L.vec(o), p.out_acc = a.wide_q;  // a wide q's o is float32
  if (has(initial_state)) p.h0 = mat(*initial_state);
  if (output_final_state) p.hT = mat(hT);
  run(p);
  return {o, hT};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> fused_recurrent_gla_bwd(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& gk,
    const std::optional<Tensor>& gv, const Tensor& grad_o,
    const std::optional<Tensor>& grad_final_state, std::optional<double> scale,
    const std::optional<Tensor>& initial_state, bool reverse,
    const std::optional<Tensor>& cu_seqlens, bool head_first, Runner run) {
  c10::OptionalDeviceGuard guard(device_of(q, "q"));
  const Tensor g = opt(gk), gvt = opt(gv);
  const auto a = check_gla(q, k, v, g, gvt, scale, initial_state, cu_seqlens, head_first);
  const Layout& L = a.L;
  check_incoming_grads(a, grad_o, grad_final_state, q, "q", v);
  const bool has_dht = has(grad_final_state), has_h0 = has(initial_state);
  const bool gated_k = g.defined(), gated_v = gvt.defined();

  const auto acc = q.options().dtype(acc_type(q));
  Tensor dq = new_output(q.sizes(), q.options()), dk = new_output(k.sizes(), k.options());
  Tensor dv = new_output(v.sizes(), v.options());
  Tensor dgk = gated_k ? new_output(g.sizes(), g.options()) : new_output({0}, q.options());
  Tensor dgv = gated_v ? new_output(gvt.sizes(), gvt.options()) : new_output({0}, q.options());
  Tensor dh0 = new_output({has_h0 ? a.N : 0, a.H, a.K, a.V}, acc);
  Tensor ws_k = gated_k ? new_output(q.sizes(), acc) : Tensor();  // q * dq
  Tensor zeta_k = gated_k ? new_output({a.N, a.H, a.K}, acc) : Tensor();
  Tensor ws_v = gated_v ? new_output(v.sizes(), acc) : Tensor();  // dO * o
  Tensor zeta_v = gated_v ? new_output({a.N, a.H, a.V}, acc) : Tensor();

  // A wide q: the sweeps read q and grad_o (float32, like o) rounded to k's dtype; dq is float32.
  const Tensor qk = kernel_input(a, q, k), go = kernel_input(a, grad_o, k);
  const RecurrentPass base = base_pass(a, k);
  // The decays of a sweep over S = h or dh [K x V], and over its transpose [V x K].
  auto decays = [&](RecurrentPass& p, bool transposed) {
    const Tensor& rows = transposed ? gvt : g;
    const Tensor& cols = transposed ? g : gvt;
    if (rows.defined()) p.row_decay = L.vec(rows);
    if (cols.defined()) p.col_decay = L.vec(cols);
  };

  // The four sweeps read the state without the step's own write (Order::DecayReadWrite /
  // ReadWriteDecay, recurrent.h) and add that term, (q . a) b times the scales, as a bonus with
  // u = 1: exact decay gradients when every decay is strong (GSA's slot gates).
  auto self_term = [](RecurrentPass& p, double scale) {
    p.x = p.a, p.y = p.b, p.bonus_scale = scale;
  };

  RecurrentPass pa = base;  // S = h^T [V x K]
  pa.Dr = int(a.V), pa.Dc = int(a.K), pa.reverse = reverse, pa.order = Order::DecayReadWrite;
  pa.scale = a.scale;
  pa.q = L.vec(go), pa.a = L.vec(v), pa.b = L.vec(k), pa.out = L.vec(dq);
  pa.out_acc = a.wide_q;
  self_term(pa, a.scale);
  decays(pa, true);
  if (has_h0) pa.h0 = mat(*initial_state, /*transpose=*/true);
  if (gated_k) {
    pa.gate = GateGrad::Produce, pa.z = L.vec(qk), pa.ws = L.vec(ws_k), pa.zeta = zeta_k.data_ptr();
    if (has_dht) pa.zdot = mat(*grad_final_state, true);
  }
  run(pa);

  if (gated_v) {  // S = h [K x V]: the forward again, for o * dO (fp32) and zeta_v
    RecurrentPass pv = base;
    pv.Dr = int(a.K), pv.Dc = int(a.V), pv.reverse = reverse, pv.order = Order::DecayReadWrite;
    pv.scale = a.scale;
    pv.q = L.vec(qk), pv.a = L.vec(k), pv.b = L.vec(v);
    self_term(pv, a.scale);
    decays(pv, false);
    if (has_h0) pv.h0 = mat(*initial_state);
    pv.gate = GateGrad::Produce, pv.z = L.vec(go), pv.ws = L.vec(ws_v);
    pv.zeta = zeta_v.data_ptr();
    if (has_dht) pv.zdot = mat(*grad_final_state);
    run(pv);
  }

  RecurrentPass pb = base;  // S = dh [K x V]
  pb.Dr = int(a.K), pb.Dc = int(a.V), pb.reverse = !reverse, pb.order = Order::ReadWriteDecay;
  pb.a_scale = a.scale;
  pb.q = L.vec(k), pb.a = L.vec(qk), pb.b = L.vec(go), pb.out = L.vec(dv);
  self_term(pb, a.scale);
  decays(pb, false);
  if (has_dht) pb.h0 = mat(*grad_final_state);
  if (has_h0) pb.hT = mat(dh0);
  if (gated_v) {
    pb.gate = GateGrad::Consume, pb.ws_inclusive = true, pb.z = L.vec(v), pb.ws = L.vec(ws_v);
    pb.zeta = zeta_v.data_ptr(), pb.dlam = L.vec(dgv);
  }
  run(pb);

  RecurrentPass pc = base;  // S = dh^T [V x K]
  pc.Dr = int(a.V), pc.Dc = int(a.K), pc.reverse = !reverse, pc.order = Order::ReadWriteDecay;
  pc.b_scale = a.scale;
  pc.q = L.vec(v), pc.a = L.vec(go), pc.b = L.vec(qk), pc.out = L.vec(dk);
  self_term(pc, a.scale);
  decays(pc, true);
  if (has_dht) pc.h0 = mat(*grad_final_state, true);
  if (gated_k) {
    pc.gate = GateGrad::Consume, pc.ws_inclusive = true, pc.z = L.vec(k), pc.ws = L.vec(ws_k);
    pc.zeta = zeta_k.data_ptr(), pc.dlam = L.vec(dgk);
  }
  run(pc);
  return {dq, dk, dv, dgk, dgv, dh0};
}

}  // namespace fla::ops
