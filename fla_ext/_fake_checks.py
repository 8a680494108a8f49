"""The argument checks of the fake (meta) kernels in _fake.py: the C++ ops' shape, dtype and
device checks (csrc/ops/common.cpp and each family's file), with the same conditions in the same
order, the same exception types (ValueError for shapes and dtypes, RuntimeError for devices) and
the same messages.

The fake kernels run in two cases, and both need the checks:
  - under FakeTensorMode (torch.compile, opcheck): a bad argument must fail while tracing as the
    op fails in eager mode. Fake tensors report the device of the tensor they stand for, so the
    device rules hold there too;
  - whenever any tensor argument is on the meta device: the dispatcher then picks the Meta kernel
    (the fake) for the whole call, so a meta `initial_state` among CPU tensors would skip the C++
    checks and return uninitialised outputs. Mixing devices is an error naming the argument; a
    call whose tensors are all on meta is shape inference and passes.
Value checks that read memory (FLA_EXT_CHECKS, the values of cu_seqlens) are never done here.
"""
import math
import os
from typing import NamedTuple

import torch

MAX_HEAD_DIM = 256  # ops/common.h kMaxHeadDim
CHUNK = 64  # kernels/chunk.h kChunk: rows of a chunk of the GLA / RWKV6 / GSA chunk engine
DPLR_CHUNK = 16  # kernels/dplr_chunk.h kDplrChunk: rows of a chunk_rwkv7 chunk
DPLR_STATE_STRIDE = 4  # kernels/dplr_chunk.h kDplrStateStride: chunks per state the fused forward keeps
_DPLR_MAT_STRIDE = 20  # kernels/dplr_chunk.h kDplrMatStride
_INT_MAX = 2**31 - 1

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# dtypes as the C++ messages print them (c10::ScalarType)
_DTYPE_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
                torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int",
                torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool",
                torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def shape_str(t) -> str:
    return str(list(t.shape))


