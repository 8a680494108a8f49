#include "common.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>

namespace fla::ops {

namespace {
thread_local int value_checks_done_depth = 0;

// A boolean environment variable: `unset` when empty or absent.
bool parse_flag(const char* name, bool unset) {
  const char* raw = std::getenv(name);
  std::string v = raw ? raw : "";
  for (auto& c : v) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (v.empty()) return unset;
  if (v == "0" || v == "false" || v == "off" || v == "no") return false;
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  TORCH_CHECK_VALUE(false, "fla_ext: ", name, " must be one of 0/1/true/false/on/off/yes/no, got '", raw, "'");
}
}  // namespace

bool value_checks_enabled() {
  if (value_checks_done_depth > 0) return false;
  return parse_flag("FLA_EXT_CHECKS", false);
}

bool keeps_workspaces() { return parse_flag("FLA_EXT_KEEP_WORKSPACES", true); }

int64_t workspace_budget_mib() {
  const char* v = std::getenv("FLA_EXT_WORKSPACE_MIB");
  if (!v || !*v) return -1;
  char* end = nullptr;
  errno = 0;
  const long long mib = std::strtoll(v, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && errno == 0 && mib >= 0 && mib < (int64_t(1) << 40),
                    "fla_ext: FLA_EXT_WORKSPACE_MIB must be a non-negative integer (MiB), got '", v, "'");
  return mib;
}

ValueChecksDone::ValueChecksDone() { ++value_checks_done_depth; }
ValueChecksDone::~ValueChecksDone() { --value_checks_done_depth; }

Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  static const bool poison = [] {
    const char* v = std::getenv("FLA_EXT_POISON");
    return v && v[0] == '1';
  }();
  Tensor t = at::empty(sizes, opts);
  if (poison) t.fill_(std::numeric_limits<double>::quiet_NaN());
  return t;
}

std::string shape_str(const Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

MatArg mat(const Tensor& t, bool transpose) {
  MatArg m;
  m.ptr = t.data_ptr();
  m.sn = t.stride(0);
  m.sh = t.stride(1);
  m.sr = t.stride(transpose ? 3 : 2);
  m.sc = t.stride(transpose ? 2 : 3);
  return m;
}

DType kernel_dtype(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    case at::kDouble: return DType::f64;
    default: TORCH_CHECK_VALUE(false, "fla_ext: unsupported dtype ", t.scalar_type());
  }
}

at::ScalarType acc_type(const Tensor& activation) {
  return activation.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

c10::OperatorHandle fla_op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(("fla::" + name).c_str(), "");
}

void check_device(const Tensor& t, const char* name, c10::Device device) {
  TORCH_CHECK(t.device() == device, "fla_ext: `", name, "` is on ", t.device(),
              " but the inputs are on ", device);
}

void check_defined(std::initializer_list<std::pair<const Tensor&, const char*>> required) {
  for (const auto& [t, name] : required)
    TORCH_CHECK_VALUE(t.defined(), "fla_ext: `", name, "` must be a tensor, got None");
}

c10::Device device_of(const Tensor& t, const char* name) {
  check_defined({{t, name}});
  return t.device();
}

void check_activation(const Tensor& t, const char* name, const Tensor& ref, const char* ref_name) {
  check_defined({{t, name}});
  TORCH_CHECK_VALUE(t.dim() == 4, "fla_ext: `", name, "` must be 4-D, got shape ", shape_str(t));
  const auto dt = t.scalar_type();
  const bool ok = dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf ||
                  (dt == at::kDouble && t.device().is_cpu());
  TORCH_CHECK_VALUE(ok, "fla_ext: `", name, "` must be float32, bfloat16 or float16",
                    " (float64 on CPU), got ", dt, " on ", t.device());
  TORCH_CHECK(t.device() == ref.device(), "fla_ext: `", name, "` is on ", t.device(), " but `",
              ref_name, "` is on ", ref.device());
  TORCH_CHECK_VALUE(dt == ref.scalar_type(), "fla_ext: `", name, "` has dtype ", dt, " but `",
                    ref_name, "` has dtype ", ref.scalar_type(), "; all activations must match");
}

