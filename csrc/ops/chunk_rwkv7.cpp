// Chunked RWKV7 (docs/algorithms.md §6, WY/UT form): the same map as fused_recurrent_rwkv7 computed
// chunk-parallel by the engine of kernels/dplr_chunk.h. A recording forward on CUDA
// (chunk_rwkv7_train) keeps the chunk-start states and its per-chunk workspace for the backward
// (`saved`), as chunk_gla / chunk_rwkv6 keep theirs; otherwise the backward recomputes them. This
// file checks the arguments (the rwkv7 checks), lays out the workspaces and adds the
// per-column-tile partial gradients.
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <array>
#include <vector>

#include "rwkv7.h"

namespace fla::ops {
namespace {

// Chunk slots of the workspaces (kernels/chunk.h chunk_slots, 16-row chunks).
int64_t dplr_chunk_slots(const DiagArgs& d) {
  return chunk_slots<kDplrChunk>(int(d.N), int(d.T), d.cu.defined());
}

// The CUDA engine's per-chunk workspaces, fp32 (DplrWorkspaceLayout: ws, and uo for the forward sweeps),
// and the chunk-start states [slots, H, K, V] (acc type; the slot after a sequence's last chunk:
// its final state), in floats.
int64_t dplr_ws_floats(const DiagArgs& d) {
  return dplr_chunk_slots(d) * d.H * DplrWorkspaceLayout(int(d.K), int(d.V)).floats_per_chunk();
}
int64_t dplr_uo_floats(const DiagArgs& d) {
  return dplr_chunk_slots(d) * d.H * DplrWorkspaceLayout(int(d.K), int(d.V)).uo_floats_per_chunk();
}
std::vector<int64_t> dplr_state_sizes(const DiagArgs& d) {
  return {dplr_chunk_slots(d), d.H, d.K, d.V};
}
int64_t dplr_state_floats(const DiagArgs& d) { return dplr_chunk_slots(d) * d.H * d.K * d.V; }
// Whether a CUDA forward runs the fused kernel (no workspace; a training forward's stores the
// chunk-start states) where kernels/dplr_chunk.h dplr_fused_forward allows it and it is the faster
// one. That takes enough (sequence, head) pairs, a CTA each: fewer leave SMs idle for its
// sequential walk, where the two-kernel forward spreads every chunk over the GPU. An inference
// forward takes it from kFusedMinTasks pairs (on an H200's 132 SMs the faster one at 128 pairs
// and the slower at 32: benchmarks/NOTES.md c25). A training forward (`keeps`) takes it from
// kFusedTrainingMinTasks: its backward then runs the single pass (or the fused reverse pass),
// making the pair matrices and X again where the two-kernel forward kept them, and both fused
// walks are latency-bound at few pairs. At 128 pairs the fused fwd + bwd is still the slower
// one, though its forward (there the two-block build storing the strided states) is the faster
// and keeps only the strided states (NOTES c38); there the launch may run the two-kernel
// forward's work as one fused kernel that keeps the same states and workspace
// (DplrChunkPass::fused_may_keep; NOTES c33). FLA_EXT_RWKV7_FUSED=0 / 1 overrides the choice (benchmarks compare the two; 0 also
// keeps the launch to the two kernels; 1 is the lean choice for training at few pairs).
constexpr int64_t kFusedMinTasks = 128, kFusedTrainingMinTasks = 256;
// FLA_EXT_RWKV7_FUSED: 1 or 0 (forced on or off), else -1.
int fused_override() {
  const char* force = std::getenv("FLA_EXT_RWKV7_FUSED");
  return force && *force ? force[0] == '1' : -1;
}
bool fused_forward(const DiagArgs& d, const Tensor& r, bool keeps) {
  if (!r.is_cuda() || !dplr_fused_forward(kernel_dtype(r), int(d.K), int(d.V))) return false;
  if (fused_override() >= 0) return fused_override() == 1;
  return d.N * d.H >= (keeps ? kFusedTrainingMinTasks : kFusedMinTasks);
}

// FLA_EXT_RWKV7_SINGLE_PASS: 0 / 1 force the single-pass backward off / on where it can run.
int single_pass_override() {
  const char* force = std::getenv("FLA_EXT_RWKV7_SINGLE_PASS");
  return force && *force ? force[0] == '1' : -1;
}

// Chunks of a sequence without cu_seqlens.
int64_t sequence_chunks(const DiagArgs& d) { return (d.T + kDplrChunk - 1) / kDplrChunk; }

// ---- Windows of the chunk index on two streams (DplrChunkPass::window_chunks) ----
// The sequential kernels (the forward sweep, the reverse pass) have a CTA per (sequence, head[,
// tile]); where those are few, they leave most SMs idle for their whole walk. In windows of the
// chunk index the launch runs each window's sequential kernel on a second stream beside the next
// window's parallel one (prep, grad), which fills those SMs. That pays where the sequential
// CTAs are at most about one per two SMs (kPipelineMaxCtas, for the 132 SMs of an H100 / H200)
// and the sequences long: kPipelineWindows windows of at least kPipelineMinChunks chunks in the
// forward, kPipelineMinChunksBackward in the backward. Elsewhere the windows measured slower
// (benchmarks/NOTES.md c36). Windows hold whole strides of kept states (kDplrStateStride); no
// cu_seqlens (the windows give every sequence the same chunk indices).
// FLA_EXT_RWKV7_PIPELINE=0 turns them off (the backward then keeps the memory budget's windows
// alone, one after another); 1 takes them for any sequence longer than a window, however many
// CTAs (the tests).
constexpr int64_t kPipelineWindows = 8, kPipelineMaxCtas = 64, kPipelineMinChunks = 64,
                  kPipelineMinChunksBackward = 32;
int pipeline_override() {
  const char* force = std::getenv("FLA_EXT_RWKV7_PIPELINE");
  return force && *force ? force[0] == '1' : -1;
}
// The sequential kernel's CTAs: the sweeps' (32-column state tiles), or the fused reverse pass's.
int64_t sequential_ctas(const DiagArgs& d, bool fused_reverse) {
  return d.N * d.H * (fused_reverse ? 1 : (d.V + kDplrSweepCols - 1) / kDplrSweepCols);
}
// Chunks per window of a pipelined forward (backward: `fused_reverse`, the fused reverse pass's),
// 0 for none.
int64_t pipeline_window_chunks(const DiagArgs& d, bool backward = false, bool fused_reverse = false) {
  const int64_t nch = sequence_chunks(d), S = kDplrStateStride;
  const int force = pipeline_override();
  if (d.cu.defined() || force == 0) return 0;
  const int64_t chunks = ((nch + kPipelineWindows - 1) / kPipelineWindows + S - 1) / S * S;
  const bool pays = chunks >= (backward ? kPipelineMinChunksBackward : kPipelineMinChunks) &&
                    sequential_ctas(d, fused_reverse) <= kPipelineMaxCtas;
  return (force > 0 || pays) && chunks < nch ? chunks : 0;
}

// Whether a CUDA training forward on the two-kernel path keeps the strided states, made by its
// sweep (DplrChunkPass::sweep_strided_states), instead of every chunk-start state, on the shapes
// whose grad walks strides (dplr_strided_states): at K = V = 64 where it runs in pipelined windows
// (few pairs, long sequences, no cu_seqlens; elsewhere the fused forward keeps them), at K = V =
// 128 always, cu_seqlens or not (every state there is 64 KB a chunk and head: benchmarks/NOTES.md
// c42).
bool sweep_strided(const DiagArgs& d, const Tensor& r) {
  if (!r.is_cuda() || !dplr_strided_states(kernel_dtype(r), int(d.K), int(d.V))) return false;
  return d.K == 128 || (!fused_forward(d, r, true) && pipeline_window_chunks(d) > 0);
}
// Whether such a forward keeps prep's workspace too (DplrChunkPass::strided_ws_kept), so that
// its backward runs no prep: outside the pipelined windows (K = 128 there). In them it keeps the
// states alone and its backward makes the workspace again, a window at a time beside the reverse
// sweep, so that neither pass holds a T-sized workspace: the fwd + bwd peak of long-context
// training. Elsewhere keeping it is the faster choice: making it again costs the backward a
// whole prep pass (benchmarks/NOTES.md c42).
bool strided_keeps_ws(const DiagArgs& d, const Tensor& r) { return sweep_strided(d, r) && pipeline_window_chunks(d) == 0; }

// What a CUDA training forward keeps (`saved`, fp32, flat): the two-kernel forward, every
// chunk-start state, padded to a multiple of 4 floats (16-byte aligned workspace rows), then its
// workspace; the fused forward (and the two-kernel one where sweep_strided), the state before
// every kDplrStateStride-th chunk and the final one, padded (DplrKept::states: grad makes the
// states between), then the two-kernel forward's workspace where strided_keeps_ws, else nothing
// more (its backward's fused reverse pass, or prep and the reverse sweep, make the pair matrices
// and X).
int64_t kept_state_floats(const DiagArgs& d) {
  return dplr_kept_state_slots(int(d.N), int(d.T), d.cu.defined()) * d.H * d.K * d.V;
}
int64_t saved_states_floats(const DiagArgs& d, bool strided) {
  return ((strided ? kept_state_floats(d) : dplr_state_floats(d)) + 3) / 4 * 4;
}
bool keeps_strided(const DiagArgs& d, const Tensor& r) { return fused_forward(d, r, true) || sweep_strided(d, r); }
// Where the single-pass backward is to run (the fused training forward's shapes, K = V = 64,
// 16-bit; by default from the fused training forward's own threshold of pairs up, where it is
// the faster backward: benchmarks/NOTES.md c70), the fused training forward keeps every
// chunk-start state as fp16 instead (DplrKept::f16_states, DplrF16States). FLA_EXT_RWKV7_SINGLE_PASS=0 keeps the strided states and the two-kernel
// backward; 1 takes it wherever the fused training forward runs (forced at fewer pairs too).
bool keeps_f16_states(const DiagArgs& d, const Tensor& r) {
  if (!fused_forward(d, r, true) || d.K != 64 || d.V != 64) return false;
  const int force = single_pass_override();
  return force >= 0 ? force == 1 : d.N * d.H >= kFusedTrainingMinTasks;
}
int64_t f16_states_floats(const DiagArgs& d) {
  return DplrF16States::floats(int(d.N), int(d.T), d.cu.defined(), int(d.H));
}
int64_t saved_floats(const DiagArgs& d, const Tensor& r) {
  if (keeps_f16_states(d, r)) return f16_states_floats(d);
  if (!keeps_strided(d, r)) return saved_states_floats(d, false) + dplr_ws_floats(d);
  return saved_states_floats(d, true) + (strided_keeps_ws(d, r) ? dplr_ws_floats(d) : 0);
}
// Whether `saved` holds the strided states and prep's workspace after them (strided_keeps_ws's
// form), told by its length; every form saved_floats gives has a length of its own.
bool saved_strided_ws(const DiagArgs& d, const Tensor* saved) {
  return saved && saved->numel() == saved_states_floats(d, true) + dplr_ws_floats(d);
}
// What a training forward's `saved` holds, told by its length (saved_floats), the strided forms
// only on the shapes that have them (dplr_strided_states): at T = 0 every form is the final
// states alone, one length, and an fp32 pass read as strided states asked the launch for a path
// it does not have.
DplrKept saved_kind(const DiagArgs& d, const Tensor& r, const Tensor* saved) {
  if (!saved) return DplrKept::nothing;
  // (the fp16 states only where the settings now would keep them: with the single pass off their
  // length matches no form a backward reads, and kept_workspace refuses it)
  if (keeps_f16_states(d, r) && saved->numel() == f16_states_floats(d)) return DplrKept::f16_states;
  const bool strided = dplr_strided_states(kernel_dtype(r), int(d.K), int(d.V)) &&
                       (saved->numel() == saved_states_floats(d, true) || saved_strided_ws(d, saved));
  return strided ? DplrKept::states : DplrKept::states_and_workspace;
}
// Whether the two-kernel path runs on strided states (DplrChunkPass::sweep_strided_states): the
// forward of sweep_strided, and a backward on strided states where the fused forward would not
// run. Either backward reads either forward's states (the same slots); at K = 64 with cu_seqlens
// the fused reverse pass takes them (the two-kernel forward keeps strided states there only in
// pipelined windows, which take no cu_seqlens); K = 128 has no fused kernels.
bool two_kernel_strided(const DiagArgs& d, const Tensor& r, DplrKept kind) {
  return kind == DplrKept::states && !fused_forward(d, r, true) && (d.K == 128 || !d.cu.defined());
}
// Floats per (chunk slot, head) of the workspace a backward makes: the whole per-chunk block for
// grad and the reverse sweep (no kept states; strided states where prep runs, `lean`), or the
// pair matrices and X alone where the fused reverse pass makes them (DplrKept::states).
int64_t backward_ws_floats_per_chunk(const DiagArgs& d, DplrKept kept, bool lean) {
  return kept == DplrKept::states && !lean ? DplrWorkspaceLayout::kMatsFloats
                                           : DplrWorkspaceLayout(int(d.K), int(d.V)).floats_per_chunk();
}

// `ws` receives the CUDA engine's per-chunk workspace, unless `saved` holds it (for all chunk
// slots, or in a backward's windows `windows` times window_chunks per sequence), and `uo` its U0 /
// O0 workspace when a forward sweep runs (`sweep`: the forward; a backward without kept states;
// in a forward's windows `windows` times window_chunks per sequence); both kept alive by the
// caller until the pass has run (the CPU engine needs neither). A forward's windows keep ws's
// whole-pass slots.
DplrChunkPass chunk_pass(const DiagArgs& d, const Tensor& r, const Tensor& w, const Tensor& k,
                         const Tensor& v, const Tensor& a, const Tensor& b,
                         const std::optional<Tensor>& h0, Tensor& ws, Tensor& uo,
                         const Tensor* saved, bool sweep, int64_t window_chunks = 0, int windows = 1) {
  DplrChunkPass p;
  set_dplr_args(p, d, r, w, k, v, a, b, h0);
  if (!r.is_cuda()) return p;
  if (saved) p.hst = saved->data_ptr();
  p.fused = sweep && fused_forward(d, r, saved != nullptr);
  if (p.fused) {
    if (saved && keeps_f16_states(d, r)) p.kept = DplrKept::f16_states;  // (tells the kernel the form)
    return p;
  }
  // (a backward on the fused forward's states, DplrKept::states, runs the fused reverse pass:
  // kernels/dplr_chunk_fused_reverse.cuh, whose support is the fused forward's; on strided states
  // where the fused kernels do not run, the two-kernel path's, sweep_strided_states)
  const DplrKept kind = saved_kind(d, r, saved);
  if (kind == DplrKept::f16_states) {  // (the single pass: no workspace, no U0 / O0)
    p.kept = kind;
    return p;
  }
  p.sweep_strided_states = two_kernel_strided(d, r, kind);
  p.strided_ws_kept = p.sweep_strided_states && saved_strided_ws(d, saved);
  const bool remade = p.sweep_strided_states && !p.strided_ws_kept;  // (prep's workspace, not kept)
  // prep's workspace and U0 / O0 per window (two in turn), unless a training forward keeps the
  // workspace (kernels' dplr_ws_kept)
  const bool window_ws = window_chunks > 0 && (!sweep || !saved || remade);
  if (kind == DplrKept::states_and_workspace || p.strided_ws_kept) {
    p.ws = saved->data_ptr<float>() + saved_states_floats(d, kind == DplrKept::states);
  } else {
    const int64_t slots = window_ws ? d.N * window_chunks * windows : dplr_chunk_slots(d);
    ws = at::empty({slots * d.H * backward_ws_floats_per_chunk(d, sweep ? DplrKept::nothing : kind, p.sweep_strided_states)},
                   r.options().dtype(at::kFloat));
    p.ws = ws.data_ptr();
  }
  if (!sweep) p.kept = kind;
  p.fused_may_keep = fused_override() != 0;
  p.window_chunks = window_chunks, p.window_buffers = windows;
  if (sweep || !saved || remade) {  // (prep runs; windows: their own slots, `windows` in turn)
    const int64_t floats = window_chunks > 0
                               ? d.N * window_chunks * windows * d.H * DplrWorkspaceLayout(int(d.K), int(d.V)).uo_floats_per_chunk()
                               : dplr_uo_floats(d);
    uo = at::empty({floats}, r.options().dtype(at::kFloat));
    p.uo = uo.data_ptr();
  }
  return p;
}

// The chunk-start states (new_output: poisoned under FLA_EXT_POISON, so that a slot no pass
// writes shows), or [0] when not needed.
Tensor dplr_states(const DiagArgs& d, const Tensor& r, bool needed) {
  const auto acc = r.options().dtype(acc_type(r));
  return new_output(needed ? dplr_state_sizes(d) : std::vector<int64_t>{0}, acc);
}

// Workspace bytes of a forward over `slots` chunk slots.
int64_t forward_workspace_bytes(const DiagArgs& d, int64_t slots) {
  const DplrWorkspaceLayout L(int(d.K), int(d.V));
  return slots * d.H * (L.floats_per_chunk() + L.uo_floats_per_chunk()) * int64_t(sizeof(float));
}

// Chunks per pipelined window of an inference forward (CUDA), 0 for none: kPipelineMinChunks,
// as a training forward on strided states takes them, its two windows' workspace its whole
// extra memory beside o. A budget set by FLA_EXT_WORKSPACE_MIB bounds that workspace: shorter
// windows down to kPipelineMinChunksBackward, else none (the windows of the time axis then keep
// to the budget, one after another).
int64_t inference_window_chunks(const DiagArgs& d) {
  const int64_t window = std::min(pipeline_window_chunks(d), kPipelineMinChunks), mib = workspace_budget_mib();
  const int64_t per_window_chunk = forward_workspace_bytes(d, 2 * d.N);  // (0 without sequences or heads)
  if (window == 0 || mib < 0 || per_window_chunk == 0) return window;
  const int64_t fit = (mib << 20) / per_window_chunk / kDplrStateStride * kDplrStateStride;
  return fit >= std::min(window, kPipelineMinChunksBackward) ? std::min(window, fit) : 0;
}

// One forward of the engine over (r .. b) as `d` describes them: o, and hT when given, written.
// `saved` (a training forward's) also receives the chunk-start states and the workspace.
void forward_pass(const DiagArgs& d, const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v,
                  const Tensor& a, const Tensor& b, const std::optional<Tensor>& h0, const Tensor& o,
                  const Tensor* hT, Tensor* saved, DplrChunkRunner run) {
  Tensor ws, uo, carry;
  // (the fused kernels take no windows: chunk_pass leaves them off there; the launch takes uo's
  // two windows in turn)
  // A training forward keeping the strided states takes windows of kPipelineMinChunks: its two
  // windows' workspace is then its whole extra memory beside o and the kept states, and the
  // shortest windows that still pay (the trade of time for memory: benchmarks/NOTES.md c36).
  // An inference forward, those of inference_window_chunks.
  int64_t window = !r.is_cuda() ? 0 : saved ? pipeline_window_chunks(d) : inference_window_chunks(d);
  if (window > 0 && saved && sweep_strided(d, r)) window = std::min(window, kPipelineMinChunks);
  DplrChunkPass p = chunk_pass(d, r, w, k, v, a, b, h0, ws, uo, saved, true, window, 2);
  if (p.window_chunks > 0) {
    carry = at::empty({d.N, d.H, d.K, d.V}, r.options().dtype(at::kFloat));
    p.carry = mat(carry);
  }
  p.o = d.L.vec(o);
  if (hT) p.hT = mat(*hT);
  run(p);
}

// ---- The inference forward in windows of the time axis ----
// The CUDA workspaces grow with T (DplrWorkspaceLayout: ~16x an input's bytes at K = V = 64), so a
// forward that keeps nothing for a backward runs the engine over windows of the time axis
// whenever one pass would take more workspace than the budget, carrying each sequence's state
// from one window into the next as its initial state. The sequences' chunks restart at the same
// rows (cuts sit at multiples of kDplrChunk from a sequence's start), so the windows compute what
// one pass computes. The same windows run on every device (the CPU engine needs no workspace),
// so that the CPU tests cover them.

// FLA_EXT_WORKSPACE_MIB, else the larger of 64 MiB and 32 fp32 states per sequence: O(N H K V),
// and a window of several hundred rows at the usual sizes (few launches per forward).
int64_t forward_workspace_budget(const DiagArgs& d) {
  const int64_t mib = workspace_budget_mib();
  if (mib >= 0) return mib << 20;
  return std::max<int64_t>(int64_t(64) << 20, 32 * d.N * d.H * d.K * d.V * int64_t(sizeof(float)));
}

struct ForwardWindow {
  int64_t t0, t1;  // its rows of the time axis (of the packed axis with cu_seqlens)
  int64_t n0, n1;  // its sequences: those with rows in [t0, t1), and empty ones at those rows
  bool continues;  // sequence n0 began in an earlier window: it starts from the carried state
  bool carries;    // its last sequence (every sequence without cu_seqlens) goes on in the next one
};

struct ForwardWindows {
  std::vector<ForwardWindow> list;  // empty: one pass fits the budget
  Tensor cu_host;                   // cu_seqlens on the host (varlen windows)
};

// The windows of a forward. Reads cu_seqlens on the host (a device copy: a synchronisation, only
// for a forward that needs windows), and checks its values there.
ForwardWindows plan_forward_windows(const DiagArgs& d) {
  const bool varlen = d.cu.defined();
  const int64_t budget = forward_workspace_budget(d);
  if (forward_workspace_bytes(d, chunk_slots<kDplrChunk>(int(d.N), int(d.T), varlen)) <= budget) return {};
  const int64_t slots = std::max<int64_t>(1, budget / forward_workspace_bytes(d, 1));
  ForwardWindows plan;
  auto& out = plan.list;
  if (!varlen) {  // a window of c chunks takes N (c + 1) slots
    const int64_t rows = kDplrChunk * std::max<int64_t>(1, slots / d.N - 1);
    for (int64_t t0 = 0; t0 < d.T; t0 += rows) {
      const int64_t t1 = std::min(d.T, t0 + rows);
      out.push_back({t0, t1, 0, d.N, t0 > 0, t1 < d.T});
    }
    return plan;
  }
  // Varlen windows take rows / C + 2 (sequences) + 1 slots (chunk_slots): up to slots / 3 rows in
  // chunks and slots / 3 sequences each.
  plan.cu_host = d.cu.to(at::kCPU);
  check_cu_values(plan.cu_host, d.T);
  const int64_t* cu = plan.cu_host.data_ptr<int64_t>();
  const int64_t rows = kDplrChunk * std::max<int64_t>(1, slots / 3), max_seqs = std::max<int64_t>(1, slots / 3);
  int64_t t0 = 0, n = 0;
  while (n < d.N) {
    ForwardWindow win{t0, t0, n, n, cu[n] < t0, false};
    while (n < d.N && win.n1 - win.n0 < max_seqs) {
      const int64_t start = std::max(cu[n], t0), room = t0 + rows - start;
      if (cu[n + 1] - start <= room) {
        win.t1 = cu[n + 1], win.n1 = ++n;
        continue;
      }
      // Sequence n does not fit: cut it at its last chunk boundary in the room (past `start`
      // whenever it is the window's first sequence: room = rows >= C and t0 - cu[n] a multiple of C).
      const int64_t cut = cu[n] + (start + room - cu[n]) / kDplrChunk * kDplrChunk;
      if (cut > start) win.t1 = cut, win.n1 = n + 1, win.carries = true;
      break;
    }
    out.push_back(win);
    t0 = win.t1;
  }
  return plan;
}

void forward_in_windows(const DiagArgs& d, const ForwardWindows& windows, const Tensor& r,
                        const Tensor& w, const Tensor& k, const Tensor& v, const Tensor& a, const Tensor& b,
                        const std::optional<Tensor>& h0, const Tensor& o, const Tensor& hT,
                        bool output_final_state, DplrChunkRunner run) {
  const int64_t tdim = d.L.head_first ? 2 : 1;
  const bool varlen = d.cu.defined();
  const auto acc = r.options().dtype(acc_type(r));
  Tensor carry;  // the carried states: the last sequence's [1, H, K, V] (varlen), or all N
  for (const ForwardWindow& win : windows.list) {
    const int64_t rows = win.t1 - win.t0, seqs = win.n1 - win.n0;
    auto part = [&](const Tensor& x) { return x.narrow(tdim, win.t0, rows); };
    DiagArgs dw = d;
    dw.T = rows, dw.N = seqs;
    if (varlen) {
      const Tensor local = (windows.cu_host.narrow(0, win.n0, seqs + 1).clamp(win.t0, win.t1) - win.t0).contiguous();
      dw.cu = local.to(d.cu.device());
    }
    std::optional<Tensor> h0w;
    if (win.continues) {
      Tensor s = has(h0) ? h0->narrow(0, win.n0, seqs).clone() : at::zeros({seqs, d.H, d.K, d.V}, acc);
      s.narrow(0, 0, carry.size(0)).copy_(carry);
      h0w = s;
    } else if (has(h0)) {
      h0w = h0->narrow(0, win.n0, seqs);
    }
    const int64_t carried = !win.carries ? 0 : varlen ? 1 : seqs;
    const bool finals = output_final_state || win.carries;
    Tensor hTw = new_output({finals ? seqs : 0, d.H, d.K, d.V}, acc);
    forward_pass(dw, part(r), part(w), part(k), part(v), part(a), part(b), h0w, part(o),
                 finals ? &hTw : nullptr, nullptr, run);
    if (output_final_state && seqs > carried)
      hT.narrow(0, win.n0, seqs - carried).copy_(hTw.narrow(0, 0, seqs - carried));
    if (carried) carry = hTw.narrow(0, seqs - carried, carried);
  }
}

// ---- The backward in windows of the chunk index ----
// A backward on kept states makes dS+ at every chunk end (16 KB per chunk and head at K = V =
// 64) and, on the fused forward's states (DplrKept::states), the pair matrices and X from the
// fused reverse pass too (6.4 KB), for every chunk at once: 2.9 GB beside the 2 GB of states at
// B = 8, T = 4096, H = 64, K = V = 64. Without cu_seqlens it runs over windows of the chunk index
// instead, the latest first (the reverse sweep or the fused reverse pass, then grad, on the
// window's chunks of every sequence, DplrChunkPass::window_chunks), one buffer of each reused by
// every window and dS carried from window to window per sequence. A backward without kept states
// (FLA_EXT_KEEP_WORKSPACES=0) and varlen keep one pass: the first makes every chunk's states
// anyway, and a window of the chunk index would give every sequence its slots, however short.

// Chunks per window, 0 for one pass. The budget: FLA_EXT_WORKSPACE_MIB, else the larger of the
// forward's default (64 MiB, 32 states per sequence) and a part of one pass's workspaces: an
// eighth on the fused forward's states (at most ~8 windows of two launches), a quarter on the
// two-kernel forward's kept workspace (each window's grad launch ends in a partial wave, which
// costs most at K = 128, one CTA per SM; benchmarks/NOTES.md c29 has the measurements; also on
// strided states with it, `ws_kept`), a 16th but at least two windows of kPipelineMinChunks on
// strided states where prep runs again (`lean`: a long sequence at few pairs; its whole workspace
// is what its forward did not keep, and shorter windows leave grad's CTAs, a stride each, too
// few: NOTES c36).
int64_t backward_window_chunks(const DiagArgs& d, DplrKept kept, bool lean, bool ws_kept) {
  if (kept == DplrKept::nothing || d.cu.defined()) return 0;
  const int64_t nch = sequence_chunks(d);
  const bool strided = kept == DplrKept::states, makes_ws = strided && !ws_kept;
  const int64_t ws = makes_ws ? backward_ws_floats_per_chunk(d, kept, lean) : 0;
  const int64_t per_chunk = d.N * d.H * (ws + d.K * d.V) * int64_t(sizeof(float));
  const int64_t mib = workspace_budget_mib();
  const int64_t budget =
      mib >= 0 ? mib << 20
               : std::max(forward_workspace_budget(d),
                          per_chunk * (lean ? std::max(nch / 16, 2 * kPipelineMinChunks) : nch / (makes_ws ? 8 : 4)));
  // On the strided states a window holds whole strides (a grad CTA walks one from its kept state).
  const int64_t stride = strided ? kDplrStateStride : 1;
  const int64_t chunks = std::max<int64_t>(1, budget / per_chunk / stride) * stride;
  return chunks >= nch ? 0 : chunks;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> chunk_rwkv7_fwd(
    const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v, const Tensor& a,
    const Tensor& b, std::optional<double> scale, const std::optional<Tensor>& initial_state,
    bool output_final_state, const std::optional<Tensor>& cu_seqlens, bool head_first, bool keep,
    DplrChunkRunner run) {
  c10::OptionalDeviceGuard guard(device_of(r, "r"));
  const auto d = check_rwkv7(r, w, k, v, a, b, scale, initial_state, cu_seqlens, head_first);
  Tensor o = d.L.empty_like_with_dim(v, d.V, r.scalar_type());
  Tensor hT = new_output({output_final_state ? d.N : 0, d.H, d.K, d.V},
                         r.options().dtype(acc_type(r)));
  // (an inference forward in pipelined windows of the chunk index holds two windows' workspace:
  // forward_pass)
  if (!keep && !fused_forward(d, r, false) && !(r.is_cuda() && inference_window_chunks(d) > 0)) {
    const auto windows = plan_forward_windows(d);
    if (!windows.list.empty()) {
      forward_in_windows(d, windows, r, w, k, v, a, b, initial_state, o, hT, output_final_state, run);
      return {o, hT, new_output({0}, r.options().dtype(at::kFloat))};
    }
  }
  // The fused kernel or the forward sweep stores the states, the two-kernel forward's prep its
  // workspace with the pair matrices (kernels' DplrKept); every float is written (gap slots 0:
  // an op output).
  Tensor saved = new_output({keep ? saved_floats(d, r) : 0}, r.options().dtype(at::kFloat));
  const bool strided = keep && keeps_strided(d, r), f16 = keep && keeps_f16_states(d, r);  // (f16: no padding)
  const int64_t states = strided ? kept_state_floats(d) : dplr_state_floats(d),
                pad = saved_states_floats(d, strided) - states;
  if (keep && !f16 && pad > 0) saved.narrow(0, states, pad).zero_();  // no kernel writes the padding
  forward_pass(d, r, w, k, v, a, b, initial_state, o, output_final_state ? &hT : nullptr,
               keep ? &saved : nullptr, run);
  return {o, hT, saved};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_rwkv7_bwd(
    const Tensor& r, const Tensor& w, const Tensor& k, const Tensor& v, const Tensor& a,
    const Tensor& b, const Tensor& grad_o, const std::optional<Tensor>& grad_final_state,
    std::optional<double> scale, const std::optional<Tensor>& initial_state,
    const std::optional<Tensor>& cu_seqlens, bool head_first, const std::optional<Tensor>& saved_in,
    DplrChunkRunner run) {
  c10::OptionalDeviceGuard guard(device_of(r, "r"));
  const auto d = check_rwkv7(r, w, k, v, a, b, scale, initial_state, cu_seqlens, head_first);
  check_incoming_grads(d, grad_o, grad_final_state, r, "r", v);
  const bool has_dht = has(grad_final_state), has_h0 = has(initial_state);

  const auto acc = r.options().dtype(acc_type(r));
  // The K-vector gradients: on CUDA with one grad CTA per chunk (V in one column tile, or a CTA
  // walking all of them: dplr_grad_grid_tiles), straight into the outputs (DplrArgs::kg_pair =
  // 0); else per-tile partial sums [slabs, grad, <r's shape>], two tiles per zero-filled slab on
  // CUDA, one per tile on the CPU, added here.
  const int tiles = r.is_cuda() ? dplr_grad_grid_tiles(kernel_dtype(r), int(d.K), int(d.V))
                                : dplr_chunk_tiles(int(d.K), int(d.V));
  const int pair = r.is_cuda() ? (tiles == 1 ? 0 : 2) : 1;
  auto kg_sizes = r.sizes().vec();
  kg_sizes.insert(kg_sizes.begin(), {int64_t(pair ? (tiles + pair - 1) / pair : 0), int64_t(kNumKGrads)});
  Tensor kg = pair == 2 ? at::zeros(kg_sizes, acc) : new_output(kg_sizes, acc);
  std::array<Tensor, kNumKGrads> kgd;
  if (pair == 0)
    for (auto& t : kgd) t = new_output(r.sizes(), r.options());
  Tensor dv = new_output(v.sizes(), v.options());
  Tensor dh0 = new_output({has_h0 ? d.N : 0, d.H, d.K, d.V}, acc);
  // Only CUDA keeps them (chunk_rwkv7_train); the CPU engine makes its own.
  if (has(saved_in)) check_device(*saved_in, "saved", r.device());
  // Any form saved_floats gives, whatever the settings now: the strided states where a backward
  // reads them (dplr_strided_states' shapes), alone or with the workspace, or the fp16 states
  // (saved_kind: told by their lengths), else every state and the workspace.
  const DplrKept kind_in = has(saved_in) ? saved_kind(d, r, &*saved_in) : DplrKept::nothing;
  const bool own_length = kind_in == DplrKept::states || kind_in == DplrKept::f16_states;
  const int64_t saved_len = own_length ? saved_in->numel() : saved_states_floats(d, false) + dplr_ws_floats(d);
  const Tensor* kept = r.is_cuda() && d.T > 0
                           ? kept_workspace(saved_in, {saved_len}, r.options().dtype(at::kFloat), "saved")
                           : nullptr;
  Tensor hst = kept ? Tensor() : dplr_states(d, r, d.T > 0);
  const DplrKept kind = saved_kind(d, r, kept);
  // (on strided states: the fused reverse pass, or the reverse sweep with prep run again, `lean`,
  // or the reverse sweep on the kept workspace, `ws_kept`)
  const bool two_kernel = two_kernel_strided(d, r, kind), ws_kept = two_kernel && saved_strided_ws(d, kept);
  const bool lean = two_kernel && !ws_kept;
  // The single-pass backward, on the fp16 states the fused forward keeps where keeps_f16_states
  // (K = V = 64, the gradients straight into the outputs; benchmarks/NOTES.md c67, c69, c70); it
  // needs no dS+ or matrix buffers, so no windows. A forward run with other settings kept other
  // states: the two-kernel paths take those.
  const bool single = r.is_cuda() && kind == DplrKept::f16_states && pair == 0;
  TORCH_CHECK(single || kind != DplrKept::f16_states, "chunk_rwkv7: fp16 states without the single-pass backward");
  int64_t window = single ? 0 : backward_window_chunks(d, kind, lean, ws_kept);
  int windows = 1;
  // Two windows' buffers, so that the reverse pass of one window runs beside grad of the window
  // after it: windows of the pipeline's size, or half the memory budget's.
  if (kind != DplrKept::nothing && !single) {
    const int64_t stride = kind == DplrKept::states ? kDplrStateStride : 1;
    const int64_t pipeline = pipeline_window_chunks(d, true, kind == DplrKept::states && !two_kernel);
    const int64_t half = window > 0 ? std::max(stride, window / 2 / stride * stride) : pipeline;
    if (pipeline > 0 && half < sequence_chunks(d)) window = half, windows = 2;
  }
  Tensor dhst = window > 0 ? new_output({d.N * window * windows, d.H, d.K, d.V}, acc)
                           : dplr_states(d, r, d.T > 0 && r.is_cuda() && !single);

  if (d.T > 0) {
    Tensor ws, uo, carry;
    // (single: chunk_pass makes no workspace for the fp16 states)
    DplrChunkPass p = chunk_pass(d, r, w, k, v, a, b, initial_state, ws, uo, kept, false, window, windows);
    p.single_pass_backward = single;
    p.dout = d.L.vec(grad_o), p.dv = d.L.vec(dv);
    if (has_dht) p.dht = mat(*grad_final_state);
    if (has_h0) p.dh0 = mat(dh0);
    p.kg_pair = pair;
    if (pair) p.kg = d.L.vec(kg[0][0]), p.kg_tile = kg.stride(0), p.kg_grad = kg.stride(1);
    else
      for (int g = 0; g < kNumKGrads; ++g) p.kgd[g] = d.L.vec(kgd[g]);
    if (!kept) p.hst = hst.data_ptr();
    p.dhst = dhst.data_ptr();
    if (window > 0) {  // (the launch walks the windows)
      carry = new_output({d.N, d.H, d.K, d.V}, acc);
      p.carry = mat(carry);
    }
    run(p);
  } else {
    pass_state_gradient(dh0, grad_final_state);
  }
  auto grad = [&](int g) { return pair ? kgrad_sum(kg, g, r) : kgd[g]; };
  return {grad(kGradR), grad(kGradW), grad(kGradK), dv, grad(kGradA), grad(kGradB), dh0};
}

}  // namespace fla::ops
