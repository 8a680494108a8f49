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
      "Tensor? cu_seqlens, bool head_first) "
      "-> (Tensor dr, Tensor dw, Tensor dk, Tensor dv, Tensor da, Tensor db, Tensor dh0)");
  // Gated Slot Attention: composites of the two GLA passes (ops/gsa.cpp). States: hk [N, H, K, M],
  // hv [N, H, M, V], per key head.
  m.def(
      "chunk_gsa(Tensor q, Tensor k, Tensor v, Tensor s, Tensor? g=None, float? scale=None, "
      "Tensor? hk0=None, Tensor? hv0=None, bool output_final_state=False, Tensor? cu_seqlens=None, "
      "bool head_first=False) -> (Tensor o, Tensor hk, Tensor hv)");
  m.def(
      "fused_recurrent_gsa(Tensor q, Tensor k, Tensor v, Tensor s, Tensor? g=None, "
      "float? scale=None, Tensor? hk0=None, Tensor? hv0=None, bool output_final_state=False, "
      "bool reverse=False, Tensor? cu_seqlens=None, bool head_first=False) "
      "-> (Tensor o, Tensor hk, Tensor hv)");
}
