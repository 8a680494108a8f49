// The autograd of every differentiable fla op, one boxed kernel at the Autograd key for all of
// them. The forward is the op itself, or its _train twin when the call records a graph (the
// twin also returns the workspaces its backward reuses: chunk-start states, pair matrices;
// under FLA_EXT_KEEP_WORKSPACES=0 only those the backward cannot make again are kept); the
// backward is the op's _bwd op. Both stay dispatcher calls, so torch.compile traces them like any
// other op, and the _bwd op's arguments are filled by schema name:
//   - a name of the forward's arguments: that argument (tensors saved, the rest kept as values);
//   - grad_o: the first output's gradient (zeros when it has none);
//   - any other grad_*: the gradients of the state outputs, in output order (None unless the
//     forward returned final states and a gradient reached them);
//   - a name of the _train op's extra outputs: that workspace (None when the forward kept none).
// Its outputs d<name> are the gradients of the forward's argument <name> (dh0: initial_state).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "autograd.h"
#include "common.h"

namespace fla::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Stack = std::vector<c10::IValue>;

struct Differentiable {
  const char* op;    // the forward op, without "fla::"
  const char* user;  // the op the user called, for messages (chunk_gsa runs chunk_gsa_core)
  bool has_train;    // fla::<op>_train exists
};

constexpr Differentiable kOps[] = {
    {"fused_recurrent_rwkv6", "fused_recurrent_rwkv6", false},
    {"fused_recurrent_gla", "fused_recurrent_gla", false},
    {"fused_recurrent_rwkv7", "fused_recurrent_rwkv7", false},
    {"chunk_gla", "chunk_gla", true},
    {"chunk_rwkv6", "chunk_rwkv6", true},
    {"chunk_rwkv7", "chunk_rwkv7", true},
    {"chunk_gsa_core", "chunk_gsa", true},
};
constexpr int kNumOps = sizeof(kOps) / sizeof(kOps[0]);

int arg_index(const std::vector<c10::Argument>& args, const std::string& name) {
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i].name() == name) return int(i);
  return -1;
}

struct Handles {
  c10::OperatorHandle forward, train, backward;
  // Per workspace (extra output of the _train op): whether the backward makes it again when it
  // gets None, its schema taking it as an optional tensor (chunk_gsa's softmax p is not).
  std::vector<bool> remade;
  bool remakes_all = true;
};

const Handles& handles(int i) {
  // Looked up once, on the first call (every fla op is registered by then).
  static const std::vector<Handles> table = [] {
    std::vector<Handles> t;
    for (const auto& d : kOps) {
      const std::string op = d.op;
      Handles h{fla_op(op), fla_op(d.has_train ? op + "_train" : op), fla_op(op + "_bwd")};
      const auto& outs = h.train.schema().returns();
      const auto& bwd = h.backward.schema().arguments();
      for (size_t j = h.forward.schema().returns().size(); j < outs.size(); ++j) {
        const int a = arg_index(bwd, outs[j].name());
        h.remade.push_back(a >= 0 && bwd[a].type()->cast<c10::OptionalType>() != nullptr);
        h.remakes_all = h.remakes_all && h.remade.back();
      }
      t.push_back(std::move(h));
    }
    return t;
  }();
  return table[i];
}

int op_index(const c10::OperatorName& name) {
  for (int i = 0; i < kNumOps; ++i)
    if (handles(i).forward.operator_name() == name) return i;
  TORCH_INTERNAL_ASSERT(false, "fla_ext: no autograd entry for ", name.name);
}

bool is_tensor_type(const c10::Argument& a) {
  const auto& t = a.type();
  if (t->kind() == c10::TypeKind::TensorType) return true;
  const auto opt = t->cast<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == c10::TypeKind::TensorType;
}

// The forward argument a _bwd output d<name> is the gradient of.
std::string grad_target(const std::string& out) {
  const std::string name = out.substr(1);
  return name == "h0" ? "initial_state" : name;
}

