// Argument checking and tensor -> kernel-view helpers shared by every op family.
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <initializer_list>
#include <optional>
#include <utility>
#include <string>

#include "../kernels/recurrent.h"

namespace fla::ops {

using at::Tensor;
using Runner = void (*)(const RecurrentPass&);

// Largest K or V any kernel accepts.
constexpr int64_t kMaxHeadDim = 256;

// True when FLA_EXT_CHECKS is 1/true/on/yes (fla_ext.set_checks writes the variable; any value
// outside 0/1/true/false/on/off/yes/no is an error): enables value checks that read device memory
// (a host sync, so off by default and never inside CUDA-graph capture). False inside a
// ValueChecksDone scope.
bool value_checks_enabled();
// False when FLA_EXT_KEEP_WORKSPACES is 0/false/off/no (fla_ext.keep_workspaces writes it): a
// training forward then runs the plain op and keeps only its inputs, and the backward makes the
// chunk-start states and workspaces again (less memory between forward and backward, a slower
// backward). Any other value than those and 1/true/on/yes is an error naming the variable.
bool keeps_workspaces();
// FLA_EXT_WORKSPACE_MIB: the most workspace (MiB) an inference forward may take at once (it then
// runs in windows of the time axis); -1 when unset. Any value but a non-negative integer is an
// error naming the variable.
int64_t workspace_budget_mib();
// A composite op (GSA) that has value-checked its own arguments under their user-facing names
// holds one of these while it calls the ops it is made of, so their checks neither repeat nor
// name internal tensors.
struct ValueChecksDone {
  ValueChecksDone();
  ~ValueChecksDone();
  ValueChecksDone(const ValueChecksDone&) = delete;
  ValueChecksDone& operator=(const ValueChecksDone&) = delete;
};

// Uninitialised outputs; NaN-filled when FLA_EXT_POISON=1 (tests), so unwritten elements show.
Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& opts);
// A kept workspace handed to a backward: null when absent or empty, else checked to be the
// workspace (sizes, dtype, device) this call would otherwise allocate (the _bwd ops are public: a
// wrong one must not be read out of bounds). The caller allocates its own only when none is kept.
const Tensor* kept_workspace(const std::optional<Tensor>& t, at::IntArrayRef sizes,
                             const at::TensorOptions& opts, const char* name);

// The [B, T, H, D] view of an activation given in either layout.
struct Layout {
  bool head_first;
  int64_t B(const Tensor& t) const { return t.size(0); }
  int64_t T(const Tensor& t) const { return t.size(head_first ? 2 : 1); }
  int64_t H(const Tensor& t) const { return t.size(head_first ? 1 : 2); }
  int64_t D(const Tensor& t) const { return t.size(3); }
  std::string dims() const { return head_first ? "[B, H, T, D]" : "[B, T, H, D]"; }
  VecArg vec(const Tensor& t) const {
    VecArg v;
    v.ptr = t.data_ptr();
    v.sb = t.stride(0);
    v.st = t.stride(head_first ? 2 : 1);
    v.sh = t.stride(head_first ? 1 : 2);
    v.sd = t.stride(3);
    return v;
  }
  // An uninitialised tensor of this layout with last dim D, shaped like `like`.
  Tensor empty_like_with_dim(const Tensor& like, int64_t D, at::ScalarType dtype) const {
    auto sizes = like.sizes().vec();
    sizes[3] = D;
    return new_output(sizes, like.options().dtype(dtype));
  }
};

// A [N, H, R, C] fp32 state as a kernel matrix, optionally transposed (rows <-> cols).
MatArg mat(const Tensor& t, bool transpose = false);

DType kernel_dtype(const Tensor& t);
// States, workspaces and u are float32, or float64 when the activations are float64.
at::ScalarType acc_type(const Tensor& activation);

