// C++ tests of fla_ext through its public header (csrc/include/fla_ext/fla_ext.h): forward
// against a plain loop of the RWKV6 recurrence, autograd backward against finite differences,
// argument errors, a call through the dispatcher by name, and varlen (cu_seqlens).
//
// Catch2 v3 or v2: CMakeLists.txt defines FLA_EXT_CATCH2_V3 or FLA_EXT_CATCH2_V2; without either
// the header that exists is used (v3 needs Catch2WithMain linked, v2 brings its own main).
// CATCH_CONFIG_PREFIX_ALL: c10's logging header defines a glog-style CHECK (abort on failure), so
// the Catch2 macros are used with their CATCH_ prefix only.
#define CATCH_CONFIG_PREFIX_ALL
#if defined(FLA_EXT_CATCH2_V3)
#include <catch2/catch_all.hpp>
#elif defined(FLA_EXT_CATCH2_V2)
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
#elif __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#elif __has_include(<catch2/catch.hpp>)
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
#else
#error "fla_ext tests need Catch2 (v3: catch2/catch_all.hpp, or v2: catch2/catch.hpp)"
#endif

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>

#include <fla_ext/fla_ext.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace {

using at::Tensor;

constexpr int64_t B = 2, T = 9, H = 2, K = 3, V = 5;

struct Inputs {
  Tensor r, k, v, w, u, h0;  // [B, T, H, K|V] activations, u [H, K], h0 [N, H, K, V]
};

// Random RWKV6 inputs in `dtype` (float32/float64); the state in the matching acc type.
Inputs make_inputs(at::ScalarType dtype, int64_t b, int64_t t, int64_t n, uint64_t seed) {
  at::manual_seed(seed);
  const auto o = at::TensorOptions().dtype(at::kDouble);
  Inputs in;
  in.r = at::randn({b, t, H, K}, o).to(dtype);
  in.k = at::randn({b, t, H, K}, o).to(dtype);
  in.v = at::randn({b, t, H, V}, o).to(dtype);
  in.w = (-at::exp(0.5 * at::randn({b, t, H, K}, o) - 1.0)).to(dtype);  // log decay < 0
  in.u = at::randn({H, K}, o).to(dtype);
  in.h0 = at::randn({n, H, K, V}, o).to(dtype);  // acc type == activation type for f32/f64
  return in;
}

// The RWKV6 recurrence as a plain loop in double, one sequence per batch row:
//   o_t = scale * (h_{t-1} + diag(u) k_t v_t^T)^T r_t,   h_t = diag(exp(w_t)) h_{t-1} + k_t v_t^T
// Returns o [B, T, H, V] and h_T [B, H, K, V] (float64).
std::pair<Tensor, Tensor> rwkv6_loop(const Inputs& in, double scale) {
  const auto r = in.r.to(at::kDouble).contiguous(), k = in.k.to(at::kDouble).contiguous(),
             v = in.v.to(at::kDouble).contiguous(), w = in.w.to(at::kDouble).contiguous(),
             u = in.u.to(at::kDouble).contiguous();
  const int64_t nb = r.size(0), nt = r.size(1);
  Tensor o = at::zeros({nb, nt, H, V}, at::kDouble);
  Tensor hT = in.h0.to(at::kDouble).clone().contiguous();
  auto R = r.accessor<double, 4>(), Kx = k.accessor<double, 4>(), Vx = v.accessor<double, 4>(),
       W = w.accessor<double, 4>(), O = o.accessor<double, 4>(), S = hT.accessor<double, 4>();
  auto U = u.accessor<double, 2>();
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < nt; ++t) {
        for (int64_t j = 0; j < V; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < K; ++i)
            acc += R[b][t][h][i] * (S[b][h][i][j] + U[h][i] * Kx[b][t][h][i] * Vx[b][t][h][j]);
          O[b][t][h][j] = scale * acc;
        }
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < V; ++j)
            S[b][h][i][j] = std::exp(W[b][t][h][i]) * S[b][h][i][j] +
                            Kx[b][t][h][i] * Vx[b][t][h][j];
      }
  return {o, hT};
}