class OpFunction : public torch::autograd::Function<OpFunction> {
 public:
  // inputs: the defined tensor arguments (the graph's inputs), at indices `input_args` of args.
  static variable_list forward(AutogradContext* ctx, int op, at::TensorList /*inputs*/,
                               const std::vector<int64_t>& input_args, const Stack& args,
                               bool train, bool keep) {
    at::AutoDispatchBelowADInplaceOrView below;
    const Handles& h = handles(op);
    const auto& schema = h.forward.schema();
    Stack stack = args;
    (train ? h.train : h.forward).callBoxed(stack);
    const size_t outputs = schema.returns().size();  // the user's; the rest are workspaces
    variable_list saved;
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i].isTensor()) {
        saved.push_back(args[i].toTensor());
      } else {
        saved.emplace_back();
        ctx->saved_data[schema.arguments()[i].name()] = args[i];
      }
    }
    // Workspaces: all kept, or (`keep` false) only those the backward cannot make again; one it
    // can goes to the backward as None, which then recomputes it.
    for (size_t i = outputs; i < stack.size(); ++i)
      saved.push_back(keep || !h.remade[i - outputs] ? stack[i].toTensor() : at::Tensor());
    ctx->save_for_backward(saved);
    ctx->saved_data["op"] = int64_t(op);
    ctx->saved_data["train"] = train;
    ctx->saved_data["input_args"] = input_args;
    const at::Tensor o = stack[0].toTensor();
    ctx->saved_data["o_sizes"] = o.sizes().vec();
    ctx->saved_data["o_dtype"] = int64_t(o.scalar_type());
    variable_list out;
    for (size_t i = 0; i < outputs; ++i) out.push_back(stack[i].toTensor());
    const int fs = arg_index(schema.arguments(), "output_final_state");
    if (fs >= 0 && !args[fs].toBool())  // the state outputs are then empty placeholders
      ctx->mark_non_differentiable(variable_list(out.begin() + 1, out.end()));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int op = int(ctx->saved_data["op"].toInt());
    return first_order_backward(kOps[op].user, ctx, grads, [&] {
      const Handles& h = handles(op);
      const auto& fwd = h.forward.schema().arguments();
      const auto& train_out = h.train.schema().returns();
      const size_t outputs = h.forward.schema().returns().size();
      const bool train = ctx->saved_data["train"].toBool();
      const auto saved = ctx->get_saved_variables();
      auto tensor_or_none = [](const at::Tensor& t) {
        return t.defined() ? c10::IValue(t) : c10::IValue();
      };
      Stack stack;
      size_t state_grad = 1;
      for (const auto& a : h.backward.schema().arguments()) {
        const std::string& name = a.name();
        if (const int i = arg_index(fwd, name); i >= 0) {
          stack.push_back(is_tensor_type(a) ? tensor_or_none(saved[i]) : ctx->saved_data[name]);
        } else if (name == "grad_o") {
          const auto dtype = c10::ScalarType(ctx->saved_data["o_dtype"].toInt());
          const auto& like = saved[0];  // the first activation: the output's device
          stack.emplace_back(grads[0].defined()
                                 ? grads[0]
                                 : at::zeros(ctx->saved_data["o_sizes"].toIntVector(),
                                             like.options().dtype(dtype)));
        } else if (name.rfind("grad_", 0) == 0) {
          const bool has_states = ctx->saved_data["output_final_state"].toBool();
          const at::Tensor& g = grads[state_grad++];
          stack.push_back(has_states ? tensor_or_none(g) : c10::IValue());
        } else {
          int w = -1;
          for (size_t j = outputs; j < train_out.size(); ++j)
            if (train_out[j].name() == name) w = int(j - outputs);
          TORCH_INTERNAL_ASSERT(w >= 0, "fla_ext: ", kOps[op].op, "_bwd: no value for `", name, "`");
          stack.push_back(train ? tensor_or_none(saved[fwd.size() + w]) : c10::IValue());
        }
      }
      h.backward.callBoxed(stack);
      // One gradient per forward slot: op, each input tensor, input_args, args, train, keep.
      const auto input_args = ctx->saved_data["input_args"].toIntVector();
      variable_list out(input_args.size() + 5);
      const auto& bwd_out = h.backward.schema().returns();
      for (size_t r = 0; r < bwd_out.size(); ++r) {
        const int arg = arg_index(fwd, grad_target(bwd_out[r].name()));
        for (size_t j = 0; j < input_args.size(); ++j)
          if (input_args[j] == arg) out[1 + j] = stack[r].toTensor();
      }
      return out;
    });
  }
};

// The Autograd kernel of every op in kOps.
void autograd_kernel(const c10::OperatorHandle& handle, c10::DispatchKeySet, Stack* stack) {
  const auto& schema = handle.schema();
  const int op = op_index(schema.operator_name());
  const size_t n = schema.arguments().size();
  Stack args(stack->end() - n, stack->end());
  stack->erase(stack->end() - n, stack->end());
  std::vector<at::Tensor> inputs;
  std::vector<int64_t> input_args;
  bool requires_grad = false;
  for (size_t i = 0; i < n; ++i) {
    const auto& a = schema.arguments()[i];
    const bool defined = args[i].isTensor() && args[i].toTensor().defined();
    // A custom Function cannot record an undefined input, and the user should hear its name.
    TORCH_CHECK_VALUE(defined || a.type()->kind() != c10::TypeKind::TensorType, "fla_ext: `",
                      a.name(), "` must be a tensor, got None");
    if (!defined) continue;
    inputs.push_back(args[i].toTensor());
    input_args.push_back(int64_t(i));
    requires_grad |= inputs.back().requires_grad();
  }
  // A recording call runs the _train op, unless the workspaces are not to be kept and the
  // backward can make every one again: then the plain op runs (it may take a leaner path:
  // chunk_rwkv7's fused forward).
  const bool record = torch::autograd::GradMode::is_enabled() && requires_grad && kOps[op].has_train;
  const bool keep = !record || keeps_workspaces();
  const bool train = record && (keep || !handles(op).remakes_all);
  for (auto& t : OpFunction::apply(op, at::TensorList(inputs), input_args, args, train, keep))
    stack->push_back(std::move(t));
}

}  // namespace

TORCH_LIBRARY_IMPL(fla, Autograd, m) {
  for (const auto& d : kOps)
    m.impl(d.op, torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>());
}

}  // namespace fla::ops