Tensor check_cu_seqlens(const std::optional<Tensor>& cu, const Tensor& ref, int64_t B, int64_t T) {
  if (!cu.has_value() || !cu->defined()) return Tensor();
  const Tensor& c = *cu;
  TORCH_CHECK_VALUE(c.scalar_type() == at::kLong || c.scalar_type() == at::kInt,
                    "fla_ext: `cu_seqlens` must be int64 (or int32), got ", c.scalar_type());
  TORCH_CHECK_VALUE(c.dim() == 1 && c.size(0) >= 2,
                    "fla_ext: `cu_seqlens` must be 1-D with at least 2 entries, got shape ",
                    shape_str(c));
  check_device(c, "cu_seqlens", ref.device());
  TORCH_CHECK_VALUE(B == 1, "fla_ext: with `cu_seqlens` the batch size must be 1, got B = ", B);
  TORCH_CHECK_VALUE(c.size(0) - 1 <= std::numeric_limits<int>::max(),
                    "fla_ext: `cu_seqlens` has too many sequences (", c.size(0) - 1, ")");
  Tensor c64 = c.to(at::kLong).contiguous();
  // On the host the values cost nothing to check; on a GPU only when asked (a synchronisation).
  // Unchecked device boundaries are clamped into [0, T] by the kernels (kernels/sequence.h).
  // A fake tensor (torch.compile's tracing, FakeTensorMode) has no values to read.
  const bool fake = c.key_set().has(c10::DispatchKey::Python);
  if (!fake && (c64.is_cpu() || value_checks_enabled())) check_cu_values(c64, T);
  return c64;
}

void check_state(const Tensor& s, const char* name, const Tensor& ref, int64_t N, int64_t H,
                 int64_t R, int64_t C, const char* dims) {
  check_device(s, name, ref.device());
  TORCH_CHECK_VALUE(s.scalar_type() == acc_type(ref), "fla_ext: `", name, "` must be ",
                    acc_type(ref), " (states are float32; float64 for float64 inputs), got ",
                    s.scalar_type());
  TORCH_CHECK_VALUE(s.dim() == 4 && s.size(0) == N && s.size(1) == H && s.size(2) == R &&
                        s.size(3) == C,
                    "fla_ext: `", name, "` must have shape ", dims, " = [", N, ", ", H, ", ", R,
                    ", ", C, "], got ", shape_str(s));
}

void check_same_shape(const Tensor& t, const char* name, const Tensor& ref, const char* ref_name,
                      const Layout& L) {
  check_activation(t, name, ref, ref_name);
  TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), "fla_ext: `", name, "` must have the shape of `",
                    ref_name, "` ", shape_str(ref), " (", L.dims(), "), got ", shape_str(t));
}

void check_head_dim(int64_t d, const char* what) {
  TORCH_CHECK_VALUE(d >= 1 && d <= kMaxHeadDim, "fla_ext: ", what, " must be in [1, ",
                    kMaxHeadDim, "], got ", d);
}

namespace {
std::string first_index(const Tensor& mask) {
  const auto idx = mask.nonzero()[0].cpu();
  std::ostringstream os;
  os << "(";
  for (int64_t i = 0; i < idx.numel(); ++i) os << (i ? ", " : "") << idx[i].item<int64_t>();
  os << ")";
  return os.str();
}
}  // namespace

void check_finite(const Tensor& t, const char* name) {
  const auto bad = t.isfinite().logical_not();
  TORCH_CHECK_VALUE(!bad.any().item<bool>(), "fla_ext: `", name,
                    "` has a non-finite value at index ", first_index(bad), " (FLA_EXT_CHECKS)");
}

void check_log_decay(const Tensor& w, const char* name) {
  const auto nan = w.isnan();
  TORCH_CHECK_VALUE(!nan.any().item<bool>(), "fla_ext: `", name, "` has a NaN at index ",
                    first_index(nan), " (FLA_EXT_CHECKS)");
  const auto pos = w > 0;
  TORCH_CHECK_VALUE(!pos.any().item<bool>(), "fla_ext: `", name,
                    "` is a log decay and must be <= 0, but is positive at index ",
                    first_index(pos), " (FLA_EXT_CHECKS; a linear-space decay must go through log)");
}

void check_cu_values(const Tensor& cu, int64_t T) {
  const auto c = cu.cpu();
  const int64_t* p = c.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(p[0] == 0, "fla_ext: `cu_seqlens[0]` must be 0, got ", p[0]);
  for (int64_t i = 1; i < c.size(0); ++i)
    TORCH_CHECK_VALUE(p[i] >= p[i - 1], "fla_ext: `cu_seqlens` must be non-decreasing, but ",
                      "cu_seqlens[", i, "] = ", p[i], " < cu_seqlens[", i - 1, "] = ", p[i - 1]);
  TORCH_CHECK_VALUE(p[c.size(0) - 1] == T, "fla_ext: `cu_seqlens[-1]` must equal the number of ",
                    "rows T = ", T, ", got ", p[c.size(0) - 1]);
}

}  // namespace fla::ops