// max |a - b| / (1 + |b|), both taken to float64.
double max_err(const Tensor& a, const Tensor& b) {
  CATCH_REQUIRE(a.sizes() == b.sizes());
  const auto a64 = a.to(at::kDouble), b64 = b.to(at::kDouble);
  return ((a64 - b64).abs() / (1.0 + b64.abs())).max().item<double>();
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no exception)";
}

}  // namespace

CATCH_TEST_CASE("forward matches the RWKV6 loop (float32 and float64)", "[forward]") {
  for (auto dtype : {at::kFloat, at::kDouble}) {
    const double tol = dtype == at::kFloat ? 1e-5 : 1e-12;
    CATCH_CAPTURE(c10::toString(dtype));
    const Inputs in = make_inputs(dtype, B, T, B, 1234);
    auto [o, hT] = fla_ext::fused_recurrent_rwkv6(in.r, in.k, in.v, in.w, in.u,
                                                  /*scale=*/std::nullopt, in.h0,
                                                  /*output_final_state=*/true);
    CATCH_REQUIRE(o.scalar_type() == dtype);
    CATCH_REQUIRE(o.sizes() == at::IntArrayRef({B, T, H, V}));
    CATCH_REQUIRE(hT.sizes() == at::IntArrayRef({B, H, K, V}));
    auto [o_ref, hT_ref] = rwkv6_loop(in, 1.0 / std::sqrt(double(K)));  // default scale K^-0.5
    CATCH_CHECK(max_err(o, o_ref) <= tol);
    CATCH_CHECK(max_err(hT, hT_ref) <= tol);

    // An explicit scale, and no final state requested: an empty state comes back.
    auto [o2, hT2] = fla_ext::fused_recurrent_rwkv6(in.r, in.k, in.v, in.w, in.u, 0.7, in.h0);
    CATCH_CHECK(max_err(o2, rwkv6_loop(in, 0.7).first) <= tol);
    CATCH_CHECK(hT2.numel() == 0);
  }
}

CATCH_TEST_CASE("GLA: forward matches its loop, gradients match finite differences", "[gla]") {
  // h_t = diag(exp(g_t)) h_{t-1} + k_t v_t^T, o_t = scale h_t^T q_t (inclusive), in float64.
  const Inputs in = make_inputs(at::kDouble, B, T, B, 77);
  const Tensor q = in.r, g = in.w;
  auto loop = [&](const Tensor& qq, const Tensor& gg) {
    Tensor h = in.h0.clone();
    std::vector<Tensor> os;
    for (int64_t t = 0; t < T; ++t) {
      h = gg.select(1, t).exp().unsqueeze(-1) * h +
          in.k.select(1, t).unsqueeze(-1) * in.v.select(1, t).unsqueeze(-2);
      os.push_back(std::sqrt(1.0 / K) * (h * qq.select(1, t).unsqueeze(-1)).sum(2));
    }
    return std::make_pair(at::stack(os, 1), h);
  };
  auto [o, hT] = fla_ext::fused_recurrent_gla(q, in.k, in.v, g, std::nullopt, std::nullopt, in.h0, true);
  auto [o_ref, hT_ref] = loop(q, g);
  CATCH_CHECK(max_err(o, o_ref) <= 1e-12);
  CATCH_CHECK(max_err(hT, hT_ref) <= 1e-12);

  // d/dq and d/dg of sum(o) through C++ autograd vs central differences of the op.
  const Tensor qg = q.clone().requires_grad_(true), gg = g.clone().requires_grad_(true);
  auto [o2, unused] = fla_ext::fused_recurrent_gla(qg, in.k, in.v, gg, std::nullopt, std::nullopt, in.h0);
  o2.sum().backward();
  for (auto [x, grad] : {std::make_pair(q, qg.grad()), std::make_pair(g, gg.grad())}) {
    const double eps = 1e-6;
    Tensor flat = x.flatten();
    for (int64_t i = 0; i < flat.numel(); i += 7) {
      Tensor xp = x.clone(), xm = x.clone();
      xp.view(-1)[i] += eps, xm.view(-1)[i] -= eps;
      const bool is_q = x.data_ptr() == q.data_ptr();
      auto f = [&](const Tensor& y) {
        return std::get<0>(fla_ext::fused_recurrent_gla(is_q ? y : q, in.k, in.v, is_q ? g : y,
                                                        std::nullopt, std::nullopt, in.h0))
            .sum()
            .item<double>();
      };
      const double fd = (f(xp) - f(xm)) / (2 * eps);
      CATCH_CHECK(std::abs(grad.view(-1)[i].item<double>() - fd) <= 1e-6 * (1 + std::abs(fd)));
    }
  }
}

