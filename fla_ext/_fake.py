"""Fake (meta) kernels: shapes and dtypes of every op's outputs, for torch.compile and opcheck."""
import torch


def _acc(r):
    return torch.float64 if r.dtype == torch.float64 else torch.float32


def _state_rows(r, head_first, cu_seqlens):
    B, H = (r.shape[0], r.shape[1]) if head_first else (r.shape[0], r.shape[2])
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    return N, H


@torch.library.register_fake("fla::fused_recurrent_rwkv6")
def _(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False, reverse=False,
      cu_seqlens=None, head_first=False):
    N, H = _state_rows(r, head_first, cu_seqlens)
    K, V = r.shape[-1], v.shape[-1]
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    shape = (N if output_final_state else 0, H, K, V)
    return o, r.new_empty(shape, dtype=_acc(r))


@torch.library.register_fake("fla::fused_recurrent_rwkv6_bwd")
def _(r, k, v, w, u, grad_o, grad_final_state, scale, initial_state, reverse, cu_seqlens,
      head_first):
    N, H = _state_rows(r, head_first, cu_seqlens)
    K, V = r.shape[-1], v.shape[-1]
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    dh0 = r.new_empty((N if initial_state is not None else 0, H, K, V), dtype=_acc(r))
    return like(r), like(k), like(v), like(w), u.new_empty(u.shape), dh0


@torch.library.register_fake("fla::fused_recurrent_gla")
def _(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
      reverse=False, cu_seqlens=None, head_first=False):
    N, H = _state_rows(q, head_first, cu_seqlens)
    # o has q's dtype (float32 for a wide q: float32 q with bf16/fp16 k, v)
    o = torch.empty_like(v, dtype=q.dtype, memory_format=torch.contiguous_format)
    shape = (N if output_final_state else 0, H, q.shape[-1], v.shape[-1])
    return o, q.new_empty(shape, dtype=_acc(q))


@torch.library.register_fake("fla::fused_recurrent_gla_bwd")
def _(q, k, v, gk, gv, grad_o, grad_final_state, scale, initial_state, reverse, cu_seqlens,
      head_first):
    N, H = _state_rows(q, head_first, cu_seqlens)
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    dgk = like(gk) if gk is not None else q.new_empty((0,))
    dgv = like(gv) if gv is not None else q.new_empty((0,))
    dh0 = q.new_empty((N if initial_state is not None else 0, H, q.shape[-1], v.shape[-1]),
                      dtype=_acc(q))
    return like(q), like(k), like(v), dgk, dgv, dh0


@torch.library.register_fake("fla::chunk_gla")
def _chunk_gla_fake(q, k, v, g=None, gv=None, scale=None, initial_state=None,
                    output_final_state=False, cu_seqlens=None, head_first=False):
    N, H = _state_rows(q, head_first, cu_seqlens)
    # o has q's dtype (float32 for a wide q: float32 q with bf16/fp16 k, v)
    o = torch.empty_like(v, dtype=q.dtype, memory_format=torch.contiguous_format)
    shape = (N if output_final_state else 0, H, q.shape[-1], v.shape[-1])
    return o, q.new_empty(shape, dtype=_acc(q))


def _chunk_train(q, v, o, ht, head_first, cu_seqlens, pairs=True):
    """The training forward's outputs: (o, ht) plus the workspaces the CUDA backend keeps: hst,
    and the pair matrices for key-side passes (`pairs` is False for a value-side decay)."""
    if q.device.type != "cuda":
        return o, ht, q.new_empty((0,), dtype=_acc(q)), q.new_empty((0,), dtype=_acc(q))
    hst = _states(q, v, head_first, cu_seqlens, 64)
    return o, ht, hst, q.new_empty((hst.shape[0], hst.shape[1], 64, 64) if pairs else (0,),
                                   dtype=_acc(q))


