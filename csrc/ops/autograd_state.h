// What the recurrent ops' autograd Functions keep between forward and backward besides tensors.
#pragma once
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

namespace fla::ops {

inline at::Tensor opt(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? *t : at::Tensor();
}
inline std::optional<at::Tensor> some(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Whether this call records a graph: only then does a forward keep workspaces for a backward.
template <typename... Ts>
bool training(const Ts&... ts) {
  auto req = [](const auto& t) {
    if constexpr (std::is_same_v<std::decay_t<decltype(t)>, std::optional<at::Tensor>>)
      return t.has_value() && t->defined() && t->requires_grad();
    else
      return t.defined() && t.requires_grad();
  };
  return torch::autograd::GradMode::is_enabled() && (req(ts) || ...);
}

// The forward of an op with a training twin: a recording call runs the _train op (the plain op's
// outputs, then the workspaces its backward reuses), any other the plain op, the workspaces left
// undefined. Returns the _train op's tuple either way.
template <class Plain, class Train, class... Args>
auto forward_op(bool train, const Plain& op, const Train& op_train, const Args&... args) {
  using Out = decltype(op_train.call(args...));
  if (train) return op_train.call(args...);
  Out out;
  const auto plain = op.call(args...);
  [&]<size_t... I>(std::index_sequence<I...>) {
    ((std::get<I>(out) = std::get<I>(plain)), ...);
  }(std::make_index_sequence<std::tuple_size_v<std::decay_t<decltype(plain)>>>{});
  return out;
}

struct SweepFlags {
  std::optional<double> scale;
  bool reverse = false, head_first = false, has_ht = false;

  void save(torch::autograd::AutogradContext* ctx) const {
    ctx->saved_data["scale"] = scale.has_value() ? c10::IValue(*scale) : c10::IValue();
    ctx->saved_data["reverse"] = reverse;
    ctx->saved_data["head_first"] = head_first;
    ctx->saved_data["has_ht"] = has_ht;
  }
  static SweepFlags load(torch::autograd::AutogradContext* ctx) {
    const auto& sd = ctx->saved_data;
    SweepFlags f;
    if (!sd.at("scale").isNone()) f.scale = sd.at("scale").toDouble();
    f.reverse = sd.at("reverse").toBool();
    f.head_first = sd.at("head_first").toBool();
    f.has_ht = sd.at("has_ht").toBool();
    return f;
  }
  // The final state's incoming gradient, when the forward returned one.
  std::optional<at::Tensor> dht(const torch::autograd::variable_list& grads) const {
    return has_ht && grads[1].defined() ? std::optional<at::Tensor>(grads[1]) : std::nullopt;
  }
};

// The autograd graph's node pointer: std::shared_ptr<Node> in older torch (2.11), c10::intrusive_ptr
// in newer (2.14): both build.
using NodePtr = std::invoke_result_t<torch::autograd::function_constructor, torch::autograd::edge_list&&>;
template <class Ptr>
Ptr make_error_node(const std::string& msg, torch::autograd::edge_list&& edges) {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<torch::autograd::Node>>)
    return std::make_shared<torch::autograd::Error>(msg, std::move(edges));
  else
    return c10::make_intrusive<torch::autograd::Error>(msg, std::move(edges));
}

// Every op's backward is first order (the _bwd ops have no derivative of their own). `compute`
// runs the backward without recording; under create_graph (grad mode on inside a backward) the
// gradients come back as outputs of a node that raises, naming the op, when a second backward
// reaches it (its edges lead to the forward's inputs and the incoming gradients, so any
// differentiation of them does): a double backward is an error, never silent zeros.
template <class Compute>
torch::autograd::variable_list first_order_backward(const char* op,
                                                    torch::autograd::AutogradContext* ctx,
                                                    const torch::autograd::variable_list& grads_in,
                                                    Compute&& compute) {
  const bool create_graph = torch::autograd::GradMode::is_enabled();
  torch::autograd::variable_list grads;
  {
    at::NoGradGuard no_grad;
    grads = compute();
  }
  if (!create_graph) return grads;
  torch::autograd::variable_list deps = ctx->get_saved_variables();
  deps.insert(deps.end(), grads_in.begin(), grads_in.end());
  const std::string msg = std::string("fla_ext: ") + op +
                          " has no double backward: its backward is first order, so gradients "
                          "taken with create_graph=True cannot be differentiated again";
  return torch::autograd::wrap_outputs(deps, std::move(grads), [&](torch::autograd::edge_list&& e) {
    return make_error_node<NodePtr>(msg, std::move(e));
  });
}

}  // namespace fla::ops