namespace {
// The autograd gradients of loss_of(xs) (leaves xs, float64) against central differences of it.
void check_grads_fd(std::vector<Tensor> xs, const std::vector<const char*>& names,
                    const std::function<Tensor(const std::vector<Tensor>&)>& loss_of) {
  for (auto& x : xs) x = x.clone().requires_grad_(true);
  Tensor loss = loss_of(xs);
  CATCH_REQUIRE(loss.requires_grad());
  loss.backward();

  at::NoGradGuard no_grad;
  constexpr double eps = 1e-6, rtol = 1e-6;
  for (size_t i = 0; i < xs.size(); ++i) {
    CATCH_CAPTURE(names[i]);
    const Tensor grad = xs[i].grad();
    CATCH_REQUIRE(grad.defined());
    CATCH_REQUIRE(grad.sizes() == xs[i].sizes());
    std::vector<Tensor> a;
    for (const auto& x : xs) a.push_back(x.detach().clone());
    Tensor flat = a[i].view(-1);  // shares storage with a[i]
    const Tensor gflat = grad.contiguous().view(-1);
    double worst = 0;
    for (int64_t j = 0; j < flat.numel(); ++j) {
      const double x0 = flat[j].item<double>();
      flat[j] = x0 + eps;
      const double lp = loss_of(a).item<double>();
      flat[j] = x0 - eps;
      const double lm = loss_of(a).item<double>();
      flat[j] = x0;
      const double fd = (lp - lm) / (2 * eps);
      const double err = std::abs(gflat[j].item<double>() - fd) / std::max(1.0, std::abs(fd));
      worst = std::max(worst, err);
    }
    CATCH_CHECK(worst <= rtol);
  }
}
}  // namespace

CATCH_TEST_CASE("autograd backward matches finite differences (float64)", "[backward]") {
  const Inputs in = make_inputs(at::kDouble, B, T, B, 99);
  const Tensor go = at::randn({B, T, H, V}, at::kDouble);
  const Tensor gh = at::randn({B, H, K, V}, at::kDouble);
  check_grads_fd({in.r, in.k, in.v, in.w, in.u, in.h0},
                 {"r", "k", "v", "w", "u", "initial_state"}, [&](const std::vector<Tensor>& a) {
                   auto [o, hT] = fla_ext::fused_recurrent_rwkv6(
                       a[0], a[1], a[2], a[3], a[4], std::nullopt, a[5], /*output_final_state=*/true);
                   return (o * go).sum() + (hT * gh).sum();
                 });
}

CATCH_TEST_CASE("GLA with key- and value-side decays: loop, C++ autograd vs finite differences",
                "[gla]") {
  // h_t = diag(exp(gk_t)) h_{t-1} diag(exp(gv_t)) + k_t v_t^T, o_t = scale h_t^T q_t, float64;
  // gv alone and gk + gv together, reversed, an explicit scale.
  const Inputs in = make_inputs(at::kDouble, B, T, B, 31);
  const Tensor gv = -at::exp(0.5 * at::randn({B, T, H, V}, at::kDouble) - 1.0);
  const double scale = 0.8;
  auto loop = [&](const std::optional<Tensor>& gk) {
    Tensor h = in.h0.clone();
    std::vector<Tensor> os(T);
    for (int64_t s = 0; s < T; ++s) {
      const int64_t t = T - 1 - s;  // reverse
      Tensor a = gv.select(1, t).exp().unsqueeze(-2);
      if (gk) a = a * gk->select(1, t).exp().unsqueeze(-1);
      h = a * h + in.k.select(1, t).unsqueeze(-1) * in.v.select(1, t).unsqueeze(-2);
      os[t] = scale * (h * in.r.select(1, t).unsqueeze(-1)).sum(2);
    }
    return std::make_pair(at::stack(os, 1), h);
  };
  for (const bool with_gk : {false, true}) {
    CATCH_CAPTURE(with_gk);
    const std::optional<Tensor> gk = with_gk ? std::optional<Tensor>(in.w) : std::nullopt;
    auto [o, hT] = fla_ext::fused_recurrent_gla(in.r, in.k, in.v, gk, gv, scale, in.h0, true, true);
    auto [o_ref, hT_ref] = loop(gk);
    CATCH_CHECK(max_err(o, o_ref) <= 1e-12);
    CATCH_CHECK(max_err(hT, hT_ref) <= 1e-12);
  }
  const Tensor go = at::randn({B, T, H, V}, at::kDouble);
  const Tensor gh = at::randn({B, H, K, V}, at::kDouble);
  check_grads_fd({in.r, in.k, in.v, in.w, gv, in.h0}, {"q", "k", "v", "gk", "gv", "initial_state"},
                 [&](const std::vector<Tensor>& a) {
                   auto [o, hT] = fla_ext::fused_recurrent_gla(a[0], a[1], a[2], a[3], a[4], scale,
                                                               a[5], true, true);
                   return (o * go).sum() + (hT * gh).sum();
                 });
}

