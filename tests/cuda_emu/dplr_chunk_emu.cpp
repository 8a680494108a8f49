// chunk_rwkv7's CUDA kernels (csrc/kernels/dplr_chunk*.cuh) run on the CPU by emu.h, fp32, with
// the workspaces laid out as csrc/ops/chunk_rwkv7.cpp does, every output and workspace
// NaN-poisoned first. Built and compared with the CPU reference by tests/test_cuda_emu.py.
#include <torch/extension.h>

#include "emu_args.h"
#include "dplr_chunk_fused.cuh"
#include "dplr_chunk_fused_backward.cuh"
#include "dplr_chunk_fused_reverse.cuh"
#include "dplr_chunk_grad.cuh"
#include "dplr_chunk_prep.cuh"
#include "dplr_chunk_sweep.cuh"

namespace fla::dplr_chunk_detail {
float sm[64 * 1024];     // extern __shared__ of the kernels: one CTA at a time
float4 sm4[16 * 1024];
}  // namespace fla::dplr_chunk_detail
namespace fla {
// the fused kernels' (the backward kernel under construction needs the most)
float4 fused_sm4[(std::max(dplr_fused_detail::FusedSmem<2>::bytes(), dplr_fused_detail::GradSmem::bytes()) + 15) / 16];

}  // namespace fla