// RuntimeError naming `name` unless `t` is on `device` (the inputs' device).
void check_device(const Tensor& t, const char* name, c10::Device device);
// ValueError naming the first undefined (None) tensor among the op's required arguments; the
// autograd Functions cannot even record one.
void check_defined(std::initializer_list<std::pair<const Tensor&, const char*>> required);
// The device of the op's first activation, for its device guard; ValueError naming `name` when it
// is None (a raw torch.ops.fla call may pass one).
c10::Device device_of(const Tensor& t, const char* name);
// Throws ValueError/RuntimeError naming `name` unless `t` is a 4-D floating activation on `dev`.
void check_activation(const Tensor& t, const char* name, const Tensor& ref, const char* ref_name);
// Checks cu_seqlens (1-D integer, >= 2 entries, same device, B == 1) and returns it as int64.
// Its values (0 first, non-decreasing, T last) are checked when it is on the CPU, or with value
// checks on.
Tensor check_cu_seqlens(const std::optional<Tensor>& cu, const Tensor& ref, int64_t B, int64_t T);
// Checks a state [N, H, R, C] of the acc type of `ref`.
void check_state(const Tensor& s, const char* name, const Tensor& ref, int64_t N, int64_t H,
                 int64_t R, int64_t C, const char* dims = "[N, H, K, V]");
void check_head_dim(int64_t d, const char* what);
// Checks that `t` is an activation like `ref` (dtype, device) with exactly its shape.
void check_same_shape(const Tensor& t, const char* name, const Tensor& ref, const char* ref_name,
                      const Layout& L);

// A backward's incoming gradients: grad_o like the op's output (the shape of v, the dtype and
// device of `ref`, the op's first activation) and grad_final_state like its final state.
struct DiagArgs;
void check_incoming_grads(const DiagArgs& a, const Tensor& grad_o,
                          const std::optional<Tensor>& grad_final_state, const Tensor& ref,
                          const char* ref_name, const Tensor& v);

// FLA_EXT_CHECKS value checks (they read device memory).
void check_finite(const Tensor& t, const char* name);
void check_log_decay(const Tensor& w, const char* name);  // no NaN, <= 0 (-inf allowed)
void check_cu_values(const Tensor& cu, int64_t T);  // int64 cu_seqlens, on any device

std::string shape_str(const Tensor& t);

inline bool has(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }
// An optional tensor argument as a tensor (undefined when absent).
inline Tensor opt(const std::optional<Tensor>& t) { return has(t) ? *t : Tensor(); }

// The dispatcher's handle of the op fla::<name> (every op is registered when the library loads).
c10::OperatorHandle fla_op(const std::string& name);

// The checked shapes of a diagonal-gate op: reader q and key k [B, T, H, K], values v
// [B, T, H, V], log decay g like q (or undefined: no decay), initial state [N, H, K, V].
struct DiagArgs {
  Layout L;
  int64_t B, T, H, K, V, N;
  Tensor cu;  // int64, or undefined
  double scale;
  // GLA's wide q: a float32 q with bf16/fp16 k, v and gates. The kernels run in k's dtype with q
  // rounded to it; o and dq come out in float32, written from the fp32 accumulators (GSA: the
  // slot logits before the softmax and their gradient after it stay unrounded).
  bool wide_q = false;
};
// wide_q_ok: the op takes a wide q (GLA).
DiagArgs check_diag(const Tensor& q, const char* qn, const Tensor& k, const Tensor& v,
                    const Tensor& g, const char* gn, std::optional<double> scale,
                    const std::optional<Tensor>& h0, const std::optional<Tensor>& cu_seqlens,
                    bool head_first, bool wide_q_ok = false);
// q, or grad_o (float32 like a wide q's o), as the kernels read it: rounded to k's dtype for a
// wide q, else itself.
Tensor kernel_input(const DiagArgs& a, const Tensor& x, const Tensor& k);
// A sweep with the sizes, dtype (of `k`) and sequences of `a` filled in.
RecurrentPass base_pass(const DiagArgs& a, const Tensor& k);

}  // namespace fla::ops