CATCH_TEST_CASE("RWKV7: C++ autograd matches finite differences (float64, varlen)", "[rwkv7]") {
  // Generic a, b; two sequences, one of 20 steps (two checkpoint segments), and an empty one.
  const Inputs in = make_inputs(at::kDouble, 1, 20, 3, 123);
  const Tensor a = 0.3 * at::randn({1, 20, H, K}, at::kDouble);
  const Tensor b = 0.3 * at::randn({1, 20, H, K}, at::kDouble);
  const Tensor cu = at::tensor(std::vector<int64_t>{0, 0, 6, 20}, at::kLong);
  const Tensor go = at::randn({1, 20, H, V}, at::kDouble);
  const Tensor gh = at::randn({3, H, K, V}, at::kDouble);
  check_grads_fd({in.r, in.w, in.k, in.v, a, b, in.h0}, {"r", "w", "k", "v", "a", "b", "initial_state"},
                 [&](const std::vector<Tensor>& x) {
                   auto [o, hT] = fla_ext::fused_recurrent_rwkv7(x[0], x[1], x[2], x[3], x[4], x[5],
                                                                 0.7, x[6], true, false, cu);
                   return (o * go).sum() + (hT * gh).sum();
                 });
}

CATCH_TEST_CASE("chunk_rwkv7: forward equals the fused op, C++ autograd matches finite differences",
                "[rwkv7][chunk]") {
  // Generic a, b; 37 steps (two full 16-row chunks and a partial one) split into sequences of
  // 0, 20 and 17 steps.
  const Inputs in = make_inputs(at::kDouble, 1, 37, 3, 321);
  const Tensor a = 0.3 * at::randn({1, 37, H, K}, at::kDouble);
  const Tensor b = 0.3 * at::randn({1, 37, H, K}, at::kDouble);
  const Tensor cu = at::tensor(std::vector<int64_t>{0, 0, 20, 37}, at::kLong);
  auto [o, hT] = fla_ext::chunk_rwkv7(in.r, in.w, in.k, in.v, a, b, 0.7, in.h0, true, cu);
  auto [o_ref, hT_ref] =
      fla_ext::fused_recurrent_rwkv7(in.r, in.w, in.k, in.v, a, b, 0.7, in.h0, true, false, cu);
  CATCH_CHECK(max_err(o, o_ref) < 1e-12);
  CATCH_CHECK(max_err(hT, hT_ref) < 1e-12);
  const Tensor go = at::randn({1, 37, H, V}, at::kDouble);
  const Tensor gh = at::randn({3, H, K, V}, at::kDouble);
  check_grads_fd({in.r, in.w, in.k, in.v, a, b, in.h0}, {"r", "w", "k", "v", "a", "b", "initial_state"},
                 [&](const std::vector<Tensor>& x) {
                   auto [o, hT] = fla_ext::chunk_rwkv7(x[0], x[1], x[2], x[3], x[4], x[5], 0.7,
                                                       x[6], true, cu);
                   return (o * go).sum() + (hT * gh).sum();
                 });
}