namespace {
using namespace fla;
using namespace fla::dplr_chunk_detail;
using torch::Tensor;

using emu::mat, emu::poison, emu::vec;

template <class F>
void cta(const F& kernel) {
  emu::poisoned_cta(kernel, sm, sm4);
}

// The fused kernels' build that the launch picks by the number of tasks: two blocks (1: one CTA
// per SM, 2: two; the forward's two-CTA build is for inference alone), or one block with kCtas =
// 3 or 4 CTAs per SM (set_fused_ctas; the register budget changes nothing here, the schedule of
// the two-block kernels does).
int fused_ctas = 4;
using dplr_fused_detail::NTF;

// kCtas = 0 here: the two-block kernel keeping the two-kernel forward's states and workspace (a
// training forward at few pairs); 1: the two-block kernel storing the kept states (p.kept:
// DplrKept::f16_states, else the strided ones).
template <int kCtas>
void fused_forward(const DplrChunkPass& p) {
  const bool f16 = p.kept == DplrKept::f16_states;
  emu::launch(dim3(unsigned(p.N * p.H)), kCtas <= 2 ? 2 * NTF : NTF, [&] {
    emu::poisoned_cta([&] {
      if constexpr (kCtas == 0) {
        fused_forward_two_block_kernel<__nv_bfloat16, 1, DplrKept::states_and_workspace>(p);
      } else if constexpr (kCtas == 1) {
        if (f16) fused_forward_two_block_kernel<__nv_bfloat16, 1, DplrKept::f16_states>(p);
        else fused_forward_two_block_kernel<__nv_bfloat16, 1, DplrKept::states>(p);
      } else if constexpr (kCtas == 2) {
        fused_forward_two_block_kernel<__nv_bfloat16, 2, DplrKept::nothing>(p);  // (inference)
      } else {
        if (!p.hst) fused_forward_kernel<__nv_bfloat16, kCtas, DplrKept::nothing>(p);
        else if (f16) fused_forward_kernel<__nv_bfloat16, kCtas, DplrKept::f16_states>(p);
        else fused_forward_kernel<__nv_bfloat16, kCtas, DplrKept::states>(p);
      }
    }, fused_sm4);
  });
}
// A training forward (hst): the one-block kernel, as the launch runs it.
void fused_training_forward(const DplrChunkPass& p) {
  if (fused_ctas == 1) fused_forward<1>(p);
  else if (fused_ctas == 3) fused_forward<3>(p);
  else fused_forward<4>(p);
}

// The fused reverse pass (dplr_chunk_fused_reverse.cuh), bf16, as the launch runs it.
void fused_reverse(const DplrChunkPass& p) {
  DplrChunkPass f = p;
  f.paths.rows_16byte = input_rows_in_pieces<__nv_bfloat16>(p, p.dout);
  emu::launch(dim3(unsigned(p.N * p.H)), fused_ctas <= 2 ? 2 * NTF : NTF, [&] {
    emu::poisoned_cta([&] {
      if (fused_ctas == 1) fused_reverse_two_block_kernel<__nv_bfloat16, 1>(f);
      else if (fused_ctas == 2) fused_reverse_two_block_kernel<__nv_bfloat16, 2>(f);
      else fused_reverse_kernel<__nv_bfloat16, 4>(f);
    }, fused_sm4);
  });
}

// [o, hT] or, with dout, [dr, dw, dk, dv, da, db, dh0]. Empty tensors stand for None. The
// activations are float32 or bfloat16 (the kernels' T, E here); states and gradients of K-vectors
// fp32. keep (backward), as chunk_rwkv7_train does: 1, the two-kernel training forward stores hst
// and its workspace (with the pair matrices) first, and the backward reads them
// (DplrKept::states_and_workspace: no prep, no forward sweep); 2, the fused forward (bf16, K = V =
// 64) stores hst, and the backward runs the fused reverse pass (DplrKept::states:
// ws holds the pair matrices and X alone); 3 and 4, as 2 and 1 with the
// backward in windows of two chunks (3: kDplrStateStride; no cu_seqlens), latest first, as the op's
// backward_window_chunks runs it; 5 and 6, as 1 and 4 with hst and the workspace made by the
// two-block fused forward that keeps them (bf16, K = V = 64: a training forward at few pairs); 7,
// as 4 with the training forward in windows of two chunks and the backward's windows taking
// two dhst buffers in turn, as the launch's pipelined windows run them (dplr_chunk_launch.cuh
// launch_windows; no cu_seqlens). A forward (no dout) with keep 7 runs in those windows too, as an
// inference forward: prep's workspace per window, two in turn (dplr_ws_kept). 8 and
// 9 (bf16, K = V = 64 or 128, no cu_seqlens): the forward in windows of two chunks storing the strided
// states from its sweep (sweep_strided_states; prep's workspace per window, two in turn), the
// backward on them prep, the reverse sweep and the strided grad, in one pass (8) or in windows of
// kDplrStateStride chunks on two buffers of each in turn (9). 10 and 11 (bf16, K = V = 128, no
// cu_seqlens): the forward in one pass storing the strided states from its sweep and keeping
// prep's whole workspace (DplrChunkPass::strided_ws_kept), the backward on them the reverse sweep
// and the strided grad (no prep), in one pass (10) or in windows of kDplrStateStride chunks (11).
template <typename E, int KC>  // KC: the kernels' compile-time K, as the launch picks it
std::vector<Tensor> run_t(Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, Tensor b, Tensor h0,
                        Tensor dout, Tensor dht, double scale, Tensor cu, int64_t keep) {
  const bool varlen = cu.numel() > 0, bwd = dout.dim() == 4;
  const int B = r.size(0), T = r.size(1), H = r.size(2), K = r.size(3), V = v.size(3);
  const int N = varlen ? int(cu.numel()) - 1 : B;
  DplrChunkPass p;
  p.dtype = std::is_same_v<E, float> ? DType::f32 : DType::bf16;
  p.N = N, p.H = H, p.T = T, p.K = K, p.V = V, p.scale = scale;
  p.cu_seqlens = varlen ? cu.data_ptr<int64_t>() : nullptr;
  p.r = vec(r), p.w = vec(w), p.k = vec(k), p.v = vec(v), p.a = vec(a), p.b = vec(b);
  if (h0.numel()) p.h0 = mat(h0);
  const int64_t slots = chunk_slots<C>(N, T, varlen);
  const DplrWorkspaceLayout ws(K, V);
  Tensor wsb = poison({slots * H * ws.floats_per_chunk()}), uob = poison({slots * H * ws.uo_floats_per_chunk()}), hst = poison({slots, H, K, V});
  p.ws = wsb.data_ptr(), p.uo = uob.data_ptr();
  Tensor o = poison(v.sizes(), v.scalar_type()), hT = poison({N, H, K, V}), dhst = poison({slots, H, K, V});
  // As the CUDA op lays them out (csrc/ops/chunk_rwkv7.cpp): two column tiles add into one
  // zero-filled slab; a single grad CTA per chunk (one tile, or walking them all) stores
  // straight into the (poisoned) gradients.
  const int tiles = dplr_grad_grid_tiles(p.dtype, K, V), pair = tiles > 1 ? 2 : 0;
  std::vector<Tensor> kgd;
  // dw into a view with its own row stride: the gradient stores' per-output offsets (the op's
  // outputs share strides: DplrChunkPaths::grads_share_offsets, covered by the GPU tests)
  for (int g = 0; g < kNumKGrads; ++g)
    kgd.push_back(g == kGradW ? poison({B, T, H, 2 * K}, r.scalar_type()).narrow(3, 0, K)
                              : poison(r.sizes(), r.scalar_type()));
  Tensor kg = torch::zeros({(tiles + 1) / 2, kNumKGrads, B, T, H, K}), dv = poison(v.sizes(), v.scalar_type()),
         dh0 = poison({N, H, K, V});
  const dim3 sweeps(unsigned(N * H * state_tiles(V)));
  const int64_t nch = (T + C - 1) / C;
  // A forward as the launch runs it: one pass, or (keep 7, 8, 9) prep and the sweep window by
  // window, the state carried between windows in a poisoned buffer.
  auto forward = [&](DplrChunkPass f) {
    pick_paths<E>(f);
    Tensor carry = poison({N, H, K, V});
    const bool windows = keep >= 7 && keep <= 9;
    if (windows) {
      TORCH_CHECK(!varlen, "forward windows take no cu_seqlens");
      f.window_chunks = 2, f.carry = mat(carry);
    }
    const DplrChunkPass base = f;  // (the buffers of both windows, as the launch's pass holds them)
    int64_t w = 0;
    for (f.window_begin = 0; f.window_begin < (windows ? nch : 1); f.window_begin += 2, ++w) {
      if (windows) dplr_prep_window(f, base, f.window_begin, int(w % 2));
      const dim3 preps = windows ? dim3(2, H, N) : dim3(unsigned(slots), H);
      emu::launch(preps, NT, [&] { cta([&] { prep_kernel<E, KC>(f); }); });
      emu::launch(sweeps, NTS, [&] {
        cta([&] {
          if (f.sweep_strided_states) sweep_kernel<E, false, true, KC, true>(f);  // (as the launch picks it)
          else sweep_kernel<E, false, true, KC>(f);
        });
      });
    }
  };
  if (bwd && (keep == 1 || keep == 4 || keep == 5 || keep == 6 || keep == 7)) {
    DplrChunkPass f = p;
    f.o = vec(o), f.hst = hst.data_ptr();
    if (keep == 5 || keep == 6) {
      if constexpr (std::is_same_v<E, float>) {
        TORCH_CHECK(false, "the fused forward takes bf16");
      } else {
        TORCH_CHECK(dplr_fused_forward(p.dtype, K, V), "not a fused-forward shape");
        f.paths.rows_16byte = input_rows_in_pieces<E>(f, f.v);
        fused_forward<0>(f);
      }
    } else {
      forward(f);
    }
    p.kept = DplrKept::states_and_workspace;
    uob.fill_(NAN);  // a kept backward reads no U0 / O0
  } else if (bwd && keep >= 8 && keep <= 11) {
    if constexpr (std::is_same_v<E, float>) {
      TORCH_CHECK(false, "the strided states take bf16");
    } else {
      TORCH_CHECK(dplr_strided_states(p.dtype, K, V), "not a strided-state shape");
      TORCH_CHECK(!varlen || keep == 10, "windows take no cu_seqlens");
      // the forward sweep's strided states (sweep_strided_states); prep's workspace per window
      // (8, 9) or kept whole (10, 11: strided_ws_kept)
      const bool ws_kept = keep >= 10;
      hst = poison({dplr_kept_state_slots(N, T, varlen), H, K, V});
      DplrChunkPass f = p;
      f.o = vec(o), f.hst = hst.data_ptr(), f.sweep_strided_states = true, f.strided_ws_kept = ws_kept;
      forward(f);
      TORCH_CHECK(!hst.isnan().any().item<bool>(), "the forward sweep left a slot of hst unwritten");
      if (ws_kept) TORCH_CHECK(!wsb.isnan().any().item<bool>(), "the forward's prep left kept workspace unwritten");
      p.kept = DplrKept::states, p.sweep_strided_states = true, p.strided_ws_kept = ws_kept;
      if (!ws_kept) wsb.fill_(NAN);
      uob.fill_(NAN);
    }
  } else if (bwd && (keep == 2 || keep == 3)) {
    if constexpr (std::is_same_v<E, float>) {
      TORCH_CHECK(false, "the fused forward takes bf16");
    } else {
      TORCH_CHECK(dplr_fused_forward(p.dtype, K, V), "not a fused-forward shape");
      // every kDplrStateStride-th chunk-start state (and the final ones), as the op sizes them
      hst = poison({dplr_kept_state_slots(N, T, varlen), H, K, V});
      DplrChunkPass f = p;
      f.o = vec(o), f.hst = hst.data_ptr(), f.fused = true;
      f.paths.rows_16byte = input_rows_in_pieces<E>(f, f.v);
      fused_training_forward(f);
      TORCH_CHECK(!hst.isnan().any().item<bool>(), "the fused forward left a slot of hst unwritten");
      p.kept = DplrKept::states, p.uo = nullptr;
      wsb = poison({slots * H * DplrWorkspaceLayout::kMatsFloats});
      p.ws = wsb.data_ptr();
    }
  }
  if (!bwd) {
    p.o = vec(o), p.hT = mat(hT);
  } else {
    p.dout = vec(dout), p.dv = vec(dv), p.hst = hst.data_ptr(), p.dhst = dhst.data_ptr();
    if (dht.numel()) p.dht = mat(dht);
    if (h0.numel()) p.dh0 = mat(dh0);
    p.kg_pair = pair;
    if (pair) p.kg = vec(kg[0][0]), p.kg_tile = kg.stride(0), p.kg_grad = kg.stride(1);
    for (int g = 0; g < kNumKGrads && !pair; ++g) p.kgd[g] = vec(kgd[g]);
  }
  pick_paths<E>(p);  // as the launch decides: 16-byte loads and stores where they apply
  if (!bwd) {
    forward(p);
    return {o, hT};
  }
  auto backward = [&] {  // as the launch runs it
    const int64_t work = dplr_work_slots(p);
    const dim3 preps = p.window_chunks > 0 ? dim3(unsigned(p.window_chunks), H, N) : dim3(unsigned(work), H);
    if (p.kept == DplrKept::states) {
      if constexpr (!std::is_same_v<E, float> && (KC == 64 || KC == 128)) {
        if (p.sweep_strided_states) {  // prep (unless kept) and the reverse sweep in place of the fused reverse pass
          if (!p.strided_ws_kept) emu::launch(preps, NT, [&] { cta([&] { prep_kernel<E, KC>(p); }); });
          emu::launch(sweeps, NTS, [&] { cta([&] { sweep_kernel<E, true, false, KC>(p); }); });
        } else {
          fused_reverse(p);
        }
        emu::launch(dim3(unsigned(dplr_grad_ctas(p)), H, tiles), NT, [&] { cta([&] { grad_kernel<E, KC, true>(p); }); });
      }
      return;
    }
    if (p.kept != DplrKept::states_and_workspace)
      emu::launch(dim3(unsigned(work), H), NT, [&] { cta([&] { prep_kernel<E, KC>(p); }); });
    if (p.kept == DplrKept::nothing)  // the backward's forward sweep makes hst alone
      emu::launch(sweeps, NTS, [&] { cta([&] { sweep_kernel<E, false, false, KC>(p); }); });
    emu::launch(sweeps, NTS, [&] { cta([&] { sweep_kernel<E, true, false, KC>(p); }); });
    emu::launch(dim3(unsigned(work), H, tiles), NT, [&] { cta([&] { grad_kernel<E, KC>(p); }); });
  };
  if (keep != 3 && keep != 4 && keep != 6 && keep != 7 && keep != 9 && keep != 11) {
    backward();
  } else if (keep == 7 || keep == 9) {  // two windows' dhst (9: and prep's ws, uo), taken in turn (poisoned once)
    const int64_t kWindow = keep == 9 ? kDplrStateStride : 2, half = N * kWindow * H * K * V;
    Tensor wdhst = poison({2 * N * kWindow, H, K, V}), carry = poison({N, H, K, V});
    p.carry = mat(carry), p.window_chunks = kWindow, p.window_buffers = 2;
    const DplrChunkPass base = p;
    int64_t k = 0;
    for (p.window_begin = (nch - 1) / kWindow * kWindow; p.window_begin >= 0; p.window_begin -= kWindow, ++k) {
      p.dhst = wdhst.data_ptr<float>() + k % 2 * half;
      if (keep == 9) dplr_prep_window(p, base, p.window_begin, int(k % 2));
      backward();
    }
  } else {  // window-sized dhst (and ws, unless kept), poisoned once: every window writes its slots before reading them
    TORCH_CHECK(!varlen, "backward windows take no cu_seqlens");
    // (a multiple of the kept states' stride, as the op's backward_window_chunks makes it)
    const int64_t kWindow = p.kept == DplrKept::states ? kDplrStateStride : 2;
    Tensor wws = poison({N * kWindow * H * (p.kept == DplrKept::states ? DplrWorkspaceLayout::kMatsFloats : ws.floats_per_chunk())}), wdhst = poison({N * kWindow, H, K, V}),
           carry = poison({N, H, K, V});
    if (keep == 3) p.ws = wws.data_ptr();  // (4, 6, 11: the kept workspace)
    p.dhst = wdhst.data_ptr(), p.carry = mat(carry), p.window_chunks = kWindow;
    for (p.window_begin = (nch - 1) / kWindow * kWindow; p.window_begin >= 0; p.window_begin -= kWindow) backward();
  }
  auto g = [&](int i) { return pair ? kg.select(1, i).sum(0).to(r.scalar_type()) : kgd[i]; };
  return {g(kGradR), g(kGradW), g(kGradK), dv, g(kGradA), g(kGradB), dh0};
}

// The fused inference forward (dplr_chunk_fused.cuh), bf16, K = V = 64: [o, hT]. ctas: the
// kernel's register budget (three or four CTAs per SM).
std::vector<Tensor> run_fused(Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, Tensor b, Tensor h0,
                              double scale, Tensor cu, int64_t ctas, bool o_strided) {
  const bool varlen = cu.numel() > 0;
  const int T = r.size(1), H = r.size(2), K = r.size(3), V = v.size(3);
  const int N = varlen ? int(cu.numel()) - 1 : r.size(0);
  DplrChunkPass p;
  p.dtype = DType::bf16;
  p.N = N, p.H = H, p.T = T, p.K = K, p.V = V, p.scale = scale;
  p.cu_seqlens = varlen ? cu.data_ptr<int64_t>() : nullptr;
  p.r = vec(r), p.w = vec(w), p.k = vec(k), p.v = vec(v), p.a = vec(a), p.b = vec(b);
  if (h0.numel()) p.h0 = mat(h0);
  TORCH_CHECK(dplr_fused_forward(p.dtype, K, V), "not a fused-forward shape");
  // o_strided: o every other element of a wider tensor (the stores honour its column stride)
  Tensor o = o_strided ? poison({v.size(0), T, H, 2 * V}, v.scalar_type()).slice(3, 0, 2 * V, 2)
                       : poison(v.sizes(), v.scalar_type()),
         hT = poison({N, H, K, V});
  p.o = vec(o), p.hT = mat(hT), p.fused = true;
  p.paths.rows_16byte = input_rows_in_pieces<__nv_bfloat16>(p, p.v);  // as the launch sets it
  TORCH_CHECK(ctas >= 1 && ctas <= 4, "ctas is 1 (the two-block kernel keeping hst and ws), 2 (the two-block kernel), 3 or 4");
  if (ctas == 1) {
    // A training forward on the two-kernel path keeps hst and prep's workspace: made here by the
    // fused kernel and by prep and the sweep (o, hT of their own), every buffer poisoned first.
    const int64_t slots = chunk_slots<C>(N, T, varlen);
    const DplrWorkspaceLayout ws(K, V);
    std::vector<Tensor> kept;
    for (int run = 0; run < 2; ++run) {
      Tensor hst = poison({slots, H, K, V}), wsb = poison({slots * H * ws.floats_per_chunk()});
      DplrChunkPass f = p;
      f.hst = hst.data_ptr(), f.ws = wsb.data_ptr(), f.fused = false;
      if (run == 0) {
        fused_forward<0>(f);
      } else {
        Tensor uob = poison({slots * H * ws.uo_floats_per_chunk()});
        Tensor o2 = poison(v.sizes(), v.scalar_type()), hT2 = poison({N, H, K, V});
        f.uo = uob.data_ptr(), f.o = vec(o2), f.hT = mat(hT2);
        pick_paths<__nv_bfloat16>(f);
        emu::launch(dim3(unsigned(slots), H), NT, [&] { cta([&] { prep_kernel<__nv_bfloat16, 64>(f); }); });
        emu::launch(dim3(unsigned(N * H * state_tiles(V))), NTS,
                    [&] { cta([&] { sweep_kernel<__nv_bfloat16, false, true, 64>(f); }); });
      }
      kept.push_back(hst), kept.push_back(wsb);
    }
    return {o, hT, kept[0], kept[1], kept[2], kept[3]};
  }
  if (ctas == 2) fused_forward<2>(p);
  else if (ctas == 3) fused_forward<3>(p);
  else fused_forward<4>(p);
  return {o, hT};
}

// The backward kernel under construction (dplr_chunk_fused_backward.cuh), bf16, K = V = 64: [dv,
// dh0] from dout and dht (empty: none); with hst (every chunk-start state, fp32, [slots, H, K, V]
// at chunk_slot's slots), or with `kept` on the fp16 states the fused training forward keeps for
// it (from h0, DplrKept::f16_states), also [dr, dw, dk, da, db]; outputs poisoned.
std::vector<Tensor> run_single_pass_backward(Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, Tensor b, Tensor h0,
                                       Tensor dout, Tensor dht, Tensor hst, double scale, Tensor cu, bool kept) {
  const bool varlen = cu.numel() > 0;
  const int B = r.size(0), T = r.size(1), H = r.size(2), K = r.size(3), V = v.size(3);
  TORCH_CHECK(K == 64 && V == 64 && r.scalar_type() == torch::kBFloat16, "bf16, K = V = 64");
  const int N = varlen ? int(cu.numel()) - 1 : B;
  DplrChunkPass p;
  p.dtype = DType::bf16;
  p.N = N, p.H = H, p.T = T, p.K = K, p.V = V, p.scale = scale;
  p.cu_seqlens = varlen ? cu.data_ptr<int64_t>() : nullptr;
  p.r = vec(r), p.w = vec(w), p.k = vec(k), p.v = vec(v), p.a = vec(a), p.b = vec(b), p.dout = vec(dout);
  if (dht.numel()) p.dht = mat(dht);
  Tensor dv = poison(v.sizes(), v.scalar_type()), dh0 = poison({N, H, K, V});
  p.dv = vec(dv), p.dh0 = mat(dh0);
  std::vector<Tensor> kgd;
  if (kept) {
    const DplrKept kind = DplrKept::f16_states;
    hst = poison({DplrF16States::floats(N, T, varlen, H)});
    Tensor o = poison(v.sizes(), v.scalar_type());
    DplrChunkPass f = p;
    if (h0.numel()) f.h0 = mat(h0);
    f.o = vec(o), f.hst = hst.data_ptr(), f.fused = true, f.kept = kind;
    f.paths.rows_16byte = input_rows_in_pieces<__nv_bfloat16>(f, f.v);
    fused_training_forward(f);
    TORCH_CHECK(!hst.isnan().any().item<bool>(), "the fused forward left a float of hst unwritten");
    p.kept = kind;
  }
  if (hst.numel()) {
    p.hst = hst.data_ptr();
    for (int g = 0; g < kNumKGrads; ++g) kgd.push_back(poison(r.sizes(), r.scalar_type())), p.kgd[g] = vec(kgd.back());
  }
  // the launch's paths, but on every chunk's states (hst) the scalar stores, so that the tests
  // reach both
  pick_paths<__nv_bfloat16>(p);
  p.paths.rows_16byte = input_rows_in_pieces<__nv_bfloat16>(p, p.dout);
  if (!kept) p.paths.grads_16byte = false;
  emu::launch(dim3(unsigned(N * H)), NTF, [&] {
    emu::poisoned_cta([&] { single_pass_backward_kernel<__nv_bfloat16>(p); }, fused_sm4);
  });
  std::vector<Tensor> out{dv, dh0};
  out.insert(out.end(), kgd.begin(), kgd.end());
  return out;
}

// A [K][V] fp32 state through the single pass's fp16 record (dplr_f16_states.cuh): stored by the
// 128 threads of a CTA from a [K][LB] shared-memory copy, loaded back by them into their held
// elements: [the state as loaded, [K][V]; the record's four inverse scales].
std::vector<Tensor> f16_state_roundtrip(Tensor state) {
  using namespace dplr_fused_detail;
  TORCH_CHECK(state.sizes() == torch::IntArrayRef({K, V}) && state.scalar_type() == torch::kFloat, "[64, 64] fp32");
  Tensor staged = torch::zeros({K, LB});
  staged.narrow(1, 0, V).copy_(state);
  Tensor record = poison({DplrF16States::kFloats}), back = poison({K, V});
  float* const rec = record.data_ptr<float>();
  const float* const S = staged.data_ptr<float>();
  float* const out = back.data_ptr<float>();
  emu::launch(dim3(1), NTF, [&] {
    const int tid = int(threadIdx.x);
    store_f16_state(rec, S, tid);
    __syncthreads();
    float ht[K / 8][4];
    load_f16_state(ht, rec, tid);
    const HeldLane ln(tid);
    for (int t = 0; t < K / 8; ++t)
      for (int e = 0; e < 4; ++e) out[ln.chan(t, e) * V + ln.col(e)] = ht[t][e];
  });
  return {back, record.narrow(0, kF16StateScales, V / 16).clone()};
}

std::vector<Tensor> run(Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, Tensor b, Tensor h0,
                        Tensor dout, Tensor dht, double scale, Tensor cu, int64_t keep) {
  const int64_t K = r.size(3);  // the launch's constant-K builds (dplr_chunk_launch.cuh)
  auto pick = [K](auto tag) {
    using E = decltype(tag);
    return K == 64 ? run_t<E, 64> : K == 128 ? run_t<E, 128> : run_t<E, 0>;
  };
  auto f = r.scalar_type() == torch::kBFloat16 ? pick(__nv_bfloat16()) : pick(float());
  return f(r, w, k, v, a, b, h0, dout, dht, scale, cu, keep);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run);
  m.def("run_fused", &run_fused);
  m.def("run_single_pass_backward", &run_single_pass_backward);
  m.def("f16_state_roundtrip", &f16_state_roundtrip);
  m.def("set_warp_order", [](int order) { emu::warp_order = order; });
  m.def("set_fused_ctas", [](int ctas) { fused_ctas = ctas; });
}