def acc(t) -> torch.dtype:
    """The dtype of states, workspaces and u: float32, float64 for float64 activations."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _error(exc, *parts) -> Exception:
    return exc("fla_ext: " + "".join(dtype_name(p) if isinstance(p, torch.dtype) else str(p)
                                     for p in parts))


class Spec(NamedTuple):
    """What the checks read of a tensor the op forms itself (chunk_gsa_core's softmax p in q's
    dtype): shape, dtype, device."""
    shape: tuple
    dtype: torch.dtype
    device: torch.device


class Layout(NamedTuple):
    """The [B, T, H, D] view of an activation given in either layout (ops/common.h Layout)."""
    head_first: bool

    def B(self, t):
        return t.shape[0]

    def T(self, t):
        return t.shape[2 if self.head_first else 1]

    def H(self, t):
        return t.shape[1 if self.head_first else 2]

    def D(self, t):
        return t.shape[3]

    @property
    def dims(self) -> str:
        return "[B, H, T, D]" if self.head_first else "[B, T, H, D]"


class Diag(NamedTuple):
    """The checked sizes of a diagonal-gate op (ops/common.h DiagArgs)."""
    L: Layout
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int  # sequences: B, or len(cu_seqlens) - 1
    varlen: bool
    wide_q: bool  # GLA's float32 q with bf16 / fp16 k, v


# ---------------------------------------------------------------------------------------------
# The shared checks (ops/common.cpp)

def defined(t, name) -> None:
    """A required tensor argument: a raw torch.ops.fla call may pass None."""
    if t is None:
        raise _error(ValueError, "`", name, "` must be a tensor, got None")


def activation(t, name, ref, ref_name) -> None:
    """check_activation: a 4-D float32 / bfloat16 / float16 tensor (float64 on the CPU only, as
    in C++: not on meta either) on the device and of the dtype of `ref`."""
    defined(t, name)
    if len(t.shape) != 4:
        raise _error(ValueError, "`", name, "` must be 4-D, got shape ", shape_str(t))
    if not (t.dtype in _FLOATS or (t.dtype == torch.float64 and t.device.type == "cpu")):
        raise _error(ValueError, "`", name, "` must be float32, bfloat16 or float16 (float64 on "
                     "CPU), got ", t.dtype, " on ", t.device)
    if t.device != ref.device:
        raise _error(RuntimeError, "`", name, "` is on ", t.device, " but `", ref_name, "` is on ",
                     ref.device)
    if t.dtype != ref.dtype:
        raise _error(ValueError, "`", name, "` has dtype ", t.dtype, " but `", ref_name,
                     "` has dtype ", ref.dtype, "; all activations must match")


def same_shape(t, name, ref, ref_name, L: Layout) -> None:
    """check_same_shape: an activation like `ref` with exactly its shape."""
    activation(t, name, ref, ref_name)
    if tuple(t.shape) != tuple(ref.shape):
        raise _error(ValueError, "`", name, "` must have the shape of `", ref_name, "` ",
                     shape_str(ref), " (", L.dims, "), got ", shape_str(t))


def cu_seqlens(cu, ref, B) -> int:
    """check_cu_seqlens without its value checks; returns N, the number of sequences (B without
    cu_seqlens)."""
    if cu is None:
        return B
    if cu.dtype not in (torch.int64, torch.int32):
        raise _error(ValueError, "`cu_seqlens` must be int64 (or int32), got ", cu.dtype)
    if not (len(cu.shape) == 1 and cu.shape[0] >= 2):
        raise _error(ValueError, "`cu_seqlens` must be 1-D with at least 2 entries, got shape ",
                     shape_str(cu))
    if cu.device != ref.device:
        raise _error(RuntimeError, "`cu_seqlens` is on ", cu.device, " but the inputs are on ",
                     ref.device)
    if B != 1:
        raise _error(ValueError, "with `cu_seqlens` the batch size must be 1, got B = ", B)
    if cu.shape[0] - 1 > _INT_MAX:
        raise _error(ValueError, "`cu_seqlens` has too many sequences (", cu.shape[0] - 1, ")")
    return cu.shape[0] - 1


def state(s, name, ref, N, H, R, C, dims="[N, H, K, V]") -> None:
    """check_state: a state [N, H, R, C] of the acc type of `ref`, on its device."""
    if s.device != ref.device:
        raise _error(RuntimeError, "`", name, "` is on ", s.device, " but the inputs are on ",
                     ref.device)
    if s.dtype != acc(ref):
        raise _error(ValueError, "`", name, "` must be ", acc(ref), " (states are float32; "
                     "float64 for float64 inputs), got ", s.dtype)
    if tuple(s.shape) != (N, H, R, C):
        raise _error(ValueError, "`", name, "` must have shape ", dims, " = ", [N, H, R, C],
                     ", got ", shape_str(s))


def head_dim(d, what: str) -> None:
    if not 1 <= d <= MAX_HEAD_DIM:
        raise _error(ValueError, what, " must be in [1, ", MAX_HEAD_DIM, "], got ", d)


def devices(ref, **tensors) -> None:
    """The device rule for the tensor arguments no other check reads (absent or empty kept
    workspaces, CUDA-only ones elsewhere): on the device of `ref` as well."""
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise _error(RuntimeError, "`", name, "` is on ", t.device, " but the inputs are on ",
                         ref.device)


def workspace(t, sizes, dtype, device, name) -> bool:
    """kept_workspace: whether `t` is a kept workspace (None or empty: not kept); one that is
    must be exactly the one the _train op returns."""
    if t is None or t.numel() == 0:
        return False
    if not (tuple(t.shape) == tuple(sizes) and t.dtype == dtype and t.device == device
            and t.is_contiguous()):
        raise _error(ValueError, "`", name, "` must be the ", dtype, " workspace ", list(sizes),
                     " on ", device, " returned by the _train op, got ", t.dtype, " ",
                     shape_str(t), " on ", t.device)
    return True


def diag(q, qn, k, v, g, gn, scale, h0, cu, head_first, wide_q_ok=False) -> Diag:
    """check_diag: reader q and key k [B, T, H, K], values v [B, T, H, V], log decay g like q (or
    None), initial state h0 [N, H, K, V]. wide_q_ok: the op takes a wide q (GLA)."""
    L = Layout(head_first)
    activation(q, qn, q, qn)
    wide = (wide_q_ok and k is not None and q.dtype == torch.float32
            and k.dtype in (torch.bfloat16, torch.float16))
    ref, refn = (k, "k") if wide else (q, qn)  # the dtype every other activation has
    activation(k, "k", ref, refn)
    if k.device != q.device:
        raise _error(RuntimeError, "`k` is on ", k.device, " but `", qn, "` is on ", q.device)
    activation(v, "v", ref, refn)
    if g is not None:
        activation(g, gn, ref, refn)
    B, T, H, K, V = L.B(q), L.T(q), L.H(q), L.D(q), L.D(v)
    for t, name in ((k, "k"), (g, gn)):
        if t is not None and tuple(t.shape) != tuple(q.shape):
            raise _error(ValueError, "`", name, "` must have the shape of `", qn, "` ",
                         shape_str(q), " (", L.dims, "), got ", shape_str(t))
    if (L.B(v), L.T(v), L.H(v)) != (B, T, H):
        raise _error(ValueError, "`v` must be ", L.dims, " with B, T, H of `", qn, "` ",
                     shape_str(q), ", got ", shape_str(v))
    head_dim(K, f"K (last dim of {qn}, k" + (f", {gn})" if g is not None else ")"))
    head_dim(V, "V (last dim of v)")
    N = cu_seqlens(cu, q, B)
    if h0 is not None:
        state(h0, "initial_state", q, N, H, K, V)
    if scale is not None and not math.isfinite(scale):
        raise _error(ValueError, "`scale` must be finite, got ", scale)
    return Diag(L, B, T, H, K, V, N, cu is not None, wide)


def chunk_slots(d: Diag, C: int = CHUNK) -> int:
    """Slots of the chunk-start state workspace of C-row chunks (kernels/chunk.h chunk_slots)."""
    return d.T // C + 2 * d.N + 1 if d.varlen else d.N * ((d.T + C - 1) // C + 1)


def rwkv7_fused_shapes(d: Diag, dtype) -> bool:
    """chunk_rwkv7's shapes with a fused forward (kernels/dplr_chunk.h dplr_fused_forward): bf16 /
    fp16 with K = V = 64."""
    return dtype in (torch.bfloat16, torch.float16) and d.K == 64 and d.V == 64


def rwkv7_strided_shapes(d: Diag, dtype) -> bool:
    """chunk_rwkv7's shapes whose training forward may keep strided states (kernels/dplr_chunk.h
    dplr_strided_states): bf16 / fp16 with K = V = 64 or 128."""
    return dtype in (torch.bfloat16, torch.float16) and d.K == d.V and d.K in (64, 128)


def rwkv7_fused_training_forward(d: Diag, dtype) -> bool:
    """Whether chunk_rwkv7's CUDA training forward runs the fused kernel (ops/chunk_rwkv7.cpp
    fused_forward): its shapes (rwkv7_fused_shapes), at least 256 (sequence, head) pairs, unless
    FLA_EXT_RWKV7_FUSED says otherwise."""
    if not rwkv7_fused_shapes(d, dtype):
        return False
    force = os.environ.get("FLA_EXT_RWKV7_FUSED", "")
    if force:
        return force[0] == "1"
    return d.N * d.H >= 256


def rwkv7_pipeline_window_chunks(d: Diag) -> int:
    """chunk_rwkv7's forward windows on two streams (ops/chunk_rwkv7.cpp pipeline_window_chunks):
    eight windows of whole strides, each of at least 64 chunks, where the sweeps have at most 64
    CTAs (32 state columns each), no cu_seqlens; FLA_EXT_RWKV7_PIPELINE=0 / 1 forces them off /
    on (on: for any sequence longer than a window)."""
    force = os.environ.get("FLA_EXT_RWKV7_PIPELINE", "")
    if d.varlen or force[:1] == "0":
        return 0
    nch = (d.T + DPLR_CHUNK - 1) // DPLR_CHUNK
    chunks = ((nch + 7) // 8 + DPLR_STATE_STRIDE - 1) // DPLR_STATE_STRIDE * DPLR_STATE_STRIDE
    pays = chunks >= 64 and d.N * d.H * ((d.V + 31) // 32) <= 64
    return chunks if (force[:1] == "1" or pays) and chunks < nch else 0


def rwkv7_saved_floats(d: Diag, dtype) -> int:
    """The length of chunk_rwkv7's `saved` on CUDA (ops/chunk_rwkv7.cpp saved_floats): where the
    fused forward runs, or the two-kernel forward storing strided states from its sweep
    (sweep_strided: K = V = 128, or the fused forward's shapes in pipelined windows, which take
    no cu_seqlens), the state before every fourth 16-row chunk (the slot map of 64-row chunks), padded
    to a multiple of 4 floats, then (the sweep's outside pipelined windows) the per-chunk
    workspace; else every chunk-start state, padded, then the per-chunk workspace
    (kernels/dplr_chunk.h DplrWorkspaceLayout: W, Q~, K^, B^ [16][ks], gamma, the pair matrices
    and X [5][16][20])."""
    sweep_strided = rwkv7_strided_shapes(d, dtype) and (d.K == 128 or rwkv7_pipeline_window_chunks(d) > 0)
    if rwkv7_fused_training_forward(d, dtype) or sweep_strided:
        # (strided_keeps_ws: the sweep's strided states outside the pipelined windows keep prep's
        # workspace after them)
        keeps_ws = sweep_strided and rwkv7_pipeline_window_chunks(d) == 0
        return _strided_saved_floats(d) + (_workspace_floats(d) if keeps_ws else 0)
    return _full_saved_floats(d)


def _workspace_floats(d: Diag) -> int:
    ks, kp4 = (d.K + 31) // 32 * 32, (d.K + 3) // 4 * 4
    per = 4 * DPLR_CHUNK * ks + kp4 + 5 * DPLR_CHUNK * _DPLR_MAT_STRIDE
    return chunk_slots(d, DPLR_CHUNK) * d.H * per


def _full_saved_floats(d: Diag) -> int:
    states = (chunk_slots(d, DPLR_CHUNK) * d.H * d.K * d.V + 3) // 4 * 4
    return states + _workspace_floats(d)


def _strided_saved_floats(d: Diag) -> int:
    return (chunk_slots(d, DPLR_CHUNK * DPLR_STATE_STRIDE) * d.H * d.K * d.V + 3) // 4 * 4


def rwkv7_backward_saved_floats(d: Diag, dtype, saved) -> int:
    """The `saved` length chunk_rwkv7's CUDA backward takes (ops/chunk_rwkv7.cpp chunk_rwkv7_bwd):
    any form rwkv7_saved_floats gives, whatever the settings now: on the shapes with strided
    states (bf16 / fp16, K = V = 64 or 128) those states alone or with the workspace after them,
    else every state and the workspace."""
    strided = _strided_saved_floats(d)
    if rwkv7_strided_shapes(d, dtype) and saved is not None and saved.numel() in (strided, strided + _workspace_floats(d)):
        return saved.numel()
    return _full_saved_floats(d)


def _grads(d: Diag, q, qn, v, grad_o, grad_final_state) -> None:
    """A backward's grad_o (an activation like q, shaped like v) and grad_final_state."""
    activation(grad_o, "grad_o", q, qn)
    if tuple(grad_o.shape) != tuple(v.shape):
        raise _error(ValueError, "`grad_o` must have the shape of `v` ", shape_str(v), ", got ",
                     shape_str(grad_o))
    if grad_final_state is not None:
        state(grad_final_state, "grad_final_state", q, d.N, d.H, d.K, d.V)


def _chunk_workspaces(d: Diag, q, hst, amat, value_side: bool) -> None:
    """chunk_backward's kept workspaces: hst [slots, H, K, V] and amat [slots, H, 64, 64]
    together, or (value_side: a pass with the value-side decay alone) hst alone."""
    kept_hst = workspace(hst, (chunk_slots(d), d.H, d.K, d.V), acc(q), q.device, "hst")
    if value_side:
        return
    kept_amat = workspace(amat, (chunk_slots(d), d.H, CHUNK, CHUNK), acc(q), q.device, "amat")
    if kept_hst != kept_amat:
        raise _error(ValueError, "`hst` and `amat` come together from the _train op: pass both or "
                     "neither")


# ---------------------------------------------------------------------------------------------
# One check per op family, taking the op's arguments; `backward`: the backward op's checks too
# (its gradients and kept workspaces).

def rwkv6(r, k, v, w, u, scale, initial_state, cu_seqlens, head_first, *, backward=False,
          grad_o=None, grad_final_state=None, hst=None, amat=None) -> Diag:
    """check_rwkv6 (ops/fused_recurrent_rwkv6.cpp): the diagonal-gate checks plus the bonus u [H, K]."""
    defined(r, "r")
    defined(w, "w")
    d = diag(r, "r", k, v, w, "w", scale, initial_state, cu_seqlens, head_first)
    defined(u, "u")
    if u.device != r.device:
        raise _error(RuntimeError, "`u` is on ", u.device, " but `r` is on ", r.device)
    if u.dtype not in _FLOATS + (torch.float64,):
        raise _error(ValueError, "`u` must be float32, bfloat16, float16 or float64, got ",
                     u.dtype)
    if tuple(u.shape) != (d.H, d.K):
        raise _error(ValueError, "`u` must have shape [H, K] = ", [d.H, d.K], ", got ",
                     shape_str(u))
    if backward:
        _grads(d, r, "r", v, grad_o, grad_final_state)
        _chunk_workspaces(d, r, hst, amat, value_side=False)
    devices(r, hst=hst, amat=amat)
    return d


def gla(q, k, v, g, gv, scale, initial_state, cu_seqlens, head_first, *, chunk: bool,
        backward=False, grad_o=None, grad_final_state=None, hst=None, amat=None) -> Diag:
    """GLA (ops/fused_recurrent_gla.cpp check_gla, ops/chunk_gla_rwkv6.cpp check_gv): a key-side decay g (gk in the fused
    mode) like q and a value-side decay gv like v, both optional; a wide q (float32 with bf16 /
    fp16 k, v). The CUDA chunk engine takes one of the two decays."""
    d = diag(q, "q", k, v, g, "g" if chunk else "gk", scale, initial_state, cu_seqlens,
             head_first, wide_q_ok=True)
    if gv is not None:
        same_shape(gv, "gv", v, "v", d.L)
        if chunk and g is not None and q.device.type == "cuda":
            raise _error(ValueError, "chunk_gla on CUDA takes a key-side decay `g` or a "
                         "value-side decay `gv`, not both together (the CPU backend takes both)")
    if backward:
        _grads(d, q, "q", v, grad_o, grad_final_state)
        if chunk:
            _chunk_workspaces(d, q, hst, amat, value_side=gv is not None and g is None)
    devices(q, hst=hst, amat=amat)
    return d


def rwkv7(r, w, k, v, a, b, scale, initial_state, cu_seqlens, head_first, *, backward=False,
          grad_o=None, grad_final_state=None, saved=None) -> Diag:
    """check_rwkv7 (ops/fused_recurrent_rwkv7.cpp): the diagonal-gate checks plus a, b shaped like r; the chunked
    backward's `saved` (read on CUDA only, when there are rows)."""
    defined(r, "r")
    defined(w, "w")
    d = diag(r, "r", k, v, w, "w", scale, initial_state, cu_seqlens, head_first)
    for t, name in ((a, "a"), (b, "b")):
        same_shape(t, name, r, "r", d.L)
    if backward:
        _grads(d, r, "r", v, grad_o, grad_final_state)
        if r.device.type == "cuda" and d.T > 0:
            workspace(saved, (rwkv7_backward_saved_floats(d, r.dtype, saved),), torch.float32, r.device, "saved")
    devices(r, saved=saved)
    return d


def gsa_core(q, k, v, s, g, scale, hk0, hv0, cu_seqlens, head_first, *, backward=False, p=None,
             grad_o=None, grad_hk=None, grad_hv=None, hst1=None, hst2=None, amat2=None):
    """chunk_gsa_core's checks (ops/chunk_gsa_core.cpp), named as its two GLA passes name them:
    pass 1 is GLA(q, k, v := s, gv := g) with initial state hk0, pass 2 GLA(q := p, k := s, v, g)
    with hv0, p the softmax [B, T, H, M] in q's dtype. Returns the passes' sizes (d1, d2)."""
    d1 = diag(q, "q", k, s, None, "g", scale, hk0, cu_seqlens, head_first)
    same_shape(g, "g", s, "s", d1.L)
    if not backward:  # the forward forms p from pass 1's output
        pq = Spec(tuple(s.shape), q.dtype, s.device)
    else:
        defined(p, "p")
        if not (p.dtype == acc(q) and tuple(p.shape) == tuple(s.shape)):
            raise _error(ValueError, "`p` must be the ", acc(q), " softmax ", shape_str(s),
                         " returned by chunk_gsa_core_train, got ", p.dtype, " ", shape_str(p))
        pq = Spec(tuple(p.shape), q.dtype, p.device)
    d2 = diag(pq, "p", s, v, g, "g", 1.0, hv0, cu_seqlens, head_first)
    if backward:
        _grads(d2, pq, "p", v, grad_o, grad_hv)  # pass 2's backward, then pass 1's
        _chunk_workspaces(d2, pq, hst2, amat2, value_side=False)
        if grad_hk is not None:
            state(grad_hk, "grad_final_state", q, d1.N, d1.H, d1.K, d1.V)
        _chunk_workspaces(d1, q, hst1, None, value_side=True)
    devices(q, p=p, hst1=hst1, hst2=hst2, amat2=amat2)
    return d1, d2
