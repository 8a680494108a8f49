// tile_mma.cuh's warp products run on the CPU by emu.h: one warp forms A B (A [16][K], B [K][8],
// K a multiple of 16) on TF32 operands (warp_mma) and on fp16 operands scaled by powers of two
// (warp_mma_f16), so that tests/test_cuda_emu.py can hold the second to the first's rounding.
// Also two kernels with a barrier some threads never reach (undefined on a GPU), for emu.h's abort.
#include <torch/extension.h>

#include "emu.h"
#include "tile_mma.cuh"

namespace {
using torch::Tensor;
using namespace fla::tile;

// The warp's largest magnitude of n floats (every lane returns it).
float warp_amax(const float* x, int n) {
  float m = 0.f;
  for (int i = int(threadIdx.x) % 32; i < n; i += 32) m = std::max(m, std::fabs(x[i]));
  for (int o = 16; o > 0; o /= 2) m = std::max(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// [TF32 product, scaled fp16 product, the two scales]
std::vector<Tensor> products(Tensor a, Tensor b) {
  TORCH_CHECK(a.dtype() == torch::kFloat && b.dtype() == torch::kFloat && a.dim() == 2 && b.dim() == 2);
  const int K = int(a.size(1));
  TORCH_CHECK(a.size(0) == 16 && b.size(0) == K && b.size(1) == 8 && K % 16 == 0, "A [16][K], B [K][8]");
  a = a.contiguous(), b = b.contiguous();
  const float* A = a.data_ptr<float>();
  const float* B = b.data_ptr<float>();
  Tensor tf32 = torch::full({16, 8}, NAN), f16 = torch::full({16, 8}, NAN), scales = torch::empty({2});
  float* T = tf32.data_ptr<float>();
  float* F = f16.data_ptr<float>();
  float* S = scales.data_ptr<float>();
  emu::launch(dim3(1), 32, [&] {
    const int g = int(threadIdx.x) / 4, q = int(threadIdx.x) % 4;
    const float sa = pow2_down_scale(warp_amax(A, 16 * K)), sb = pow2_down_scale(warp_amax(B, K * 8));
    auto fa = [&](int r, int k) { return A[r * K + k]; };
    auto fb = [&](int k, int n) { return B[k * 8 + n]; };
    float dt[4] = {}, dh[4] = {};
    warp_mma(dt, K, fa, fb);
    warp_mma_f16(dh, K, fa, fb, sa, sb);
    for (int e = 0; e < 4; ++e) {  // powers of two, one at a time (their product may overflow)
      const int row = g + 8 * (e / 2), col = 2 * q + e % 2;
      T[row * 8 + col] = dt[e], F[row * 8 + col] = dh[e] * (1.f / sa) * (1.f / sb);
    }
    if (threadIdx.x == 0) S[0] = sa, S[1] = sb;
  });
  return {tf32, f16, scales};
}

// Two warps; `warp`: lanes 0-15 of warp 0 wait at __syncwarp for lanes that have returned; else
// warp 0 waits at __syncthreads for warp 1, which has returned. Both abort the process.
void divergent_barrier(bool warp) {
  emu::launch(dim3(1), 64, [&] {
    if (warp) {
      if (threadIdx.x < 16) __syncwarp();
    } else if (threadIdx.x < 32) {
      __syncthreads();
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("products", &products);
  m.def("divergent_barrier", &divergent_barrier);
}