CATCH_TEST_CASE("chunk ops: forward equals the loop, C++ autograd matches finite differences",
                "[chunk]") {
  // 70 steps: one full 64-row chunk and a partial one; the loop is the fused-recurrence oracle.
  const Inputs in = make_inputs(at::kDouble, 1, 70, 1, 7);
  const double scale = 0.6;
  auto [o, hT] = fla_ext::chunk_rwkv6(in.r, in.k, in.v, in.w, in.u, scale, in.h0, true);
  auto [o_ref, hT_ref] = rwkv6_loop(in, scale);
  CATCH_CHECK(max_err(o, o_ref) < 1e-12);
  CATCH_CHECK(max_err(hT, hT_ref) < 1e-12);
  auto [og, hg] = fla_ext::chunk_gla(in.r, in.k, in.v, in.w, std::nullopt, scale, in.h0, true);
  auto [og_ref, hg_ref] = fla_ext::fused_recurrent_gla(in.r, in.k, in.v, in.w, std::nullopt, scale, in.h0, true);
  CATCH_CHECK(max_err(og, og_ref) < 1e-12);
  CATCH_CHECK(max_err(hg, hg_ref) < 1e-12);

  const Inputs s = make_inputs(at::kDouble, 1, 66, 1, 8);  // small: the FD loop is O(numel^2)
  const Tensor go = at::randn({1, 66, H, V}, at::kDouble);
  const Tensor gh = at::randn({1, H, K, V}, at::kDouble);
  check_grads_fd({s.r, s.k, s.v, s.w, s.u, s.h0}, {"r", "k", "v", "w", "u", "initial_state"},
                 [&](const std::vector<Tensor>& a) {
                   auto [o, hT] = fla_ext::chunk_rwkv6(a[0], a[1], a[2], a[3], a[4], scale, a[5], true);
                   return (o * go).sum() + (hT * gh).sum();
                 });
  check_grads_fd({s.r, s.k, s.v, s.w, s.h0}, {"q", "k", "v", "g", "initial_state"},
                 [&](const std::vector<Tensor>& a) {
                   auto [o, hT] = fla_ext::chunk_gla(a[0], a[1], a[2], a[3], std::nullopt, scale,
                                                     a[4], true);
                   return (o * go).sum() + (hT * gh).sum();
                 });
  // The value-side decay (GSA pass 1), alone and with the key-side one.
  const Tensor gv = at::log_sigmoid(at::randn({1, 66, H, V}, at::kDouble));
  check_grads_fd({s.r, s.k, s.v, s.w, gv, s.h0}, {"q", "k", "v", "g", "gv", "initial_state"},
                 [&](const std::vector<Tensor>& a) {
                   auto [o, hT] = fla_ext::chunk_gla(a[0], a[1], a[2], a[3], a[4], scale, a[5], true);
                   return (o * go).sum() + (hT * gh).sum();
                 });
  check_grads_fd({s.r, s.k, s.v, gv, s.h0}, {"q", "k", "v", "gv", "initial_state"},
                 [&](const std::vector<Tensor>& a) {
                   auto [o, hT] = fla_ext::chunk_gla(a[0], a[1], a[2], std::nullopt, a[3], scale,
                                                     a[4], true);
                   return (o * go).sum() + (hT * gh).sum();
                 });
}

CATCH_TEST_CASE("bad arguments throw with a message naming the argument", "[errors]") {
  const Inputs in = make_inputs(at::kFloat, B, T, B, 5);
  const Tensor bad_u = at::randn({H, K + 1});
  const std::string msg = message_of(
      [&] { fla_ext::fused_recurrent_rwkv6(in.r, in.k, in.v, in.w, bad_u); });
  CATCH_CAPTURE(msg);
  CATCH_CHECK(msg.find("`u`") != std::string::npos);
  CATCH_CHECK(msg.find("[H, K]") != std::string::npos);
  CATCH_CHECK_THROWS_AS(fla_ext::fused_recurrent_rwkv6(in.r, in.k, in.v, in.w, bad_u),
                        c10::ValueError);

  // A state of the wrong shape names initial_state; k of another shape names k.
  const std::string msg_h0 = message_of([&] {
    fla_ext::fused_recurrent_rwkv6(in.r, in.k, in.v, in.w, in.u, std::nullopt,
                                   at::zeros({B, H, K, V + 1}));
  });
  CATCH_CAPTURE(msg_h0);
  CATCH_CHECK(msg_h0.find("`initial_state`") != std::string::npos);
  const std::string msg_k = message_of([&] {
    fla_ext::fused_recurrent_rwkv6(in.r, in.k.narrow(1, 0, T - 1), in.v, in.w, in.u);
  });
  CATCH_CAPTURE(msg_k);
  CATCH_CHECK(msg_k.find("`k`") != std::string::npos);
}

