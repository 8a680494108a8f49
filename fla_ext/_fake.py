"""Fake (meta) kernels of every op, for torch.compile, opcheck and meta tensors: the op's argument
checks (_fake_checks: the C++ ops' shape, dtype and device checks, so that a bad call fails under
FakeTensorMode as in eager mode, and a meta tensor among real ones is refused instead of
returning uninitialised outputs), then the shapes and dtypes of its outputs."""
import torch

from . import _fake_checks as check


def _like(*ts):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in ts)


def _o(q, v):
    """o: shaped like v, in q's dtype (float32 for GLA's wide q)."""
    return torch.empty_like(v, dtype=q.dtype, memory_format=torch.contiguous_format)


def _state(q, d, present=True, N=None):
    """A state [N, H, K, V] of the acc type (N: d's sequences, 0 unless `present`)."""
    N = (d.N if present else 0) if N is None else N
    return q.new_empty((N, d.H, d.K, d.V), dtype=check.acc(q))


def _decay_grad(q, g):
    """A decay's gradient: like g, or 0 elements without the decay."""
    return _like(g)[0] if g is not None else q.new_empty((0,))


def _workspaces(q, d, pairs=True):
    """What a chunk training forward keeps (CUDA only; empty elsewhere): the chunk-start states
    hst [slots, H, K, V] and, for key-side passes (`pairs`), the pair matrices amat
    [slots, H, 64, 64]."""
    if q.device.type != "cuda":
        return q.new_empty((0,), dtype=check.acc(q)), q.new_empty((0,), dtype=check.acc(q))
    slots = check.chunk_slots(d)
    amat = (slots, d.H, check.CHUNK, check.CHUNK) if pairs else (0,)
    return _state(q, d, N=slots), q.new_empty(amat, dtype=check.acc(q))


# ---------------------------------------------------------------------------------------------
# RWKV6

def _rwkv6(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, head_first):
    d = check.rwkv6(r, k, v, w, u, scale, initial_state, cu_seqlens, head_first)
    return d, _o(r, v), _state(r, d, output_final_state)


def _rwkv6_bwd(r, k, v, w, u, grad_o, grad_final_state, scale, initial_state, cu_seqlens,
               head_first, hst=None, amat=None):
    d = check.rwkv6(r, k, v, w, u, scale, initial_state, cu_seqlens, head_first, backward=True,
                    grad_o=grad_o, grad_final_state=grad_final_state, hst=hst, amat=amat)
    return (*_like(r, k, v, w), u.new_empty(u.shape), _state(r, d, initial_state is not None))


@torch.library.register_fake("fla::fused_recurrent_rwkv6")
def _(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False, reverse=False,
      cu_seqlens=None, head_first=False):
    return _rwkv6(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens,
                  head_first)[1:]


@torch.library.register_fake("fla::fused_recurrent_rwkv6_bwd")
def _(r, k, v, w, u, grad_o, grad_final_state, scale, initial_state, reverse, cu_seqlens,
      head_first):
    return _rwkv6_bwd(r, k, v, w, u, grad_o, grad_final_state, scale, initial_state, cu_seqlens,
                      head_first)


@torch.library.register_fake("fla::chunk_rwkv6")
def _(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
      head_first=False):
    return _rwkv6(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens,
                  head_first)[1:]


@torch.library.register_fake("fla::chunk_rwkv6_train")
def _(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, head_first):
    d, o, ht = _rwkv6(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens,
                      head_first)
    return (o, ht, *_workspaces(r, d))


torch.library.register_fake("fla::chunk_rwkv6_bwd")(_rwkv6_bwd)


# ---------------------------------------------------------------------------------------------
# GLA: key-side decay g (gk), value-side decay gv, wide q

def _gla(q, k, v, g, gv, scale, initial_state, output_final_state, cu_seqlens, head_first,
         chunk):
    d = check.gla(q, k, v, g, gv, scale, initial_state, cu_seqlens, head_first, chunk=chunk)
    return d, _o(q, v), _state(q, d, output_final_state)


def _gla_bwd(q, k, v, g, gv, grad_o, grad_final_state, scale, initial_state, cu_seqlens,
             head_first, chunk, hst=None, amat=None):
    d = check.gla(q, k, v, g, gv, scale, initial_state, cu_seqlens, head_first, chunk=chunk,
                  backward=True, grad_o=grad_o, grad_final_state=grad_final_state, hst=hst,
                  amat=amat)
    return (*_like(q, k, v), _decay_grad(q, g), _decay_grad(q, gv),
            _state(q, d, initial_state is not None))


@torch.library.register_fake("fla::fused_recurrent_gla")
def _(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
      reverse=False, cu_seqlens=None, head_first=False):
    return _gla(q, k, v, gk, gv, scale, initial_state, output_final_state, cu_seqlens,
                head_first, chunk=False)[1:]


@torch.library.register_fake("fla::fused_recurrent_gla_bwd")
def _(q, k, v, gk, gv, grad_o, grad_final_state, scale, initial_state, reverse, cu_seqlens,
      head_first):
    return _gla_bwd(q, k, v, gk, gv, grad_o, grad_final_state, scale, initial_state, cu_seqlens,
                    head_first, chunk=False)


