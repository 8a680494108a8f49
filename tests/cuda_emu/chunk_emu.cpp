// The chunk engine's CUDA kernels (csrc/kernels/chunk*.cuh) for chunk_gla (key-
// or value-side decay) and chunk_rwkv6 run on the CPU by emu.h, in the launch sequences of
// chunk_launch.cuh and chunk_vdecay.cuh, with the
// workspaces laid out as csrc/ops/chunk_gla_rwkv6.cpp does and every output and workspace NaN-poisoned
// first. Built and compared with the CPU backend by tests/test_cuda_emu.py.
#include <torch/extension.h>

#include "emu_args.h"
#include "chunk_intra.cuh"
#include "chunk_out.cuh"
#include "chunk_grad_qk.cuh"
#include "chunk_state.cuh"

namespace fla::chunk_detail {
float4 smem4[8 * 1024];  // extern __shared__ of the kernels (the largest, grad_qk, takes 110 KB)
}  // namespace fla::chunk_detail

namespace {
using namespace fla;
using namespace fla::chunk_detail;
using torch::Tensor;

using emu::mat, emu::poison, emu::vec;

template <class F>
void cta(const F& kernel) {
  emu::poisoned_cta(kernel, smem4);
}

// What `adds` runs add dk, dv and dg into: -1 .. 1 in steps over the elements, in the
// tensor's dtype (tests/test_cuda_emu.py forms the same).
Tensor prior(const Tensor& like) {
  return torch::linspace(-1, 1, like.numel(), torch::kDouble).reshape(like.sizes()).to(like.scalar_type());
}

// The gradient outputs, NaN-poisoned, and the backward's inputs, bound into a pass (dg as dgv
// for a value-side decay). adds: dk, dv and dg hold prior(..) and the pass adds into them
// (ChunkPass dk_adds, dv_adds, dg_adds / dgv_adds).
struct Grads {
  Tensor dq, dk, dv, dg, dh0;
  bool adds;
  Grads(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, int N, int H, int K, int V,
        bool adds)
      : dq(poison(q.sizes(), q.scalar_type())), dk(adds ? prior(k) : poison(k.sizes(), k.scalar_type())),
        dv(adds ? prior(v) : poison(v.sizes(), v.scalar_type())),
        dg(adds ? prior(g) : poison(g.sizes(), g.scalar_type())), dh0(poison({N, H, K, V})), adds(adds) {}
  void bind(ChunkPass& p, const Tensor& dout, const Tensor& dht, const Tensor& h0, bool vside) {
    p.dout = vec(dout), p.dq = vec(dq), p.dk = vec(dk), p.dv = vec(dv);
    (vside ? p.dgv : p.dg) = vec(dg);
    p.dk_adds = p.dv_adds = adds;
    (vside ? p.dgv_adds : p.dg_adds) = adds;
    if (dht.numel()) p.dht = mat(dht);
    if (h0.numel()) p.dh0 = mat(dh0);
  }
};

// ChunkPass::window_chunks of every pass (the ops' chunk_window_chunks, which needs long
// sequences): set from the tests; 0 walks each sequence in one CTA.
int window_chunks = 0;

// launch_state of chunk_launch.cuh: in windows where state_windows (flags zeroed; the ops'
// window_states).
template <typename E, Reader RD, bool OUT, int NK, bool BWD = false>
void state(const ChunkPass& pass) {
  const int ntk = (pass.K + DT - 1) / DT, ntv = (pass.V + DT - 1) / DT;
  const unsigned z = unsigned(ntv * ((ntk + NK - 1) / NK));
  ChunkPass p = pass;
  std::vector<int> flags;
  std::vector<float> handed;  // poisoned: a window reads only what its predecessor handed on
  p.window_chunks = window_chunks;
  if (window_chunks > 0) {
    flags.assign(size_t(chunk_window_flags(p.N, p.H, p.K, p.V, p.T, window_chunks)), 0);
    handed.assign(size_t(chunk_window_states(p.N, p.H, p.K, p.V, p.T, window_chunks)), NAN);
    p.window_flags = flags.data(), p.window_states = handed.data();
  }
  const bool vec = state_vec<E>(p, OUT, BWD);
  if (state_windows(p)) {
    const unsigned windows = unsigned(chunk_window_count(p.T, window_chunks));
    return emu::launch(dim3(unsigned(p.N), p.H, z * windows), NTH,
                       [&] { cta([&] { chunk_state_kernel<E, RD, OUT, NK, BWD, true>(p, ntv, vec); }); });
  }
  emu::launch(dim3(unsigned(p.N), p.H, z), NTH, [&] { cta([&] { chunk_state_kernel<E, RD, OUT, NK, BWD>(p, ntv, vec); }); });
}

template <typename E, Reader RD, bool DV>
void out(const ChunkPass& p, int64_t slots) {
  if (p.V > DT)
    emu::launch(dim3(unsigned(slots), p.H, unsigned((p.V + 2 * DT - 1) / (2 * DT))), NTH,
                [&] { cta([&] { chunk_out_kernel<E, RD, DV, 2>(p, out_vec<E>(p, DV)); }); });
  else
    emu::launch(dim3(unsigned(slots), p.H, 1), NTH, [&] { cta([&] { chunk_out_kernel<E, RD, DV, 1>(p, out_vec<E>(p, DV)); }); });
}

// chunk_launch.cuh's chunk_split_out at K <= 64, which depends on the GPU's SM count: set from the
// tests (at K > 64 a forward that keeps hst always splits).
bool split_out = false;

// The forward of chunk_launch.cuh's launch_forward; `keep`: hst is written (a training forward).
template <typename E, Reader RD>
void forward(const ChunkPass& p, int64_t slots) {
  emu::launch(dim3(unsigned(slots), p.H), NTH, [&] { cta([&] { chunk_intra_kernel<E, RD>(p, key_rows_vec<E>(p)); }); });
  const bool split = p.hst && (split_out || p.K > DT);
  if (p.K <= DT && !split) return state<E, RD, true, 1>(p);
  if (chunk_fused_out(p.K) && !split) return state<E, RD, true, 2>(p);
  state<E, RD, false, 1>(p);
  out<E, RD, false>(p, slots);
}

template <typename E>
void grad_qk(const ChunkPass& p, int64_t slots, int nts) {
  emu::launch(dim3(unsigned(slots), p.H, unsigned((p.K + DT - 1) / DT)), NTH,
              [&] { cta([&] { chunk_grad_qk_kernel<E, Reader::Inclusive>(p, nts, grad_qk_vec<E>(p)); }); });
}

// A value-side decay (chunk_vdecay.cuh): the transposed key-side pass.
template <typename E>
void value_side(const ChunkPass& p, int64_t slots) {
  const ChunkPass r = value_side_as_key_side(p);
  constexpr Reader RD = Reader::Inclusive;
  if (p.dout.on())
    emu::launch(dim3(unsigned(slots), p.H), NTH, [&] { cta([&] { chunk_intra_kernel<E, RD>(r, key_rows_vec<E>(r)); }); });
  if (!p.hst_kept) state<E, RD, false, 1>(r);
  if (!p.dout.on()) {
    const ChunkPass f = value_side_forward_as_key_side(p);
    return emu::launch(dim3(unsigned(slots), p.H, unsigned((r.K + DT - 1) / DT)), NTH,
                       [&] { cta([&] { chunk_grad_qk_kernel<E, RD, true>(f, 0, grad_qk_vec<E>(f)); }); });
  }
  state<E, RD, false, 1, true>(r);
  const ChunkPass b = value_side_grads_as_key_side(p);
  out<E, RD, true>(b, slots);
  out<E, RD, false>(b, slots);
  grad_qk<E>(b, slots, (r.V + kStateCols - 1) / kStateCols);
}

// [o, hT] or, with dout, [dq, dk, dv, dg, du, dh0] (empty tensors stand for None). keep: the
// forward keeps hst and amat and the backward reads them (else the backward rebuilds them).
// vside: g is the value-side decay gv [B, T, H, V]. acc: o and dq in float32 (o_acc, dq_acc).
// adds: the backward adds dk, dv, dg into prior(..) (Grads). softmax: a value-side forward takes
// o's rows through their softmax (ChunkPass::o_softmax), returned as [o, hT, the fp32 weights]; a
// key-side backward dq's rows through a softmax's backward (ChunkPass::dq_softmax_w) with
// weights softmax(3 prior(q)), returned after du and dh0.
template <typename E, Reader RD>
std::vector<Tensor> run_t(Tensor q, Tensor k, Tensor v, Tensor g, Tensor u, Tensor h0, Tensor dout,
                          Tensor dht, double scale, Tensor cu, bool keep, bool vside, bool acc,
                          bool adds, bool softmax) {
  const bool varlen = cu.numel() > 0, bwd = dout.dim() == 4;
  const int B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3);
  const int N = varlen ? int(cu.numel()) - 1 : B;
  ChunkPass p;
  p.dtype = std::is_same_v<E, float> ? DType::f32 : DType::bf16;
  p.N = N, p.H = H, p.T = T, p.K = K, p.V = V, p.scale = scale, p.reader = RD;
  p.cu_seqlens = varlen ? cu.data_ptr<int64_t>() : nullptr;
  p.q = vec(q), p.k = vec(k), p.v = vec(v);
  (vside ? p.gv : p.g) = vec(g);
  if (u.numel()) p.u = u.data_ptr(), p.udtype = p.dtype;
  if (h0.numel()) p.h0 = mat(h0);
  const int64_t slots = chunk_slots(N, T, varlen);
  Tensor amat = poison({slots, H, C, C}), hst = poison({slots, H, K, V});
  Tensor o = poison(v.sizes(), acc ? torch::kFloat : v.scalar_type()), hT = poison({N, H, K, V});
  p.amat = amat.data_ptr();
  p.o_acc = acc;
  auto grads = [&] {
    Grads r(q, k, v, g, N, H, K, V, adds);
    if (acc) r.dq = poison(q.sizes(), torch::kFloat);
    return r;
  };
  if (vside) {  // keep: the backward reads the forward's (transposed) states; never amat
    const int nts = (K + kStateCols - 1) / kStateCols;  // the transposed state's columns
    Tensor dhst = poison({slots, H, V, K}), zeta = poison({slots, H, nts, V});
    p.hst = hst.data_ptr(), p.dhst = dhst.data_ptr(), p.zeta = zeta.data_ptr();
    p.o = vec(o), p.hT = mat(hT);
    Tensor weights = poison(v.sizes(), torch::kFloat);
    if (softmax) p.o_softmax = true, p.o_softmax_acc = vec(weights);
    value_side<E>(p, slots);
    if (softmax) return {o, hT, weights};
    if (!bwd) return {o, hT};
    ChunkPass b = p;
    b.o = VecArg{}, b.hT = MatArg{};
    b.hst_kept = keep, b.o_acc = false, b.dq_acc = acc;
    if (!keep) hst.fill_(NAN);
    Grads r = grads();
    r.bind(b, dout, dht, h0, true);
    value_side<E>(b, slots);
    return {r.dq, r.dk, r.dv, r.dg, torch::zeros({H, K}), r.dh0};
  }
  p.o = vec(o), p.hT = mat(hT);
  // As the op: an inference forward with o in the state kernel keeps no states.
  if (keep || !chunk_fused_out(K)) p.hst = hst.data_ptr();
  forward<E, RD>(p, slots);
  if (!bwd) return {o, hT};