CATCH_TEST_CASE("the op is a dispatcher op callable by name", "[dispatcher]") {
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fla::fused_recurrent_rwkv6", "");
  CATCH_CHECK(op.schema().name() == "fla::fused_recurrent_rwkv6");
  CATCH_CHECK(op.schema().arguments().size() == 11);
  CATCH_CHECK(op.schema().returns().size() == 2);
  CATCH_CHECK(op.hasKernelForDispatchKey(c10::DispatchKey::CPU));
  CATCH_CHECK(
      c10::Dispatcher::singleton().findSchema({"fla::fused_recurrent_rwkv6_bwd", ""}).has_value());

  // A boxed call: the arguments on an IValue stack, in schema order.
  const Inputs in = make_inputs(at::kFloat, B, T, B, 7);
  torch::jit::Stack stack{in.r, in.k, in.v, in.w, in.u, c10::IValue(0.5), in.h0, true,
                          false, c10::IValue(), false};
  op.callBoxed(&stack);
  CATCH_REQUIRE(stack.size() == 2);
  const Tensor o = stack[0].toTensor(), hT = stack[1].toTensor();

  // The same through the typed call of the public header.
  auto [o2, hT2] = fla_ext::fused_recurrent_rwkv6(in.r, in.k, in.v, in.w, in.u, 0.5, in.h0, true);
  CATCH_CHECK(at::equal(o, o2));
  CATCH_CHECK(at::equal(hT, hT2));
}

CATCH_TEST_CASE("varlen: cu_seqlens gives each sequence's own result", "[varlen]") {
  const std::vector<int64_t> cu = {0, 3, 3, 9};  // lengths 3, 0, 6
  const int64_t N = int64_t(cu.size()) - 1;
  for (auto dtype : {at::kFloat, at::kDouble}) {
    CATCH_CAPTURE(c10::toString(dtype));
    const double tol = dtype == at::kFloat ? 1e-6 : 1e-13;
    const Inputs in = make_inputs(dtype, 1, T, N, 42);
    const Tensor cu_t = at::tensor(cu, at::kLong);
    auto [o, hT] = fla_ext::fused_recurrent_rwkv6(in.r, in.k, in.v, in.w, in.u, std::nullopt,
                                                  in.h0, true, false, cu_t);
    CATCH_REQUIRE(o.sizes() == at::IntArrayRef({1, T, H, V}));
    CATCH_REQUIRE(hT.sizes() == at::IntArrayRef({N, H, K, V}));
    for (int64_t n = 0; n < N; ++n) {
      CATCH_CAPTURE(n);
      const int64_t bos = cu[n], len = cu[n + 1] - cu[n];
      const Tensor h0n = in.h0.narrow(0, n, 1).contiguous();
      if (len == 0) {  // an empty sequence passes its state through unchanged
        CATCH_CHECK(max_err(hT.narrow(0, n, 1), h0n) <= tol);
        continue;
      }
      auto seq = [&](const Tensor& x) { return x.narrow(1, bos, len).contiguous(); };
      auto [on, hTn] = fla_ext::fused_recurrent_rwkv6(seq(in.r), seq(in.k), seq(in.v),
                                                      seq(in.w), in.u, std::nullopt, h0n, true);
      CATCH_CHECK(max_err(o.narrow(1, bos, len), on) <= tol);
      CATCH_CHECK(max_err(hT.narrow(0, n, 1), hTn) <= tol);
    }
  }
}

