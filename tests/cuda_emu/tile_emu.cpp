// tile_mma.cuh's warp products run on the CPU by emu.h: one warp forms A B (A [16][K], B [K][8],
// K a multiple of 16) on TF32 operands (warp_mma) and on fp16 operands scaled by powers of two
// (warp_mma_f16), so that tests/test_cuda_emu.py can hold the second to the first's rounding;
// reads such a product's accumulators as the operands of the next (chained), and its operands
// from fp16 tiles in shared memory (shared_products).
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

// tile_mma.cuh's accumulator-to-operand packs (a_from_acc, b_from_acc, a_from_acc_t): P = x y
// (x, y [16][16]) on fp16 tensor cores, held as two m16n8 accumulators, then read where it was
// made: [P, P z, w P[:, :8], w P[:, 8:], P^T z] for z [16][8], w [16][16]; every operand scaled
// by its pow2_down_scale, the scales taken out of each result.
std::vector<Tensor> chained(Tensor x, Tensor y, Tensor z, Tensor w) {
  for (const Tensor& t : {x, y, z, w}) TORCH_CHECK(t.dtype() == torch::kFloat && t.dim() == 2 && t.size(0) == 16);
  TORCH_CHECK(x.size(1) == 16 && y.size(1) == 16 && z.size(1) == 8 && w.size(1) == 16, "x, y, w [16][16], z [16][8]");
  x = x.contiguous(), y = y.contiguous(), z = z.contiguous(), w = w.contiguous();
  const float *X = x.data_ptr<float>(), *Y = y.data_ptr<float>(), *Z = z.data_ptr<float>(), *W = w.data_ptr<float>();
  Tensor P = torch::full({16, 16}, NAN);
  std::vector<Tensor> Q(4);
  for (Tensor& t : Q) t = torch::full({16, 8}, NAN);
  emu::launch(dim3(1), 32, [&] {
    const int g = int(threadIdx.x) / 4, q = int(threadIdx.x) % 4;
    const float sx = pow2_down_scale(warp_amax(X, 256)), sy = pow2_down_scale(warp_amax(Y, 256));
    const float sz = pow2_down_scale(warp_amax(Z, 128)), sw = pow2_down_scale(warp_amax(W, 256));
    float c0[4] = {}, c1[4] = {};
    auto fx = [&](int r, int k) { return X[r * 16 + k]; };
    warp_mma_f16(c0, 16, fx, [&](int k, int n) { return Y[k * 16 + n]; }, sx, sy);
    warp_mma_f16(c1, 16, fx, [&](int k, int n) { return Y[k * 16 + 8 + n]; }, sx, sy);
    float pmax = 0.f;
    for (int e = 0; e < 4; ++e) {
      c0[e] *= (1.f / sx) * (1.f / sy), c1[e] *= (1.f / sx) * (1.f / sy);
      pmax = std::max(pmax, std::max(std::fabs(c0[e]), std::fabs(c1[e])));
    }
    for (int o = 16; o > 0; o /= 2) pmax = std::max(pmax, __shfl_xor_sync(0xffffffffu, pmax, o));
    const float sp = pow2_down_scale(pmax);
    const int q2 = 2 * q;
    const F16B zb{{f16_pair(sz * Z[q2 * 8 + g], sz * Z[(q2 + 1) * 8 + g]),
                   f16_pair(sz * Z[(q2 + 8) * 8 + g], sz * Z[(q2 + 9) * 8 + g])}};
    auto wp = [&](int r, int k) { return f16_pair(sw * W[r * 16 + k], sw * W[r * 16 + k + 1]); };
    const F16A wa{{wp(g, q2), wp(g + 8, q2), wp(g, q2 + 8), wp(g + 8, q2 + 8)}};
    float out[4][4] = {};
    mma_f16(out[0], a_from_acc(c0, c1, sp), zb);
    mma_f16(out[1], wa, b_from_acc(c0, sp));
    mma_f16(out[2], wa, b_from_acc(c1, sp));
    mma_f16(out[3], a_from_acc_t(c0, c1, sp), zb);
    // the scales out one at a time (their product may overflow)
    const float ua[4] = {1.f / sp, 1.f / sw, 1.f / sw, 1.f / sp}, ub[4] = {1.f / sz, 1.f / sp, 1.f / sp, 1.f / sz};
    float* const p = P.data_ptr<float>();
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e / 2), col = q2 + e % 2;
      p[row * 16 + col] = c0[e], p[row * 16 + 8 + col] = c1[e];
      for (int i = 0; i < 4; ++i) Q[size_t(i)].data_ptr<float>()[row * 8 + col] = out[i][e] * ua[i] * ub[i];
    }
  });
  return {P, Q[0], Q[1], Q[2], Q[3]};
}

// tile_mma.cuh's operand loads from fp16 tiles in shared memory (ldmatrix): x, y [16][16] stored
// as fp16 at a row stride of 24, then [x y, x^T y, x y^T] from a_from_mk, a_from_km, b_from_kn,
// b_from_nk (no scales: the test's values are exact in fp16).
std::vector<Tensor> shared_products(Tensor x, Tensor y) {
  for (const Tensor& t : {x, y}) TORCH_CHECK(t.dtype() == torch::kFloat && t.dim() == 2 && t.size(0) == 16 && t.size(1) == 16);
  x = x.contiguous(), y = y.contiguous();
  const float *X = x.data_ptr<float>(), *Y = y.data_ptr<float>();
  constexpr int ld = 24;
  alignas(16) static __half tx[16 * ld], ty[16 * ld];
  std::vector<Tensor> out(3);
  for (Tensor& t : out) t = torch::full({16, 16}, NAN);
  emu::launch(dim3(1), 32, [&] {
    const int g = int(threadIdx.x) / 4, q = int(threadIdx.x) % 4;
    for (int e = int(threadIdx.x); e < 256; e += 32)
      tx[e / 16 * ld + e % 16] = __float2half_rn(X[e]), ty[e / 16 * ld + e % 16] = __float2half_rn(Y[e]);
    __syncwarp();
    F16B ykn[2], ynk[2];
    b_from_kn(ykn, ty, ld), b_from_nk(ynk, ty, ld);
    const F16A xmk = a_from_mk(tx, ld), xkm = a_from_km(tx, ld);
    float d[3][2][4] = {};
    for (int n = 0; n < 2; ++n) {
      mma_f16(d[0][n], xmk, ykn[n]);
      mma_f16(d[1][n], xkm, ykn[n]);
      mma_f16(d[2][n], xmk, ynk[n]);
    }
    for (int i = 0; i < 3; ++i)
      for (int n = 0; n < 2; ++n)
        for (int e = 0; e < 4; ++e)
          out[size_t(i)].data_ptr<float>()[(g + 8 * (e / 2)) * 16 + 8 * n + 2 * q + e % 2] = d[i][n][e];
  });
  return out;
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
  m.def("chained", &chained);
  m.def("shared_products", &shared_products);
  m.def("divergent_barrier", &divergent_barrier);
}
