// Every fla_ext schema, in one place. Backends register kernels in cpu/ and cuda/; the
// Autograd kernels live next to each family in ops/; fake kernels in fla_ext/_fake.py.
#include <torch/library.h>

TORCH_LIBRARY(fla, m) {
  m.def(
      "fused_recurrent_rwkv6(Tensor r, Tensor k, Tensor v, Tensor w, Tensor u, float? scale=None, "
      "Tensor? initial_state=None, bool output_final_state=False, bool reverse=False, "
      "Tensor? cu_seqlens=None, bool head_first=False) -> (Tensor o, Tensor final_state)");
  m.def(
      "fused_recurrent_rwkv6_bwd(Tensor r, Tensor k, Tensor v, Tensor w, Tensor u, Tensor grad_o, "
      "Tensor? grad_final_state, float? scale, Tensor? initial_state, bool reverse, "
      "Tensor? cu_seqlens, bool head_first) "
      "-> (Tensor dr, Tensor dk, Tensor dv, Tensor dw, Tensor du, Tensor dh0)");
  m.def(
      "fused_recurrent_gla(Tensor q, Tensor k, Tensor v, Tensor? gk=None, Tensor? gv=None, "
      "float? scale=None, Tensor? initial_state=None, bool output_final_state=False, "
      "bool reverse=False, Tensor? cu_seqlens=None, bool head_first=False) "
      "-> (Tensor o, Tensor final_state)");
  m.def(
      "fused_recurrent_gla_bwd(Tensor q, Tensor k, Tensor v, Tensor? gk, Tensor? gv, "
      "Tensor grad_o, Tensor? grad_final_state, float? scale, Tensor? initial_state, "
      "bool reverse, Tensor? cu_seqlens, bool head_first) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dgk, Tensor dgv, Tensor dh0)");
  m.def(
      "chunk_gla(Tensor q, Tensor k, Tensor v, Tensor? g=None, Tensor? gv=None, float? scale=None, "
      "Tensor? initial_state=None, bool output_final_state=False, Tensor? cu_seqlens=None, "
      "bool head_first=False) -> (Tensor o, Tensor final_state)");
  m.def(
      "chunk_gla_bwd(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? gv, Tensor grad_o, "
      "Tensor? grad_final_state, float? scale, Tensor? initial_state, Tensor? cu_seqlens, "
      "bool head_first, Tensor? hst=None, Tensor? amat=None) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dgv, Tensor dh0)");
  // The training forwards: chunk_gla / chunk_rwkv6 plus the workspaces their backward can reuse
  // (chunk-start states, pair matrices; empty where the backend keeps none). Autograd calls them.
  m.def(
      "chunk_gla_train(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? gv, float? scale, "
      "Tensor? initial_state, bool output_final_state, Tensor? cu_seqlens, bool head_first) "
      "-> (Tensor o, Tensor final_state, Tensor hst, Tensor amat)");
  m.def(
      "chunk_rwkv6(Tensor r, Tensor k, Tensor v, Tensor w, Tensor u, float? scale=None, "
      "Tensor? initial_state=None, bool output_final_state=False, Tensor? cu_seqlens=None, "
      "bool head_first=False) -> (Tensor o, Tensor final_state)");
  m.def(
      "chunk_rwkv6_bwd(Tensor r, Tensor k, Tensor v, Tensor w, Tensor u, Tensor grad_o, "
      "Tensor? grad_final_state, float? scale, Tensor? initial_state, Tensor? cu_seqlens, "
      "bool head_first, Tensor? hst=None, Tensor? amat=None) "
      "-> (Tensor dr, Tensor dk, Tensor dv, Tensor dw, Tensor du, Tensor dh0)");
  m.def(
      "chunk_rwkv6_train(Tensor r, Tensor k, Tensor v, Tensor w, Tensor u, float? scale, "
      "Tensor? initial_state, bool output_final_state, Tensor? cu_seqlens, bool head_first) "
      "-> (Tensor o, Tensor final_state, Tensor hst, Tensor amat)");
  m.def(
      "fused_recurrent_rwkv7(Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, Tensor b, "
      "float? scale=None, Tensor? initial_state=None, bool output_final_state=True, "
      "bool reverse=False, Tensor? cu_seqlens=None, bool head_first=False) "
      "-> (Tensor o, Tensor final_state)");
  m.def(
      "fused_recurrent_rwkv7_bwd(Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, Tensor b, "
      "Tensor grad_o, Tensor? grad_final_state, float? scale, Tensor? initial_state, bool reverse, "
      "Tensor? cu_seqlens, bool head_first) "
      "-> (Tensor dr, Tensor dw, Tensor dk, Tensor dv, Tensor da, Tensor db, Tensor dh0)");
  m.def(
      "chunk_rwkv7(Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, Tensor b, "
      "float? scale=1.0, Tensor? initial_state=None, bool output_final_state=False, "
      "Tensor? cu_seqlens=None, bool head_first=False) -> (Tensor o, Tensor final_state)");
  m.def(
      "chunk_rwkv7_bwd(Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, Tensor b, "
      "Tensor grad_o, Tensor? grad_final_state, float? scale, Tensor? initial_state, "
      "Tensor? cu_seqlens, bool head_first, Tensor? saved=None) "
      "-> (Tensor dr, Tensor dw, Tensor dk, Tensor dv, Tensor da, Tensor db, Tensor dh0)");
  // chunk_rwkv7's training forward: also what its backward can reuse, `saved` (CUDA: the
  // chunk-start states and the per-chunk workspace, fp32, flat; empty on the CPU).
  m.def(
      "chunk_rwkv7_train(Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, Tensor b, "
      "float? scale, Tensor? initial_state, bool output_final_state, Tensor? cu_seqlens, "
      "bool head_first) -> (Tensor o, Tensor final_state, Tensor saved)");
  // Gated Slot Attention: composites of the two GLA passes (ops/gsa.cpp). States: hk [N, H, K, M],
  // hv [N, H, M, V], per key head.
  m.def(
      "chunk_gsa(Tensor q, Tensor k, Tensor v, Tensor s, Tensor? g=None, float? scale=None, "
      "Tensor? hk0=None, Tensor? hv0=None, bool output_final_state=False, Tensor? cu_seqlens=None, "
      "bool head_first=False) -> (Tensor o, Tensor hk, Tensor hv)");
  // chunk_gsa's core (ops/gsa.h): both passes and the softmax with its own backward; q has the
  // heads of k (grouped heads are repeated by chunk_gsa), g is required (chunk_gsa forms fla's
  // g=None gate). The training forward also returns the float32 softmax p and the workspaces.
  m.def(
      "chunk_gsa_core(Tensor q, Tensor k, Tensor v, Tensor s, Tensor g, float? scale, Tensor? hk0, "
      "Tensor? hv0, bool output_final_state, Tensor? cu_seqlens, bool head_first) "
      "-> (Tensor o, Tensor hk, Tensor hv)");
  m.def(
      "chunk_gsa_core_train(Tensor q, Tensor k, Tensor v, Tensor s, Tensor g, float? scale, "
      "Tensor? hk0, Tensor? hv0, bool output_final_state, Tensor? cu_seqlens, bool head_first) "
      "-> (Tensor o, Tensor hk, Tensor hv, Tensor p, Tensor hst1, Tensor hst2, Tensor amat2)");
  m.def(
      "chunk_gsa_core_bwd(Tensor q, Tensor k, Tensor v, Tensor s, Tensor g, Tensor p, "
      "Tensor grad_o, Tensor? grad_hk, Tensor? grad_hv, float? scale, Tensor? hk0, Tensor? hv0, "
      "Tensor? cu_seqlens, bool head_first, Tensor? hst1, Tensor? hst2, Tensor? amat2) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor ds, Tensor dg, Tensor dhk0, Tensor dhv0)");
  m.def(
      "fused_recurrent_gsa(Tensor q, Tensor k, Tensor v, Tensor s, Tensor? g=None, "
      "float? scale=None, Tensor? hk0=None, Tensor? hv0=None, bool output_final_state=False, "
      "bool reverse=False, Tensor? cu_seqlens=None, bool head_first=False) "
      "-> (Tensor o, Tensor hk, Tensor hv)");
}