def _states(q, v, head_first, cu_seqlens, C):
    """The chunk-start states workspace of C-row chunks, [slots, H, K, V] (kernels/chunk.h
    chunk_slots)."""
    N, H = _state_rows(q, head_first, cu_seqlens)
    T = q.shape[2] if head_first else q.shape[1]
    if cu_seqlens is not None:
        slots = (q.shape[0] * T) // C + 2 * N + 1
    else:
        slots = N * ((T + C - 1) // C + 1)
    return q.new_empty((slots, H, q.shape[-1], v.shape[-1]), dtype=_acc(q))


@torch.library.register_fake("fla::chunk_gla_train")
def _(q, k, v, g, gv, scale, initial_state, output_final_state, cu_seqlens, head_first):
    o, ht = _chunk_gla_fake(q, k, v, g, gv, scale, initial_state, output_final_state, cu_seqlens,
                            head_first)
    return _chunk_train(q, v, o, ht, head_first, cu_seqlens, pairs=gv is None)


@torch.library.register_fake("fla::chunk_gla_bwd")
def _(q, k, v, g, gv, grad_o, grad_final_state, scale, initial_state, cu_seqlens, head_first,
      hst=None, amat=None):
    N, H = _state_rows(q, head_first, cu_seqlens)
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    dh0 = q.new_empty((N if initial_state is not None else 0, H, q.shape[-1], v.shape[-1]),
                      dtype=_acc(q))
    dg = like(g) if g is not None else q.new_empty((0,))
    dgv = like(gv) if gv is not None else q.new_empty((0,))
    return like(q), like(k), like(v), dg, dgv, dh0


@torch.library.register_fake("fla::chunk_rwkv6")
def _chunk_rwkv6_fake(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
      head_first=False):
    N, H = _state_rows(r, head_first, cu_seqlens)
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    shape = (N if output_final_state else 0, H, r.shape[-1], v.shape[-1])
    return o, r.new_empty(shape, dtype=_acc(r))


@torch.library.register_fake("fla::chunk_rwkv6_train")
def _(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, head_first):
    o, ht = _chunk_rwkv6_fake(r, k, v, w, u, scale, initial_state, output_final_state,
                              cu_seqlens, head_first)
    return _chunk_train(r, v, o, ht, head_first, cu_seqlens)


@torch.library.register_fake("fla::chunk_rwkv6_bwd")
def _(r, k, v, w, u, grad_o, grad_final_state, scale, initial_state, cu_seqlens, head_first,
      hst=None, amat=None):
    N, H = _state_rows(r, head_first, cu_seqlens)
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    dh0 = r.new_empty((N if initial_state is not None else 0, H, r.shape[-1], v.shape[-1]),
                      dtype=_acc(r))
    return like(r), like(k), like(v), like(w), u.new_empty(u.shape), dh0


@torch.library.register_fake("fla::fused_recurrent_rwkv7")
def _(r, w, k, v, a, b, scale=None, initial_state=None, output_final_state=True, reverse=False,
      cu_seqlens=None, head_first=False):
    N, H = _state_rows(r, head_first, cu_seqlens)
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    shape = (N if output_final_state else 0, H, r.shape[-1], v.shape[-1])
    return o, r.new_empty(shape, dtype=_acc(r))


@torch.library.register_fake("fla::chunk_rwkv7")
def _chunk_rwkv7_fake(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False,
                      cu_seqlens=None, head_first=False):
    N, H = _state_rows(r, head_first, cu_seqlens)
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    shape = (N if output_final_state else 0, H, r.shape[-1], v.shape[-1])
    return o, r.new_empty(shape, dtype=_acc(r))


@torch.library.register_fake("fla::chunk_rwkv7_train")
def _(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, head_first):
    """(o, ht) and what the CUDA backend keeps, `saved` (fp32, flat; empty elsewhere): the
    chunk-start states of 16-row chunks, padded to a multiple of 4 floats, then the per-chunk
    workspace (ops/chunk_rwkv7.cpp saved_floats, kernels/dplr_chunk.h DplrWs)."""
    o, ht = _chunk_rwkv7_fake(r, w, k, v, a, b, scale, initial_state, output_final_state,
                              cu_seqlens, head_first)
    if r.device.type != "cuda":
        return o, ht, r.new_empty((0,), dtype=torch.float32)
    slots, H, K, V = _states(r, v, head_first, cu_seqlens, 16).shape
    kp4, ks = (K + 3) // 4 * 4, (K + 31) // 32 * 32
    # W, Q~, K^, B^ [16][ks], gamma, the pair matrices and X [5][16][20] (U0 / O0 are not kept)
    per = 4 * 16 * ks + kp4 + 5 * 16 * 20
    states = (slots * H * K * V + 3) // 4 * 4
    return o, ht, r.new_empty((states + slots * H * per,), dtype=torch.float32)


@torch.library.register_fake("fla::chunk_rwkv7_bwd")
def _(r, w, k, v, a, b, grad_o, grad_final_state, scale, initial_state, cu_seqlens, head_first,
      saved=None):
    N, H = _state_rows(r, head_first, cu_seqlens)
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    dh0 = r.new_empty((N if initial_state is not None else 0, H, r.shape[-1], v.shape[-1]),
                      dtype=_acc(r))
    return like(r), like(w), like(k), like(v), like(a), like(b), dh0


@torch.library.register_fake("fla::fused_recurrent_rwkv7_bwd")
def _(r, w, k, v, a, b, grad_o, grad_final_state, scale, initial_state, reverse, cu_seqlens,
      head_first):
    N, H = _state_rows(r, head_first, cu_seqlens)
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    dh0 = r.new_empty((N if initial_state is not None else 0, H, r.shape[-1], v.shape[-1]),
                      dtype=_acc(r))
    return like(r), like(w), like(k), like(v), like(a), like(b), dh0


@torch.library.register_fake("fla::chunk_gsa_core")
def _chunk_gsa_core_fake(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens,
                         head_first):
    N, H = _state_rows(q, head_first, cu_seqlens)
    K, V, M = q.shape[-1], v.shape[-1], s.shape[-1]
    n = N if output_final_state else 0
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    return o, q.new_empty((n, H, K, M), dtype=_acc(q)), q.new_empty((n, H, M, V), dtype=_acc(q))


@torch.library.register_fake("fla::chunk_gsa_core_train")
def _(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens, head_first):
    o, hk, hv = _chunk_gsa_core_fake(q, k, v, s, g, scale, hk0, hv0, output_final_state,
                                     cu_seqlens, head_first)
    p = torch.empty_like(s, dtype=_acc(q), memory_format=torch.contiguous_format)
    hst1 = _chunk_train(q, s, o, hk, head_first, cu_seqlens, pairs=False)[2]  # value-side pass
    _, _, hst2, amat2 = _chunk_train(s, v, o, hv, head_first, cu_seqlens)
    return o, hk, hv, p, hst1, hst2, amat2


@torch.library.register_fake("fla::chunk_gsa_core_bwd")
def _(q, k, v, s, g, p, grad_o, grad_hk, grad_hv, scale, hk0, hv0, cu_seqlens, head_first,
      hst1=None, hst2=None, amat2=None):
    N, H = _state_rows(q, head_first, cu_seqlens)
    K, V, M = q.shape[-1], v.shape[-1], s.shape[-1]
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    dhk0 = q.new_empty((N if hk0 is not None else 0, H, K, M), dtype=_acc(q))
    dhv0 = q.new_empty((N if hv0 is not None else 0, H, M, V), dtype=_acc(q))
    return like(q), like(k), like(v), like(s), like(g), dhk0, dhv0
