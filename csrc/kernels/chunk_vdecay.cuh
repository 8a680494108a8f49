// CUDA chunk engine for a value-side decay alone (kernels/chunk.h `gv` with `g` off; GLA reader):
//   h_t = h_{t-1} diag(exp(gv_t)) + k_t v_t^T,   o_t = ρ h_t^T q_t      (GSA pass 1, §7.1)
//
// No new kernels: the value-side problem is the key-side one (chunk.cuh) transposed. With
// S' = Sᵀ [V x K] the state pass is S'⁺ = diag(γv) S' + (V ⊙ e^{Ωv})ᵀ K, i.e. the key-side pass
// with (k, v, g) := (v, k, gv), and every quantity of §7.1/§7.2 is one the key-side kernels
// already compute for the transposed pass P' = (q: dO, k: v, v: k, dout: q, g: gv, K: V, V: K):
//   forward   o   = the grad_qk kernel's dq of P'      (ρ e^{Gv_i} ⊙ (Q S)_i + Σ_j P_ij v_j e^{Gv_i−Gv_j},
//                                                      P = ρ tril(Q Kᵀ) = P's dA)
//   backward  dk  = the dv of P' (out kernel, DV)      (V̂ dS⁺ᵀ + Σ_i dP_ij q_i, dP = ρ A'ᵀ)
//             dq  = the o of P' (out kernel)           (ρ (dO ⊙ e^{Gv}) Sᵀ + Σ_j dP_ij k_j)
//             dv  = the dk of P', dgv = the dg of P'   (revcumsum(o ⊙ dO − v ⊙ dv) + colsum(S⁺⊙dS⁺),
//                                                      with o recomputed in fp32 as P''s dq)
// so the §2.6 additive exponents, the §1.2 sub-chunk references and the exact dg resets carry
// over unchanged. The workspaces hold the transposed states: hst/dhst [slots, H, V, K] (same
// size), zeta [slots, H, ceil(K / kStateCols), V] (ops/chunk_gla_rwkv6.cpp sizes them).
#pragma once
#include "chunk_launch.cuh"

namespace fla {
namespace chunk_detail {

template <typename T>
cudaError_t launch_chunk_vdecay(const ChunkPass& p, cudaStream_t stream) {
  constexpr Reader RD = Reader::Inclusive;
  const int64_t slots = chunk_slots(p.N, p.T, p.cu_seqlens != nullptr);
  const ChunkPass r = value_side_as_key_side(p);
  const int ntk = (r.K + DT - 1) / DT, nts = (r.V + kStateCols - 1) / kStateCols;
  cudaError_t e;
  // The backward runs P' with q' = dO: its pair matrices are A' (of dO and v), read by the
  // dk / dq out kernels below; the forward needs none. The states do not depend on q': a
  // training forward keeps them for the backward (hst_kept).
  if (p.dout.on() && (e = launch_pairs<T, RD>(r, slots, stream)) != cudaSuccess) return e;
  if (!p.hst_kept && (e = launch_state<T, RD, false, 1>(r, stream)) != cudaSuccess) return e;
  if (!p.dout.on()) {  // o = dq of P', by the grad_qk kernel's dq-only form
    auto o = chunk_grad_qk_kernel<T, RD, true>;
    if ((e = set_smem(o, kGradSmem)) != cudaSuccess) return e;
    const ChunkPass f = value_side_forward_as_key_side(p);
    if (slots > 0) o<<<dim3(unsigned(slots), r.H, ntk), NTH, kGradSmem, stream>>>(f, 0, grad_qk_vec<T>(f));
    return cudaGetLastError();
  }
  auto dqk = chunk_grad_qk_kernel<T, RD>;
  if ((e = set_smem(dqk, kGradSmem)) != cudaSuccess) return e;
  if ((e = launch_backward_state<T, RD>(r, stream)) != cudaSuccess) return e;
  const ChunkPass b = value_side_grads_as_key_side(p);
  if (p.dk.on() && (e = launch_out<T, RD, true>(b, slots, stream)) != cudaSuccess) return e;
  if (p.dq.on() && (e = launch_out<T, RD, false>(b, slots, stream)) != cudaSuccess) return e;
  if (slots > 0) dqk<<<dim3(unsigned(slots), r.H, ntk), NTH, kGradSmem, stream>>>(b, nts, grad_qk_vec<T>(b));
  return cudaGetLastError();
}

}  // namespace chunk_detail

// The chunk engine's entry for a value-side decay (alone); the key-side one is launch_chunk.
template <typename T>
cudaError_t launch_chunk_vdecay(const ChunkPass& p, cudaStream_t stream) {
  return chunk_detail::launch_chunk_vdecay<T>(p, stream);
}

}  // namespace fla