CATCH_TEST_CASE("CUDA kernels match the CPU (float32, forward and backward)", "[cuda]") {
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fla::fused_recurrent_rwkv6", "");
  if (!at::hasCUDA() || !op.hasKernelForDispatchKey(c10::DispatchKey::CUDA)) {
    CATCH_WARN("skipped: no GPU, or fla_ext built without -DFLA_EXT_CUDA=ON");
    return;
  }
  const Inputs in = make_inputs(at::kFloat, B, T, B, 11);
  const Tensor go = at::randn({B, T, H, V}), gh = at::randn({B, H, K, V});
  auto run = [&](at::Device dev) {
    std::vector<Tensor> xs = {in.r, in.k, in.v, in.w, in.u, in.h0};
    for (auto& x : xs) x = x.to(dev).detach().requires_grad_(true);  // fresh leaves
    auto [o, hT] = fla_ext::fused_recurrent_rwkv6(xs[0], xs[1], xs[2], xs[3], xs[4],
                                                  std::nullopt, xs[5], true);
    ((o * go.to(dev)).sum() + (hT * gh.to(dev)).sum()).backward();
    std::vector<Tensor> out = {o.detach().cpu(), hT.detach().cpu()};
    for (auto& x : xs) out.push_back(x.grad().cpu());
    return out;
  };
  const auto cpu = run(at::kCPU), gpu = run(at::Device(at::kCUDA, 0));
  const char* names[] = {"o", "final_state", "dr", "dk", "dv", "dw", "du", "dh0"};
  for (size_t i = 0; i < cpu.size(); ++i) {
    CATCH_CAPTURE(names[i]);
    CATCH_CHECK(max_err(gpu[i], cpu[i]) <= 1e-4);
  }
}

CATCH_TEST_CASE("GSA: chunked and step-by-step agree, C++ autograd reaches every input", "[gsa]") {
  // Grouped heads (4 query heads on 2 key heads), fla's g = None gate and a given gate, K != V,
  // both initial states; float64, so the two modes agree to rounding.
  at::manual_seed(5);
  const auto o64 = at::TensorOptions().dtype(at::kDouble);
  const int64_t HQ = 4, HK = 2, M = 4, L = 70;  // L > 64: two chunks
  for (bool with_g : {true, false}) {
    CATCH_CAPTURE(with_g);
    std::vector<Tensor> base = {at::randn({1, L, HQ, K}, o64), at::randn({1, L, HK, K}, o64),
                                at::randn({1, L, HK, V}, o64), at::randn({1, L, HK, M}, o64),
                                at::log_sigmoid(at::randn({1, L, HK, M}, o64)),
                                at::randn({1, HK, K, M}, o64), at::randn({1, HK, M, V}, o64)};
    const Tensor go = at::randn({1, L, HQ, V}, o64);
    auto run = [&](bool chunk) {
      std::vector<Tensor> xs;
      for (auto& x : base) xs.push_back(x.detach().clone().requires_grad_(true));
      const std::optional<Tensor> g = with_g ? std::optional<Tensor>(xs[4]) : std::nullopt;
      auto [o, hk, hv] = chunk ? fla_ext::chunk_gsa(xs[0], xs[1], xs[2], xs[3], g, std::nullopt,
                                                    xs[5], xs[6], true)
                               : fla_ext::fused_recurrent_gsa(xs[0], xs[1], xs[2], xs[3], g,
                                                              std::nullopt, xs[5], xs[6], true);
      CATCH_REQUIRE(o.sizes() == at::IntArrayRef({1, L, HQ, V}));
      CATCH_REQUIRE(hk.sizes() == at::IntArrayRef({1, HK, K, M}));
      ((o * go).sum() + hk.sum() + (hv * hv).sum()).backward();
      std::vector<Tensor> out = {o.detach(), hk.detach(), hv.detach()};
      for (size_t i = 0; i < xs.size(); ++i) {
        if (i == 4 && !with_g) continue;
        CATCH_REQUIRE(xs[i].grad().defined());
        out.push_back(xs[i].grad());
      }
      return out;
    };
    const auto c = run(true), f = run(false);
    for (size_t i = 0; i < c.size(); ++i) {
      CATCH_CAPTURE(i);
      CATCH_CHECK(max_err(c[i], f[i]) <= 1e-9);
    }
  }
}
