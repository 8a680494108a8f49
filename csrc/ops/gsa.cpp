// Gated Slot Attention (docs/algorithms.md §7): two passes of the diagonal-gate engine around a float32
// softmax over the M slots. Pass 1 is GLA with the decay on the value (slot) side, pass 2 GLA with
// it on the key side. The GSA ops are CompositeImplicitAutograd: argument checks naming GSA's
// arguments, fla's g=None gate and grouped heads, then
//  - chunk_gsa: the chunk_gsa_core op (ops/gsa.h: both chunk passes with their own backward, ok and
//    dp in float32 from the engine's accumulators);
//  - fused_recurrent_gsa: two fused_recurrent_gla ops with a float32 (wide) q, the same float32
//    ok and dp at the price of casts (the fused mode is for short sequences and decoding).
#include <torch/library.h>

#include "../include/fla_ext/fla_ext.h"
#include "common.h"
#include "gsa.h"

namespace fla::ops {
namespace {

struct GsaArgs {
  Layout L;
  int64_t B, T, HQ, H, K, V, M, N;
  Tensor cu;
};

GsaArgs check_gsa(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& s,
                  const Tensor& g, std::optional<double> scale, const std::optional<Tensor>& hk0,
                  const std::optional<Tensor>& hv0, const std::optional<Tensor>& cu_seqlens,
                  bool head_first) {
  GsaArgs a{Layout{head_first}};
  const Layout& L = a.L;
  check_activation(q, "q", q, "q");
  for (auto [t, name] : {std::pair<const Tensor&, const char*>{k, "k"}, {v, "v"}, {s, "s"}})
    check_activation(t, name, q, "q");
  a.B = L.B(q), a.T = L.T(q), a.HQ = L.H(q), a.K = L.D(q);
  a.H = L.H(k), a.V = L.D(v), a.M = L.D(s);
  TORCH_CHECK_VALUE(L.B(k) == a.B && L.T(k) == a.T && L.D(k) == a.K, "fla_ext: `k` must be ",
                    L.dims(), " with B, T and K of `q` ", shape_str(q), ", got ", shape_str(k));
  TORCH_CHECK_VALUE(a.H >= 1 && a.HQ % a.H == 0, "fla_ext: the heads of `q` (", a.HQ,
                    ") must be a multiple of the heads of `k`, `v`, `s` (", a.H, ")");
  for (auto [t, name] : {std::pair<const Tensor&, const char*>{v, "v"}, {s, "s"}})
    TORCH_CHECK_VALUE(L.B(t) == a.B && L.T(t) == a.T && L.H(t) == a.H, "fla_ext: `", name,
                      "` must be ", L.dims(), " with B, T, H of `k` ", shape_str(k), ", got ",
                      shape_str(t));
  if (g.defined()) check_same_shape(g, "g", s, "s", L);
  check_head_dim(a.K, "K (last dim of q, k)");
  check_head_dim(a.V, "V (last dim of v)");
  check_head_dim(a.M, "M (last dim of s, g: the slots)");
  a.cu = check_cu_seqlens(cu_seqlens, q, a.B, a.T);
  a.N = a.cu.defined() ? a.cu.size(0) - 1 : a.B;
  if (has(hk0)) check_state(*hk0, "initial_state[0] (hk0)", q, a.N, a.H, a.K, a.M, "[N, H, K, M]");
  if (has(hv0)) check_state(*hv0, "initial_state[1] (hv0)", q, a.N, a.H, a.M, a.V, "[N, H, M, V]");
  TORCH_CHECK_VALUE(!scale.has_value() || std::isfinite(*scale),
                    "fla_ext: `scale` must be finite, got ", *scale);
  return a;
}

// fla's g=None (ABC without a learned gate): with z_t = log Σ_{τ≤t} exp(s_τ) per sequence, the slot
// keys become exp(s_t - z_t) and the gate g_t = z_{t-1} - z_t (0 at a sequence's first token): a
// normalised running sum over the slots. Computed in float32, then cast to the inputs' dtypes.
std::pair<Tensor, Tensor> additive_gate(const Tensor& s, const GsaArgs& a, at::ScalarType key_dtype) {
  const int64_t td = a.L.head_first ? 2 : 1;
  auto one = [&](const Tensor& x) {
    const Tensor z = at::logcumsumexp(x, td);
    const Tensor prev = at::cat({at::full_like(z.narrow(td, 0, 1), -INFINITY),
                                 z.narrow(td, 0, z.size(td) - 1)}, td);
    return std::pair{at::exp(x - z), at::where(at::isinf(prev), at::zeros_like(z), prev - z)};
  };
  const Tensor x = s.to(at::kFloat);
  Tensor sk, g;
  if (!a.cu.defined() || a.T == 0) {
    std::tie(sk, g) = a.T ? one(x) : std::pair{x, x};
  } else {  // per sequence: the running sum restarts at each start (reads cu_seqlens on the host)
    const Tensor cu = a.cu.cpu();
    if (!a.cu.is_cpu()) check_cu_values(cu, a.T);  // a GPU one may be unchecked: now on the host
    const int64_t* c = cu.data_ptr<int64_t>();
    std::vector<Tensor> ss, gs;
    for (int64_t n = 0; n < a.N; ++n)
      if (c[n + 1] > c[n]) {
        auto [sn, gn] = one(x.narrow(td, c[n], c[n + 1] - c[n]));
        ss.push_back(sn), gs.push_back(gn);
      }
    sk = at::cat(ss, td), g = at::cat(gs, td);
  }
  return {sk.to(key_dtype), g.to(s.scalar_type())};
}

// Grouped heads: k, v, s, g (and the states) repeated for the query heads of their group.
Tensor per_query_head(const Tensor& x, int64_t groups, int64_t dim) {
  return groups > 1 && x.defined() ? x.repeat_interleave(groups, dim) : x;
}
std::optional<Tensor> per_query_head(const std::optional<Tensor>& x, int64_t groups) {
  return has(x) ? std::optional<Tensor>(per_query_head(*x, groups, 1)) : std::nullopt;
}

// Core(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens, head_first) -> (o, hk, hv)
// on the per-query-head inputs with the gate formed.
template <class Core>
std::tuple<Tensor, Tensor, Tensor> gsa(const Tensor& q, const Tensor& k_, const Tensor& v_,
                                       const Tensor& s_, const std::optional<Tensor>& g_,
                                       std::optional<double> scale,
                                       const std::optional<Tensor>& hk0,
                                       const std::optional<Tensor>& hv0, bool output_final_state,
                                       const std::optional<Tensor>& cu_seqlens, bool head_first,
                                       Core core) {
  const Tensor g0 = has(g_) ? *g_ : Tensor();
  const GsaArgs a = check_gsa(q, k_, v_, s_, g0, scale, hk0, hv0, cu_seqlens, head_first);
  if (value_checks_enabled()) check_gsa_values(q, k_, v_, s_, g0, hk0, hv0);
  ValueChecksDone checked;  // the passes' own checks would name internal tensors (p, gv)
  Tensor s = s_, g = g0;
  if (!g.defined()) std::tie(s, g) = additive_gate(s_, a, k_.scalar_type());
  const int64_t G = a.HQ / a.H, hd = head_first ? 1 : 2;
  const Tensor k = per_query_head(k_, G, hd), v = per_query_head(v_, G, hd);
  s = per_query_head(s, G, hd), g = per_query_head(g, G, hd);
  auto [o, hk, hv] = core(q, k, v, s, g, scale, per_query_head(hk0, G), per_query_head(hv0, G),
                          output_final_state, cu_seqlens, head_first);
  if (G > 1) {  // every query head of a group holds the same states: return one per group
    hk = hk.slice(1, 0, hk.size(1), G).contiguous();
    hv = hv.slice(1, 0, hv.size(1), G).contiguous();
  }
  return {o, hk, hv};
}

std::tuple<Tensor, Tensor, Tensor> chunk_gsa(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& s,
    const std::optional<Tensor>& g, std::optional<double> scale, const std::optional<Tensor>& hk0,
    const std::optional<Tensor>& hv0, bool output_final_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first) {
  static auto op = fla_op("chunk_gsa_core").typed<decltype(chunk_gsa_core_impl<nullptr>)>();
  return gsa(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens, head_first,
             [](auto&&... x) { return op.call(x...); });
}

// The fused mode: the two fused_recurrent_gla passes around a float32 softmax. bf16 / fp16 pass a
// wide (float32) q to both, so that ok comes out of pass 1 and dp out of pass 2's backward in
// float32, unrounded: the softmax's p ⊙ (dp − ⟨p, dp⟩) cancels, and a logit of 100 has a bf16
// spacing of 0.5.
std::tuple<Tensor, Tensor, Tensor> fused_recurrent_gsa(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& s,
    const std::optional<Tensor>& g, std::optional<double> scale, const std::optional<Tensor>& hk0,
    const std::optional<Tensor>& hv0, bool output_final_state, bool reverse,
    const std::optional<Tensor>& cu_seqlens, bool head_first) {
  auto core = [reverse](const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& s,
                        const Tensor& g, std::optional<double> scale,
                        const std::optional<Tensor>& hk0, const std::optional<Tensor>& hv0,
                        bool ofs, const std::optional<Tensor>& cu, bool hf) {
    auto [ok, hk] = fla_ext::fused_recurrent_gla(q.to(acc_type(q)), k, s, std::nullopt, g, scale,
                                                 hk0, ofs, reverse, cu, hf);
    auto [o, hv] = fla_ext::fused_recurrent_gla(at::softmax(ok, -1), s, v, g, std::nullopt, 1.0,
                                                hv0, ofs, reverse, cu, hf);
    return std::tuple<Tensor, Tensor, Tensor>{o.to(v.scalar_type()), hk, hv};
  };
  return gsa(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens, head_first, core);
}

}  // namespace

void check_gsa_values(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& s,
                      const Tensor& g, const std::optional<Tensor>& hk0,
                      const std::optional<Tensor>& hv0) {
  check_finite(q, "q"), check_finite(k, "k"), check_finite(v, "v"), check_finite(s, "s");
  if (g.defined()) check_log_decay(g, "g");
  if (has(hk0)) check_finite(*hk0, "initial_state[0] (hk0)");
  if (has(hv0)) check_finite(*hv0, "initial_state[1] (hv0)");
}

TORCH_LIBRARY_IMPL(fla, CompositeImplicitAutograd, m) {
  m.impl("chunk_gsa", &chunk_gsa);
  m.impl("fused_recurrent_gsa", &fused_recurrent_gsa);
}

}  // namespace fla::ops
