// RWKV6 (docs/algorithms.md §5): o_t = scale * (h_{t-1} + diag(u) k_t v_t^T)^T r_t,
// h_t = diag(exp(w_t)) h_{t-1} + k_t v_t^T.
//
// Forward is one sweep. Backward is three sweeps of the same engine (kernels/recurrent.h):
//   A (op direction,  S = h^T):  dr, and ws = r * dr' plus zeta = rowsum(h_T * dh_T)
//   B (reverse,       S = dh):   dv and dh0
//   C (reverse,       S = dh^T): dk, du, and dw by the closed form
//        dw_t = sum_{t'>t} r*dr' - sum_{t'>=t} k*dk' + zeta      (dr', dk': without the u-terms)
// which never divides by a decay, so w = -inf (a hard reset) is exact.
#include "rwkv6.h"


#include <torch/library.h>

namespace fla::ops {

Rwkv6Args check_rwkv6(const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w,
                      const Tensor& u, std::optional<double> scale,
                      const std::optional<Tensor>& h0, const std::optional<Tensor>& cu_seqlens,
                      bool head_first) {
  TORCH_CHECK_VALUE(w.defined(), "fla_ext: `w` must be a tensor, got None");
  Rwkv6Args a{check_diag(r, "r", k, v, w, "w", scale, h0, cu_seqlens, head_first)};
  TORCH_CHECK_VALUE(u.defined(), "fla_ext: `u` must be a tensor, got None");
  TORCH_CHECK(u.device() == r.device(), "fla_ext: `u` is on ", u.device(), " but `r` is on ",
              r.device());
  const auto ut = u.scalar_type();
  TORCH_CHECK_VALUE(ut == at::kFloat || ut == at::kBFloat16 || ut == at::kHalf || ut == at::kDouble,
                    "fla_ext: `u` must be float32, bfloat16, float16 or float64, got ", ut);
  TORCH_CHECK_VALUE(u.dim() == 2 && u.size(0) == a.H && u.size(1) == a.K,
                    "fla_ext: `u` must have shape [H, K] = [", a.H, ", ", a.K, "], got ",
                    shape_str(u));
  // Kernels read u in its own dtype; only float64 is converted (to the acc type).
  a.uc = (r.scalar_type() == at::kDouble || ut == at::kDouble ? u.to(acc_type(r)) : u).contiguous();
  if (value_checks_enabled()) check_finite(u, "u");
  return a;
}

namespace {

RecurrentPass rwkv6_pass(const Rwkv6Args& a, const Tensor& r) {
  RecurrentPass p = base_pass(a, r);
  p.order = Order::ReadFirst;
  p.bonus_scale = a.scale;
  p.udtype = kernel_dtype(a.uc);
  return p;
}

}  // namespace

std::tuple<Tensor, Tensor> fused_recurrent_rwkv6_fwd(
    const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& u,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, bool reverse, const std::optional<Tensor>& cu_seqlens,
    bool head_first, Runner run) {
  c10::OptionalDeviceGuard guard(device_of(r, "r"));
  const auto a = check_rwkv6(r, k, v, w, u, scale, initial_state, cu_seqlens, head_first);
  const Layout& L = a.L;
  Tensor o = L.empty_like_with_dim(v, a.V, r.scalar_type());
  const auto acc = r.options().dtype(acc_type(r));
  Tensor hT = new_output({output_final_state ? a.N : 0, a.H, a.K, a.V}, acc);
  RecurrentPass p = rwkv6_pass(a, r);
  p.Dr = int(a.K), p.Dc = int(a.V), p.reverse = reverse;
  p.scale = a.scale;
  p.q = L.vec(r), p.a = L.vec(k), p.b = L.vec(v), p.row_decay = L.vec(w);
  p.x = L.vec(k), p.ux = a.uc.data_ptr(), p.y = L.vec(v);
  p.out = L.vec(o);
  if (has(initial_state)) p.h0 = mat(*initial_state);
  if (output_final_state) p.hT = mat(hT);
  run(p);
  return {o, hT};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> fused_recurrent_rwkv6_bwd(
    const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& u,
    const Tensor& grad_o, const std::optional<Tensor>& grad_final_state,
    std::optional<double> scale, const std::optional<Tensor>& initial_state, bool reverse,
    const std::optional<Tensor>& cu_seqlens, bool head_first, Runner run) {
  c10::OptionalDeviceGuard guard(device_of(r, "r"));
  const auto a = check_rwkv6(r, k, v, w, u, scale, initial_state, cu_seqlens, head_first);
  const Layout& L = a.L;
  check_incoming_grads(a, grad_o, grad_final_state, r, "r", v);
  const bool has_dht = has(grad_final_state);
  const bool has_h0 = has(initial_state);

  const auto f32 = r.options().dtype(acc_type(r));
  Tensor dr = new_output(r.sizes(), r.options());
  Tensor dk = new_output(k.sizes(), k.options());
  Tensor dw = new_output(w.sizes(), w.options());
  Tensor dv = new_output(v.sizes(), v.options());
  Tensor dh0 = new_output({has_h0 ? a.N : 0, a.H, a.K, a.V}, f32);
  Tensor ws = new_output(r.sizes(), f32);  // r * dr' in the acc type, same layout as r
  Tensor zeta = new_output({a.N, a.H, a.K}, f32);
  Tensor du_part = new_output({a.N, a.H, a.K}, f32);

  const RecurrentPass base = rwkv6_pass(a, r);
  // A: S = h^T [V x K], reads dO, writes v k^T with the decay on columns (K).
  RecurrentPass pa = base;
  pa.Dr = int(a.V), pa.Dc = int(a.K), pa.reverse = reverse;
  pa.scale = a.scale;
  pa.q = L.vec(grad_o), pa.a = L.vec(v), pa.b = L.vec(k), pa.col_decay = L.vec(w);
  pa.x = L.vec(v), pa.y = L.vec(k), pa.uy = a.uc.data_ptr();
  pa.out = L.vec(dr);
  if (has_h0) pa.h0 = mat(*initial_state, /*transpose=*/true);
  pa.gate = GateGrad::Produce, pa.z = L.vec(r), pa.ws = L.vec(ws), pa.zeta = zeta.data_ptr();
  if (has_dht) pa.zdot = mat(*grad_final_state, true);
  run(pa);

  // B: S = dh [K x V], reverse time, reads k, writes scale * r dO^T.
  RecurrentPass pb = base;
  pb.Dr = int(a.K), pb.Dc = int(a.V), pb.reverse = !reverse;
  pb.scale = 1.f, pb.a_scale = a.scale;
  pb.q = L.vec(k), pb.a = L.vec(r), pb.b = L.vec(grad_o), pb.row_decay = L.vec(w);
  pb.x = L.vec(r), pb.ux = a.uc.data_ptr(), pb.y = L.vec(grad_o);
  pb.out = L.vec(dv);
  if (has_dht) pb.h0 = mat(*grad_final_state);
  if (has_h0) pb.hT = mat(dh0);
  run(pb);

  // C: S = dh^T [V x K], reverse time, reads v, writes scale * dO r^T; dk, du, dw.
  RecurrentPass pc = base;
  pc.Dr = int(a.V), pc.Dc = int(a.K), pc.reverse = !reverse;
  pc.scale = 1.f, pc.b_scale = a.scale;
  pc.q = L.vec(v), pc.a = L.vec(grad_o), pc.b = L.vec(r), pc.col_decay = L.vec(w);
  pc.x = L.vec(grad_o), pc.y = L.vec(r), pc.uy = a.uc.data_ptr();
  pc.out = L.vec(dk);
  if (has_dht) pc.h0 = mat(*grad_final_state, true);
  pc.gate = GateGrad::Consume, pc.z = L.vec(k), pc.ws = L.vec(ws), pc.zeta = zeta.data_ptr();
  pc.dlam = L.vec(dw), pc.du = du_part.data_ptr();
  run(pc);

  Tensor du = du_part.sum(0).to(u.scalar_type());
  return {dr, dk, dv, dw, du, dh0};
}

}  // namespace fla::ops