namespace fla::ops {

DiagArgs check_diag(const Tensor& q, const char* qn, const Tensor& k, const Tensor& v,
                    const Tensor& g, const char* gn, std::optional<double> scale,
                    const std::optional<Tensor>& h0, const std::optional<Tensor>& cu_seqlens,
                    bool head_first, bool wide_q_ok) {
  DiagArgs a{Layout{head_first}};
  const Layout& L = a.L;
  check_activation(q, qn, q, qn);
  a.wide_q = wide_q_ok && k.defined() && q.scalar_type() == at::kFloat &&
             (k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kHalf);
  const Tensor& ref = a.wide_q ? k : q;  // the dtype every other activation has
  const char* refn = a.wide_q ? "k" : qn;
  check_activation(k, "k", ref, refn);
  TORCH_CHECK(k.device() == q.device(), "fla_ext: `k` is on ", k.device(), " but `", qn,
              "` is on ", q.device());
  check_activation(v, "v", ref, refn);
  if (g.defined()) check_activation(g, gn, ref, refn);
  a.B = L.B(q), a.T = L.T(q), a.H = L.H(q), a.K = L.D(q), a.V = L.D(v);
  for (auto [t, name] : {std::pair<const Tensor&, const char*>{k, "k"}, {g, gn}})
    TORCH_CHECK_VALUE(!t.defined() || t.sizes() == q.sizes(), "fla_ext: `", name,
                      "` must have the shape of `", qn, "` ", shape_str(q), " (", L.dims(),
                      "), got ", shape_str(t));
  TORCH_CHECK_VALUE(L.B(v) == a.B && L.T(v) == a.T && L.H(v) == a.H, "fla_ext: `v` must be ",
                    L.dims(), " with B, T, H of `", qn, "` ", shape_str(q), ", got ",
                    shape_str(v));
  const std::string kname = std::string("K (last dim of ") + qn + ", k" +
                            (g.defined() ? std::string(", ") + gn : std::string()) + ")";
  check_head_dim(a.K, kname.c_str());
  check_head_dim(a.V, "V (last dim of v)");
  a.cu = check_cu_seqlens(cu_seqlens, q, a.B, a.T);
  a.N = a.cu.defined() ? a.cu.size(0) - 1 : a.B;
  if (has(h0)) check_state(*h0, "initial_state", q, a.N, a.H, a.K, a.V);
  a.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(double(a.K));
  TORCH_CHECK_VALUE(std::isfinite(a.scale), "fla_ext: `scale` must be finite, got ", a.scale);
  if (value_checks_enabled()) {
    check_finite(q, qn), check_finite(k, "k"), check_finite(v, "v");
    if (g.defined()) check_log_decay(g, gn);
    if (has(h0)) check_finite(*h0, "initial_state");
  }
  return a;
}

void check_incoming_grads(const DiagArgs& a, const Tensor& grad_o,
                          const std::optional<Tensor>& grad_final_state, const Tensor& ref,
                          const char* ref_name, const Tensor& v) {
  check_activation(grad_o, "grad_o", ref, ref_name);
  TORCH_CHECK_VALUE(grad_o.sizes() == v.sizes(), "fla_ext: `grad_o` must have the shape of `v` ",
                    shape_str(v), ", got ", shape_str(grad_o));
  if (has(grad_final_state))
    check_state(*grad_final_state, "grad_final_state", ref, a.N, a.H, a.K, a.V);
}

Tensor kernel_input(const DiagArgs& a, const Tensor& x, const Tensor& k) {
  return a.wide_q ? x.to(k.scalar_type()) : x;
}

RecurrentPass base_pass(const DiagArgs& a, const Tensor& k) {
  RecurrentPass p;
  p.dtype = kernel_dtype(k);
  p.N = int(a.N), p.H = int(a.H), p.T = int(a.T);
  p.cu_seqlens = a.cu.defined() ? a.cu.data_ptr<int64_t>() : nullptr;
  return p;
}

const Tensor* kept_workspace(const std::optional<Tensor>& t, at::IntArrayRef sizes,
                             const at::TensorOptions& opts, const char* name) {
  if (!has(t)) return nullptr;
  // Even an empty one: a tensor on another device would send the call to that device's kernels.
  check_device(*t, name, opts.device());
  if (t->numel() == 0) return nullptr;
  const auto dtype = c10::typeMetaToScalarType(opts.dtype());
  TORCH_CHECK_VALUE(t->sizes() == sizes && t->scalar_type() == dtype && t->is_contiguous(),
                    "fla_ext: `", name, "` must be the ", dtype, " workspace ", sizes, " on ",
                    opts.device(), " returned by the _train op, got ", t->scalar_type(), " ",
                    shape_str(*t), " on ", t->device());
  return &*t;
}

}  // namespace fla::ops
