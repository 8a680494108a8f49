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
def _(q, k, v, gk=None, scale=None, initial_state=None, output_final_state=False, reverse=False,
      cu_seqlens=None, head_first=False):
    N, H = _state_rows(q, head_first, cu_seqlens)
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    shape = (N if output_final_state else 0, H, q.shape[-1], v.shape[-1])
    return o, q.new_empty(shape, dtype=_acc(q))


@torch.library.register_fake("fla::fused_recurrent_gla_bwd")
def _(q, k, v, gk, grad_o, grad_final_state, scale, initial_state, reverse, cu_seqlens, head_first):
    N, H = _state_rows(q, head_first, cu_seqlens)
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    dg = like(gk) if gk is not None else q.new_empty((0,))
    dh0 = q.new_empty((N if initial_state is not None else 0, H, q.shape[-1], v.shape[-1]),
                      dtype=_acc(q))
    return like(q), like(k), like(v), dg, dh0


@torch.library.register_fake("fla::chunk_gla")
def _(q, k, v, g=None, gv=None, scale=None, initial_state=None, output_final_state=False,
      cu_seqlens=None, head_first=False):
    N, H = _state_rows(q, head_first, cu_seqlens)
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    shape = (N if output_final_state else 0, H, q.shape[-1], v.shape[-1])
    return o, q.new_empty(shape, dtype=_acc(q))


@torch.library.register_fake("fla::chunk_gla_bwd")
def _(q, k, v, g, gv, grad_o, grad_final_state, scale, initial_state, cu_seqlens, head_first):
    N, H = _state_rows(q, head_first, cu_seqlens)
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    dh0 = q.new_empty((N if initial_state is not None else 0, H, q.shape[-1], v.shape[-1]),
                      dtype=_acc(q))
    dg = like(g) if g is not None else q.new_empty((0,))
    dgv = like(gv) if gv is not None else q.new_empty((0,))
    return like(q), like(k), like(v), dg, dgv, dh0


@torch.library.register_fake("fla::chunk_rwkv6")
def _(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
      head_first=False):
    N, H = _state_rows(r, head_first, cu_seqlens)
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    shape = (N if output_final_state else 0, H, r.shape[-1], v.shape[-1])
    return o, r.new_empty(shape, dtype=_acc(r))


@torch.library.register_fake("fla::chunk_rwkv6_bwd")
def _(r, k, v, w, u, grad_o, grad_final_state, scale, initial_state, cu_seqlens, head_first):
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


@torch.library.register_fake("fla::fused_recurrent_rwkv7_bwd")
def _(r, w, k, v, a, b, grad_o, grad_final_state, scale, initial_state, reverse, cu_seqlens,
      head_first):
    N, H = _state_rows(r, head_first, cu_seqlens)
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    dh0 = r.new_empty((N if initial_state is not None else 0, H, r.shape[-1], v.shape[-1]),
                      dtype=_acc(r))
    return like(r), like(w), like(k), like(v), like(a), like(b), dh0
