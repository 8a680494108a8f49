// Chunked GLA and RWKV6 (docs/algorithms.md §4-§5). The forward is one chunk pass (state pass, pair
// matrices, then the per-chunk outputs); the backward runs the reverse state pass for dHst, then
// the per-chunk gradients. The CUDA engine builds each chunk's pair matrix once into a workspace
// (amat, fp32 [slots, H, 64, 64]) that its out kernels read. Under autograd on CUDA a key-side
// forward keeps its chunk-start states (hst) and pair matrices for the backward (fp32,
// [slots, H, K, V] + [slots, H, 64, 64]: for bf16 K=V=64 about 2x the bytes of q, k, v and g
// together), a value-side forward its states alone; otherwise the backward recomputes them.
// Backends: cpu/chunk.cpp (float64 exponents, the algebra as written) and kernels/chunk*.cu.
#include "chunk.h"

#include "rwkv6.h"

#include <torch/library.h>
#include <cstdlib>

namespace fla::ops {
namespace {

ChunkPass chunk_pass(const DiagArgs& a, Reader reader, const Tensor& q, const Tensor& k,
                     const Tensor& v, const Tensor& g, const Tensor& gv, const Tensor& uc,
                     const std::optional<Tensor>& h0) {
  ChunkPass p;
  p.dtype = kernel_dtype(k);  // q is the kernels' q here (kernel_input)
  p.N = int(a.N), p.H = int(a.H), p.T = int(a.T), p.K = int(a.K), p.V = int(a.V);
  p.cu_seqlens = a.cu.defined() ? a.cu.data_ptr<int64_t>() : nullptr;
  p.reader = reader;
  p.scale = a.scale;
  p.q = a.L.vec(q), p.k = a.L.vec(k), p.v = a.L.vec(v);
  if (g.defined()) p.g = a.L.vec(g);
  if (gv.defined()) p.gv = a.L.vec(gv);
  if (uc.defined()) p.u = uc.data_ptr(), p.udtype = kernel_dtype(uc);
  if (has(h0)) p.h0 = mat(*h0);
  return p;
}

int64_t workspace_slots(const DiagArgs& a) { return chunk_slots(int(a.N), int(a.T), a.cu.defined()); }

// [slots, H, K, V] acc, or (not `needed`) empty.
std::vector<int64_t> state_sizes(const DiagArgs& a, bool needed = true) {
  return {needed ? workspace_slots(a) : 0, a.H, a.K, a.V};
}
Tensor state_workspace(const DiagArgs& a, const Tensor& q, bool needed = true) {
  return new_output(state_sizes(a, needed), q.options().dtype(acc_type(q)));
}

// With the value-side decay alone, the CUDA engine runs the transposed problem (kernels/chunk.h):
// its per-chunk decays and zeta partials then run over V, with K as the column dimension.
bool value_side_only(const Tensor& g, const Tensor& gv) { return gv.defined() && !g.defined(); }

// gv: a value-side log decay [B, T, H, V] like v (GLA only). CUDA runs g or gv, not both yet.
void check_gv(const DiagArgs& a, const Tensor& q, const Tensor& v, const Tensor& g,
              const Tensor& gv) {
  if (!gv.defined()) return;
  check_same_shape(gv, "gv", v, "v", a.L);
  TORCH_CHECK_VALUE(!(g.defined() && q.is_cuda()),
                    "fla_ext: chunk_gla on CUDA takes a key-side decay `g` or a value-side decay "
                    "`gv`, not both together (the CPU backend takes both)");
  if (value_checks_enabled()) check_log_decay(gv, "gv");
}

std::vector<int64_t> pair_sizes(const DiagArgs& a) { return {workspace_slots(a), a.H, kChunk, kChunk}; }
Tensor pair_workspace(const DiagArgs& a, const Tensor& hst) {
  return new_output(pair_sizes(a), hst.options());
}

// The CUDA engine's pair matrices: its out kernels read A from here (ops never look inside).
Tensor pair_workspace_for(const DiagArgs& a, const Tensor& q, const Tensor& hst, bool needed) {
  return q.is_cuda() && needed ? pair_workspace(a, hst) : new_output({0}, hst.options());
}

// The chunks of a window where the CUDA state kernel walks in windows of the chunk index
// (kernels/chunk.h chunk_window_chunks: the walks few and the sequences long), else 0: the
// forward's, the same again where the backward makes its states, and the backward's reverse walk
// (docs/design.md §5.2). FLA_EXT_CHUNK_WINDOWS=0 turns them off.
int state_window_chunks(const DiagArgs& a, const Tensor& q) {
  const char* on = std::getenv("FLA_EXT_CHUNK_WINDOWS");
  if (!q.is_cuda() || (on && on[0] == '0')) return 0;
  return chunk_window_chunks(int(a.N), int(a.H), int(a.V), int(a.T), a.cu.defined());
}

// What windows of `chunks` chunks hand on (their flags and the states at their starts); it lives
// until the pass ran.
struct WindowBuffers {
  Tensor flags, states;
};
WindowBuffers window_buffers(const DiagArgs& a, const Tensor& q, int chunks, ChunkPass& p) {
  if (chunks <= 0) return {};
  const int N = int(a.N), H = int(a.H), K = int(a.K), V = int(a.V), T = int(a.T);
  WindowBuffers w{at::empty({chunk_window_flags(N, H, K, V, T, chunks)}, q.options().dtype(at::kInt)),
                  at::empty({chunk_window_states(N, H, K, V, T, chunks)}, q.options().dtype(at::kFloat))};
  p.window_chunks = chunks;
  p.window_flags = w.flags.data_ptr<int>(), p.window_states = w.states.data_ptr<float>();
  return w;
}

}  // namespace

bool keeps_workspaces(const Tensor& q) { return q.is_cuda(); }

std::tuple<Tensor, Tensor, Tensor, Tensor> chunk_forward(
    const DiagArgs& a, Reader reader, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& g, const Tensor& gv, const Tensor& uc, const std::optional<Tensor>& h0,
    bool output_final_state, bool keep, ChunkRunner run, bool o_acc, bool o_softmax,
    const Tensor& o_softmax_acc) {
  const bool vside = value_side_only(g, gv);
  TORCH_INTERNAL_ASSERT(!(o_softmax && o_acc) && (o_softmax || !o_softmax_acc.defined()));
  Tensor o = a.L.empty_like_with_dim(v, a.V, o_acc ? acc_type(q) : q.scalar_type());
  Tensor hT = new_output({output_final_state ? a.N : 0, a.H, a.K, a.V},
                         q.options().dtype(acc_type(q)));
  // The CUDA key-side forward at K <= 128 forms o inside its state kernel (kernels/chunk.h): it
  // needs the chunk-start states only when they are kept for the backward.
  const bool fused = q.is_cuda() && !vside && chunk_fused_out(int(a.K));
  Tensor hst = state_workspace(a, q, !fused || keep);
  // The value-side forward runs no out kernel (kernels/chunk_vdecay.cuh): no A.
  Tensor amat = pair_workspace_for(a, q, hst, !vside);
  const Tensor qk = kernel_input(a, q, k);
  ChunkPass p = chunk_pass(a, reader, qk, k, v, g, gv, uc, h0);
  p.o = a.L.vec(o), p.o_acc = o_acc, p.o_softmax = o_softmax;
  if (o_softmax_acc.defined()) p.o_softmax_acc = a.L.vec(o_softmax_acc);
  if (output_final_state) p.hT = mat(hT);
  if (hst.numel()) p.hst = hst.data_ptr();
  if (amat.numel()) p.amat = amat.data_ptr();
  const WindowBuffers windows = window_buffers(a, q, state_window_chunks(a, q), p);
  run(p);
  auto none = [&] { return new_output({0}, hst.options()); };  // distinct: outputs must not alias
  return {o, hT, keep ? hst : none(), keep ? amat : none()};
}

ChunkGrads chunk_backward(const DiagArgs& a, Reader reader, const Tensor& q, const Tensor& k,
                          const Tensor& v, const Tensor& g, const Tensor& gv, const Tensor& uc,
                          const Tensor& grad_o, const std::optional<Tensor>& dht,
                          const std::optional<Tensor>& h0, const std::optional<Tensor>& hst_in,
                          const std::optional<Tensor>& amat_in, const char* qn,
                          ChunkRunner run, bool dq_acc, const Tensor& dv_into,
                          const Tensor& dgv_into, const Tensor& dq_softmax_w) {
  check_incoming_grads(a, grad_o, dht, q, qn, v);
  const auto acc = q.options().dtype(acc_type(q));
  const bool vside = value_side_only(g, gv);
  ChunkGrads r;  // a wide q's grad_o (float32 like its o) is rounded to k's dtype below
  r.dq = new_output(q.sizes(), dq_acc ? q.options().dtype(acc_type(q)) : q.options());
  r.dk = new_output(k.sizes(), k.options());
  auto into = [](const Tensor& t, const Tensor& like) {
    TORCH_INTERNAL_ASSERT(t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type() &&
                          t.device() == like.device() && t.is_contiguous());
    return t;
  };
  const bool dv_adds = dv_into.defined(), dgv_adds = gv.defined() && dgv_into.defined();
  r.dv = dv_adds ? into(dv_into, v) : new_output(v.sizes(), v.options());
  // No decay on a side: a 0-element gradient (the autograd Function returns None for it).
  r.dg = g.defined() ? new_output(g.sizes(), g.options()) : new_output({0}, q.options());
  r.dgv = dgv_adds ? into(dgv_into, gv)
          : gv.defined() ? new_output(gv.sizes(), gv.options()) : new_output({0}, q.options());
  r.dh0 = new_output({has(h0) ? a.N : 0, a.H, a.K, a.V}, acc);
  // A key-side pass keeps hst and amat together, a value-side pass hst alone (its amat is of dO).
  const Tensor* hst_kept = kept_workspace(hst_in, state_sizes(a), acc, "hst");
  if (vside && has(amat_in)) check_device(*amat_in, "amat", q.device());  // unused, same device
  const Tensor* amat_kept = vside ? nullptr : kept_workspace(amat_in, pair_sizes(a), acc, "amat");
  TORCH_CHECK_VALUE(vside || (hst_kept == nullptr) == (amat_kept == nullptr),
                    "fla_ext: `hst` and `amat` come together from the _train op: pass both or neither");
  Tensor hst = hst_kept ? *hst_kept : state_workspace(a, q), dhst = state_workspace(a, q);
  const int64_t cols = vside ? a.K : a.V, rows = vside ? a.V : a.K;  // of the (transposed) state
  Tensor zeta = new_output({hst.size(0), a.H, (cols + kStateCols - 1) / kStateCols, rows}, acc);
  // Gap slots (varlen) and final-state slots hold no chunk: their du partials must read 0.
  Tensor du_part = uc.defined() ? at::zeros({hst.size(0), a.H, a.K}, acc) : Tensor();

  const Tensor qk = kernel_input(a, q, k), go = kernel_input(a, grad_o, k);
  ChunkPass p = chunk_pass(a, reader, qk, k, v, g, gv, uc, h0);
  p.dout = a.L.vec(go), p.dq_acc = dq_acc;
  if (has(dht)) p.dht = mat(*dht);
  p.dq = a.L.vec(r.dq), p.dk = a.L.vec(r.dk), p.dv = a.L.vec(r.dv);
  if (g.defined()) p.dg = a.L.vec(r.dg);
  if (gv.defined()) p.dgv = a.L.vec(r.dgv);
  p.dv_adds = dv_adds, p.dgv_adds = dgv_adds;
  if (dq_softmax_w.defined()) {
    TORCH_INTERNAL_ASSERT(!dq_acc && dq_softmax_w.sizes() == q.sizes() &&
                          dq_softmax_w.scalar_type() == acc_type(q));
    p.dq_softmax_w = a.L.vec(dq_softmax_w);
  }
  if (has(h0)) p.dh0 = mat(r.dh0);
  if (du_part.defined()) p.du = du_part.data_ptr();
  p.hst = hst.data_ptr(), p.dhst = dhst.data_ptr(), p.zeta = zeta.data_ptr();
  p.hst_kept = hst_kept != nullptr;
  p.amat_kept = amat_kept != nullptr;
  Tensor amat = amat_kept ? *amat_kept : pair_workspace_for(a, q, hst, true);
  if (amat.numel()) p.amat = amat.data_ptr();
  const WindowBuffers windows = window_buffers(a, q, state_window_chunks(a, q), p);  // (the launch zeroes the flags)
  if (a.T > 0) {
    run(p);
  } else if (has(h0)) {
    // No rows: every activation pointer is null, so the pass would read as a forward (dout
    // off). Every sequence is empty: the state gradient passes through and du stays 0.
    has(dht) ? r.dh0.copy_(*dht) : r.dh0.zero_();
  }
  if (du_part.defined()) r.du = du_part.sum(0);
  return r;
}

namespace {
std::tuple<Tensor, Tensor, Tensor, Tensor> gla_forward(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& g_,
    const std::optional<Tensor>& gv_, std::optional<double> scale,
    const std::optional<Tensor>& initial_state, bool output_final_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first, bool train, ChunkRunner run) {
  c10::OptionalDeviceGuard guard(device_of(q, "q"));
  const Tensor g = opt(g_), gv = opt(gv_);
  const auto a =
      check_diag(q, "q", k, v, g, "g", scale, initial_state, cu_seqlens, head_first, true);
  check_gv(a, q, v, g, gv);
  return chunk_forward(a, Reader::Inclusive, q, k, v, g, gv, Tensor(), initial_state,
                       output_final_state, train && keeps_workspaces(q), run, a.wide_q);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> rwkv6_forward(
    const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& u,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, const std::optional<Tensor>& cu_seqlens, bool head_first,
    bool train, ChunkRunner run) {
  c10::OptionalDeviceGuard guard(device_of(r, "r"));
  const auto a = check_rwkv6(r, k, v, w, u, scale, initial_state, cu_seqlens, head_first);
  return chunk_forward(a, Reader::Exclusive, r, k, v, w, Tensor(), a.uc, initial_state,
                       output_final_state, train && keeps_workspaces(r), run, false);
}
}  // namespace

std::tuple<Tensor, Tensor> chunk_gla_fwd(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& g,
    const std::optional<Tensor>& gv, std::optional<double> scale,
    const std::optional<Tensor>& initial_state, bool output_final_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first, ChunkRunner run) {
  auto [o, hT, hst, amat] = gla_forward(q, k, v, g, gv, scale, initial_state, output_final_state,
                                        cu_seqlens, head_first, false, run);
  return {o, hT};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> chunk_gla_train(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& g,
    const std::optional<Tensor>& gv, std::optional<double> scale,
    const std::optional<Tensor>& initial_state, bool output_final_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first, ChunkRunner run) {
  return gla_forward(q, k, v, g, gv, scale, initial_state, output_final_state, cu_seqlens,
                     head_first, true, run);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_gla_bwd(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& g_,
    const std::optional<Tensor>& gv_, const Tensor& grad_o,
    const std::optional<Tensor>& grad_final_state, std::optional<double> scale,
    const std::optional<Tensor>& initial_state, const std::optional<Tensor>& cu_seqlens,
    bool head_first, const std::optional<Tensor>& hst, const std::optional<Tensor>& amat,
    ChunkRunner run) {
  c10::OptionalDeviceGuard guard(device_of(q, "q"));
  const Tensor g = opt(g_), gv = opt(gv_);
  const auto a =
      check_diag(q, "q", k, v, g, "g", scale, initial_state, cu_seqlens, head_first, true);
  check_gv(a, q, v, g, gv);
  auto r = chunk_backward(a, Reader::Inclusive, q, k, v, g, gv, Tensor(), grad_o,
                          grad_final_state, initial_state, hst, amat, "q", run, a.wide_q);
  return {r.dq, r.dk, r.dv, r.dg, r.dgv, r.dh0};
}

std::tuple<Tensor, Tensor> chunk_rwkv6_fwd(
    const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& u,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, const std::optional<Tensor>& cu_seqlens, bool head_first,
    ChunkRunner run) {
  auto [o, hT, hst, amat] = rwkv6_forward(r, k, v, w, u, scale, initial_state,
                                          output_final_state, cu_seqlens, head_first, false, run);
  return {o, hT};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> chunk_rwkv6_train(
    const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& u,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, const std::optional<Tensor>& cu_seqlens, bool head_first,
    ChunkRunner run) {
  return rwkv6_forward(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens,
                       head_first, true, run);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_rwkv6_bwd(
    const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& u,
    const Tensor& grad_o, const std::optional<Tensor>& grad_final_state,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first, const std::optional<Tensor>& hst,
    const std::optional<Tensor>& amat, ChunkRunner run) {
  c10::OptionalDeviceGuard guard(device_of(r, "r"));
  const auto a = check_rwkv6(r, k, v, w, u, scale, initial_state, cu_seqlens, head_first);
  auto g = chunk_backward(a, Reader::Exclusive, r, k, v, w, Tensor(), a.uc, grad_o,
                          grad_final_state, initial_state, hst, amat, "r", run, false);
  return {g.dq, g.dk, g.dv, g.dg, g.du.to(u.scalar_type()), g.dh0};
}

}  // namespace fla::ops
