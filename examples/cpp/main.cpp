// fla_ext from a LibTorch program: random RWKV6 inputs, the fused recurrent op forward, and its
// backward through autograd. Runs on CUDA when a GPU is there and fla_ext was built with its CUDA
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
  return 0;
}
