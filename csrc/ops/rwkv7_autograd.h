// The autograd Function of both RWKV7 ops (fused recurrent and chunked): forward and backward are
// dispatcher calls of the op pair that `Ops` names, so that torch.compile traces them like any
// other op. Ops::fwd / Ops::bwd take fused_recurrent_rwkv7's arguments (the chunked op has no
// `reverse` and drops it); Ops::fwd(train, ..) returns (o, final state, workspace): what a
// recording forward keeps for the backward (chunked on CUDA: `saved`, the chunk-start states and
// prep's workspace; undefined otherwise), handed to Ops::bwd.
#pragma once
#include <torch/autograd.h>

#include "autograd_state.h"
#include "rwkv7.h"

namespace fla::ops {

template <class Ops>
class Rwkv7Function : public torch::autograd::Function<Rwkv7Function<Ops>> {
 public:
  using Ctx = torch::autograd::AutogradContext;
  using List = torch::autograd::variable_list;

  static List forward(Ctx* ctx, const Tensor& r, const Tensor& w, const Tensor& k,
                      const Tensor& v, const Tensor& a, const Tensor& b,
                      std::optional<double> scale, const std::optional<Tensor>& initial_state,
                      bool output_final_state, bool reverse,
                      const std::optional<Tensor>& cu_seqlens, bool head_first, bool train) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [o, hT, ws] = Ops::fwd(train, r, w, k, v, a, b, scale, initial_state, output_final_state,
                                reverse, cu_seqlens, head_first);
    ctx->save_for_backward({r, w, k, v, a, b, opt(initial_state), opt(cu_seqlens), ws});
    SweepFlags{scale, reverse, head_first, output_final_state}.save(ctx);
    if (!output_final_state) ctx->mark_non_differentiable({hT});
    return {o, hT};
  }

  static List backward(Ctx* ctx, List grads) {
    return first_order_backward(Ops::name, ctx, grads, [&]() -> List {
      const auto s = ctx->get_saved_variables();
      const auto f = SweepFlags::load(ctx);
      Tensor go = grads[0].defined() ? grads[0] : at::zeros_like(s[3]);
      auto [dr, dw, dk, dv, da, db, dh0] = Ops::bwd(s[0], s[1], s[2], s[3], s[4], s[5], go,
                                                    f.dht(grads), f.scale, some(s[6]), f.reverse,
                                                    some(s[7]), f.head_first, s[8]);
      // One entry per forward argument: r .. b, scale, initial_state, output_final_state, reverse,
      // cu_seqlens, head_first, train.
      return {dr, dw, dk, dv, da, db, Tensor(), s[6].defined() ? dh0 : Tensor(),
              Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    });
  }
};

}  // namespace fla::ops
