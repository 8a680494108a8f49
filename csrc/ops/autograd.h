// Helpers of the ops' autograd (ops/autograd.cpp): the first-order rule every backward follows.
#pragma once
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <memory>
#include <string>
#include <type_traits>

namespace fla::ops {

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