  ChunkPass b = p;
  b.o = VecArg{}, b.hT = MatArg{};
  b.hst = hst.data_ptr();
  b.hst_kept = b.amat_kept = keep;
  b.o_acc = false, b.dq_acc = acc;
  if (!keep) {  // launch_forward_state<PAIRS = true>: the pair matrices and hst again
    amat.fill_(NAN), hst.fill_(NAN);
    emu::launch(dim3(unsigned(slots), H), NTH, [&] { cta([&] { chunk_intra_kernel<E, RD>(b, key_rows_vec<E>(b)); }); });
    state<E, RD, false, 1>(b);
  }
  const int nts = (V + kStateCols - 1) / kStateCols;
  Tensor dhst = poison({slots, H, K, V}), zeta = poison({slots, H, nts, K});
  Tensor du = torch::zeros({slots, H, K});
  Grads r = grads();
  r.bind(b, dout, dht, h0, false);
  const Tensor weights = torch::softmax(3 * prior(q).to(torch::kFloat), -1);
  if (softmax) b.dq_softmax_w = vec(weights), b.dq_acc = false;
  if (u.numel()) b.du = du.data_ptr();
  b.dhst = dhst.data_ptr(), b.zeta = zeta.data_ptr();
  state<E, RD, false, 1, true>(b);
  out<E, RD, true>(b, slots);
  if (softmax)  // chunk_launch.cuh's choice (the inclusive reader alone on the GPU)
    emu::launch(dim3(unsigned(slots), H, unsigned((K + DT - 1) / DT)), NTH,
                [&] { cta([&] { chunk_grad_qk_kernel<E, RD, false, true>(b, nts, grad_qk_vec<E>(b)); }); });
  else
    emu::launch(dim3(unsigned(slots), H, unsigned((K + DT - 1) / DT)), NTH,
                [&] { cta([&] { chunk_grad_qk_kernel<E, RD>(b, nts, grad_qk_vec<E>(b)); }); });
  if (softmax) return {r.dq, r.dk, r.dv, r.dg, du.sum(0), r.dh0, weights};
  return {r.dq, r.dk, r.dv, r.dg, du.sum(0), r.dh0};
}

std::vector<Tensor> run(Tensor q, Tensor k, Tensor v, Tensor g, Tensor u, Tensor h0, Tensor dout,
                        Tensor dht, double scale, Tensor cu, bool keep, bool vside, bool acc,
                        bool adds, bool softmax) {
  const bool bf = q.scalar_type() == torch::kBFloat16, ex = u.numel() > 0;
  auto f = bf ? (ex ? run_t<__nv_bfloat16, Reader::Exclusive> : run_t<__nv_bfloat16, Reader::Inclusive>)
              : (ex ? run_t<float, Reader::Exclusive> : run_t<float, Reader::Inclusive>);
  return f(q, k, v, g, u, h0, dout, dht, scale, cu, keep, vside, acc, adds, softmax);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run);
  m.def("set_warp_order", [](int order) { emu::warp_order = order; });
  m.def("set_split_out", [](bool split) { split_out = split; });
  m.def("set_window_chunks", [](int chunks) { window_chunks = chunks; });
}