@torch.library.register_fake("fla::chunk_gla")
def _(q, k, v, g=None, gv=None, scale=None, initial_state=None, output_final_state=False,
      cu_seqlens=None, head_first=False):
    return _gla(q, k, v, g, gv, scale, initial_state, output_final_state, cu_seqlens, head_first,
                chunk=True)[1:]


@torch.library.register_fake("fla::chunk_gla_train")
def _(q, k, v, g, gv, scale, initial_state, output_final_state, cu_seqlens, head_first):
    d, o, ht = _gla(q, k, v, g, gv, scale, initial_state, output_final_state, cu_seqlens,
                    head_first, chunk=True)
    # the value-side decay alone keeps no pair matrices (its backward's are of dO)
    return (o, ht, *_workspaces(q, d, pairs=not (gv is not None and g is None)))


@torch.library.register_fake("fla::chunk_gla_bwd")
def _(q, k, v, g, gv, grad_o, grad_final_state, scale, initial_state, cu_seqlens, head_first,
      hst=None, amat=None):
    return _gla_bwd(q, k, v, g, gv, grad_o, grad_final_state, scale, initial_state, cu_seqlens,
                    head_first, chunk=True, hst=hst, amat=amat)


# ---------------------------------------------------------------------------------------------
# RWKV7

def _rwkv7(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, head_first):
    d = check.rwkv7(r, w, k, v, a, b, scale, initial_state, cu_seqlens, head_first)
    return d, _o(r, v), _state(r, d, output_final_state)


def _rwkv7_bwd(r, w, k, v, a, b, grad_o, grad_final_state, scale, initial_state, cu_seqlens,
               head_first, saved=None):
    d = check.rwkv7(r, w, k, v, a, b, scale, initial_state, cu_seqlens, head_first,
                    backward=True, grad_o=grad_o, grad_final_state=grad_final_state, saved=saved)
    return (*_like(r, w, k, v, a, b), _state(r, d, initial_state is not None))


@torch.library.register_fake("fla::fused_recurrent_rwkv7")
def _(r, w, k, v, a, b, scale=None, initial_state=None, output_final_state=True, reverse=False,
      cu_seqlens=None, head_first=False):
    return _rwkv7(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens,
                  head_first)[1:]


@torch.library.register_fake("fla::fused_recurrent_rwkv7_bwd")
def _(r, w, k, v, a, b, grad_o, grad_final_state, scale, initial_state, reverse, cu_seqlens,
      head_first):
    return _rwkv7_bwd(r, w, k, v, a, b, grad_o, grad_final_state, scale, initial_state,
                      cu_seqlens, head_first)


@torch.library.register_fake("fla::chunk_rwkv7")
def _(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
      head_first=False):
    return _rwkv7(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens,
                  head_first)[1:]


@torch.library.register_fake("fla::chunk_rwkv7_train")
def _(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, head_first):
    """(o, ht) and what the CUDA backend keeps, `saved` (fp32, flat; empty elsewhere)."""
    d, o, ht = _rwkv7(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens,
                      head_first)
    n = check.rwkv7_saved_floats(d, r.dtype) if r.device.type == "cuda" else 0
    return o, ht, r.new_empty((n,), dtype=torch.float32)


torch.library.register_fake("fla::chunk_rwkv7_bwd")(_rwkv7_bwd)


# ---------------------------------------------------------------------------------------------
# GSA's chunked core (chunk_gsa and fused_recurrent_gsa are CompositeImplicitAutograd: their
# C++ checks run on fake tensors too)

def _gsa_core(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens, head_first):
    d1, d2 = check.gsa_core(q, k, v, s, g, scale, hk0, hv0, cu_seqlens, head_first)
    return d1, d2, _like(v)[0], _state(q, d1, output_final_state), _state(q, d2, output_final_state)


@torch.library.register_fake("fla::chunk_gsa_core")
def _(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens, head_first):
    return _gsa_core(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens,
                     head_first)[2:]


@torch.library.register_fake("fla::chunk_gsa_core_train")
def _(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens, head_first):
    """Also the float32 softmax p and the workspaces: pass 1 (value-side) keeps hst1 alone,
    pass 2 (key-side) hst2 and amat2."""
    d1, d2, o, hk, hv = _gsa_core(q, k, v, s, g, scale, hk0, hv0, output_final_state,
                                  cu_seqlens, head_first)
    p = torch.empty_like(s, dtype=check.acc(q), memory_format=torch.contiguous_format)
    return (o, hk, hv, p, _workspaces(q, d1, pairs=False)[0], *_workspaces(q, d2))


@torch.library.register_fake("fla::chunk_gsa_core_bwd")
def _(q, k, v, s, g, p, grad_o, grad_hk, grad_hv, scale, hk0, hv0, cu_seqlens, head_first,
      hst1=None, hst2=None, amat2=None):
    d1, d2 = check.gsa_core(q, k, v, s, g, scale, hk0, hv0, cu_seqlens, head_first,
                            backward=True, p=p, grad_o=grad_o, grad_hk=grad_hk, grad_hv=grad_hv,
                            hst1=hst1, hst2=hst2, amat2=amat2)
    return (*_like(q, k, v, s, g), _state(q, d1, hk0 is not None),
            _state(q, d2, hv0 is not None))
