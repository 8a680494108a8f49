// fla_ext from a LibTorch program: random RWKV6 inputs, the fused recurrent op forward, and its
// backward through autograd; then a GatedSlotAttention layer's op sequence, forward and backward. Runs on CUDA when a GPU is there and fla_ext was built with its CUDA
// kernels (-DFLA_EXT_CUDA=ON), else on the CPU. See README.md beside this file for the build.
#include <torch/torch.h>

#include <fla_ext/fla_ext.h>

#include <iostream>

int main() {
  // The op's CUDA kernel exists only in a FLA_EXT_CUDA build; ask the dispatcher.
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fla::fused_recurrent_rwkv6", "");
  const bool cuda =
      torch::cuda::is_available() && op.hasKernelForDispatchKey(c10::DispatchKey::CUDA);
  const torch::Device device = cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);

  const int64_t B = 2, T = 64, H = 4, K = 32, V = 32;
  torch::manual_seed(0);
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device).requires_grad(true);
  auto r = torch::randn({B, T, H, K}, opts);
  auto k = torch::randn({B, T, H, K}, opts);
  auto v = torch::randn({B, T, H, V}, opts);
  // w is a log decay (<= 0): exp(w) multiplies the state at every step.
  auto w = torch::nn::functional::logsigmoid(torch::randn({B, T, H, K}, opts.requires_grad(false)))
               .requires_grad_(true);
  auto u = torch::randn({H, K}, opts);
  auto h0 = torch::randn({B, H, K, V}, opts);  // initial state, float32

  auto [o, hT] = fla_ext::fused_recurrent_rwkv6(r, k, v, w, u, /*scale=*/std::nullopt, h0,
                                                /*output_final_state=*/true);
  (o.square().sum() + hT.sum()).backward();

  std::cout << "device: " << device << "\n";
  std::cout << "o: " << o.sizes() << ", final_state: " << hT.sizes() << "\n";
  for (auto [name, t] : {std::pair<const char*, torch::Tensor>{"r", r}, {"k", k}, {"v", v},
                         {"w", w}, {"u", u}, {"initial_state", h0}})
    std::cout << "|d" << name << "| = " << t.grad().norm().item<double>() << "\n";

  // A layer's op sequence: GatedSlotAttention's forward (fla_ext/layers/gsa.py) with LibTorch
  // modules around fla_ext::chunk_gsa, then the backward into every weight.
  const int64_t C = 64, HG = 4, M = 16, D = C / HG, L = 100;
  torch::nn::Linear q_proj(torch::nn::LinearOptions(C, C).bias(false)),
      k_proj(torch::nn::LinearOptions(C, C).bias(false)),
      v_proj(torch::nn::LinearOptions(C, C).bias(false)),
      f_proj(torch::nn::LinearOptions(C, HG * M).bias(false)),
      o_proj(torch::nn::LinearOptions(C, C).bias(false));
  auto norm_w = torch::ones({C}, torch::TensorOptions().requires_grad(true));
  std::vector<torch::nn::Linear> projs = {q_proj, k_proj, v_proj, f_proj, o_proj};
  for (auto& m : projs) m->to(device);
  norm_w = norm_w.to(device).detach().requires_grad_(true);
  auto x = torch::randn({B, L, C}, torch::TensorOptions().device(device));
  auto heads = [&](const torch::Tensor& t, int64_t d) { return t.view({B, L, HG, d}); };
  auto q = torch::silu(heads(q_proj(x), D)), kk = torch::silu(heads(k_proj(x), D));
  auto vv = torch::silu(heads(v_proj(x), D));
  auto f = torch::log_sigmoid(heads(f_proj(x), M)) / 8;  // log forget gate over the slots
  auto s = 1 - f.exp();
  auto [og, hk, hv] = fla_ext::chunk_gsa(q, kk, vv, s, f, /*scale=*/1.0);
  auto y = torch::silu(og.reshape({B, L, C}));
  y = y * torch::rsqrt(y.square().mean(-1, true) + 1e-5) * norm_w;  // RMSNorm
  auto out = o_proj(y);
  out.square().mean().backward();
  std::cout << "GSA layer ops: out " << out.sizes() << "\n";
  const char* names[] = {"q_proj", "k_proj", "v_proj", "f_proj", "o_proj"};
  for (size_t i = 0; i < projs.size(); ++i)
    std::cout << "|d " << names[i] << ".weight| = " << projs[i]->weight.grad().norm().item<double>()
              << "\n";
  std::cout << "|d g_norm.weight| = " << norm_w.grad().norm().item<double>() << "\n";
  return 0;
}
