"""Python entry points with fla's signatures (plus ``head_first``).

Layouts: activations are ``[B, T, H, D]``, or ``[B, H, T, D]`` with ``head_first=True`` (read by
strides, never copied). States are float32 ``[N, H, K, V]``; N = B, or the number of sequences
with ``cu_seqlens`` (then B must be 1). Log decays ``w <= 0`` multiply the state by ``exp(w)``.
"""
import warnings
from typing import Optional, Tuple

import torch

from . import cp as _cp
from . import wide as _wide
from .gsa_passes import slot_gate, two_passes
from .checks import check_cu_seqlens_values, check_finite, checks_enabled, set_checks

__all__ = [
    "chunk_gla",
    "chunk_gsa",
    "chunk_rwkv6",
    "chunk_rwkv7",
    "fused_mul_recurrent_rwkv7",
    "fused_recurrent_gla",
    "fused_recurrent_gsa",
    "fused_recurrent_rwkv6",
    "fused_recurrent_rwkv7",
    "set_checks",
]


def _check_host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, x, head_first) -> None:
    # fla's cu_seqlens_cpu: the host copy of cu_seqlens, so its values are checked without a
    # device synchronisation (a CPU cu_seqlens is checked by the op itself on every call).
    if cu_seqlens_cpu is None:
        return
    if cu_seqlens is None:
        raise ValueError("fla_ext: `cu_seqlens_cpu` was given without `cu_seqlens`")
    if isinstance(x, torch.Tensor) and x.dim() == 4:
        check_cu_seqlens_values(cu_seqlens_cpu, x.shape[2 if head_first else 1],
                                "cu_seqlens_cpu", cu_seqlens)


def _require_tensors(**named) -> None:
    # The dispatcher's own message for None/non-tensors ("tensor does not have a device") does
    # not say which argument is wrong.
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"fla_ext: `{name}` must be a torch.Tensor, got {type(x).__name__}")


def _optional_tensors(**named) -> None:
    for name, x in named.items():
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(
                f"fla_ext: `{name}` must be a torch.Tensor or None, got {type(x).__name__}")


def _check_fla_hints(chunk_size=None, checkpoint_level=None, lower_bound=None) -> None:
    """fla's checks of its tuning hints, which fla_ext accepts without effect: a call fla refuses
    is refused here too, with fla's reason."""
    if chunk_size is not None and (chunk_size <= 0 or chunk_size & (chunk_size - 1)):
        raise ValueError(f"fla_ext: `chunk_size` must be a power of 2, got {chunk_size}")
    if checkpoint_level is not None and checkpoint_level not in (0, 1, 2):
        raise ValueError(f"fla_ext: `checkpoint_level` must be 0, 1 or 2, got {checkpoint_level}")
    if lower_bound is not None and lower_bound >= 0:
        raise ValueError(f"fla_ext: `lower_bound` must be negative (w is a log decay < 0), got "
                         f"{lower_bound}")


def _full_scale(scale, k):
    """The scale of the whole head (K^-1/2 unless given), for an op run on key slices."""
    return k.shape[-1] ** -0.5 if scale is None else scale


def _lift_state(state, ref: torch.Tensor):
    """A 16-bit initial state (fla's ops take one in the inputs' dtype, as fla's tests pass it) as
    the float32 state the kernels hold: an exact, differentiable cast, so its gradient comes back
    in the caller's dtype. Any other dtype goes to the op as given (and is refused there unless it
    is the state type)."""
    if (isinstance(state, torch.Tensor) and state.dtype in (torch.float16, torch.bfloat16)
            and isinstance(ref, torch.Tensor) and ref.dtype != torch.float64):
        return state.float()
    return state


def _state_in(state, state_v_first: bool, k: torch.Tensor, v: torch.Tensor):
    """An initial state given as fla's ``state_v_first`` [N, H, V, K], as the ops read it: a
    transposed view (the kernels take any strides). Its last two dims are checked here, in the
    layout the caller used (the op's own check would name the transposed one)."""
    if state_v_first and isinstance(state, torch.Tensor):
        K, V = k.shape[-1], v.shape[-1]
        if state.dim() < 2 or tuple(state.shape[-2:]) != (V, K):
            raise ValueError(f"fla_ext: with state_v_first=True, `initial_state` must be [N, H, V, K] "
                             f"= [N, H, {V}, {K}], got {list(state.shape)}")
        return state.transpose(-1, -2)
    return state


def _state_out(state, state_v_first: bool):
    return state.transpose(-1, -2).contiguous() if state_v_first else state


def fused_recurrent_rwkv6(
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    head_first: bool = False,
    *,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    cp_context=None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""RWKV6 recurrence, step by step (fused recurrent kernel):

    .. math:: o_t = s\,(h_{t-1} + \mathrm{diag}(u) k_t v_t^\top)^\top r_t,\quad
              h_t = \mathrm{diag}(e^{w_t}) h_{t-1} + k_t v_t^\top

    Args:
        r, k, w: ``[B, T, H, K]`` (``[B, H, T, K]`` if ``head_first``); ``w`` is the log decay
            (<= 0; ``-inf`` is a hard reset).
        v: ``[B, T, H, V]``; K and V are independent (1..512; above 256 as slices: fla_ext/wide.py).
        u: ``[H, K]`` bonus for the current token.
        scale: defaults to ``K ** -0.5``.
        initial_state: float32 ``[N, H, K, V]`` (a float16 / bfloat16 one, as fla takes it, is
            lifted to float32 exactly; its gradient comes back in its dtype).
        output_final_state: also return the float32 final state ``[N, H, K, V]``.
        reverse: run the recurrence from the last token to the first.
        cu_seqlens: int64 ``[N + 1]`` sequence boundaries (B must be 1): 0, non-decreasing, T
            last. A CPU one is checked on every call; a CUDA one when ``cu_seqlens_cpu`` (its
            host copy, fla's keyword) is given or the value checks are on (``set_checks``).
            Unchecked, malformed boundaries still never make a kernel touch memory outside
            the tensors (they are clamped into [0, T]), but the result is then meaningless.
        head_first: inputs are ``[B, H, T, D]``.

    Returns:
        ``(o, final_state)``: ``o`` like ``v`` in the input dtype; ``final_state`` or None.

    Example::

        >>> B, T, H, K, V = 2, 64, 4, 64, 64
        >>> r, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
        >>> v = torch.randn(B, T, H, V)
        >>> w = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K))
        >>> u = torch.randn(H, K)
        >>> o, ht = fused_recurrent_rwkv6(r, k, v, w, u, output_final_state=True)
    """
    _require_tensors(r=r, k=k, v=v, w=w, u=u)
    initial_state = _lift_state(initial_state, r)
    if cp_context is not None:
        _cp.check_inputs(cp_context, r, head_first, cu_seqlens, reverse, name="r")
        return _cp.rwkv6(fused_recurrent_rwkv6, cp_context, r, k, v, w, u, scale, initial_state,
                         output_final_state)
    _check_host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, r, head_first)
    if _wide.needs_slices(r.shape[-1], k.shape[-1], v.shape[-1]):
        return _wide.by_slices(
            lambda x, y, h0: torch.ops.fla.fused_recurrent_rwkv6(
                x["r"], x["k"], y["v"], x["w"], x["u"], _full_scale(scale, k), h0, output_final_state,
                reverse, cu_seqlens, head_first),
            dict(r=r, k=k, w=w, u=u), dict(v=v), initial_state, output_final_state)
    o, ht = torch.ops.fla.fused_recurrent_rwkv6(
        r, k, v, w, u, scale, initial_state, output_final_state, reverse, cu_seqlens, head_first
    )
    return o, (ht if output_final_state else None)


def fused_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: Optional[torch.Tensor] = None,
    gv: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    head_first: bool = False,
    *,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    transpose_state_layout: Optional[bool] = None,
    cp_context=None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""Gated linear attention, step by step (fused recurrent kernel), with fla's key-side and
    value-side decays:

    .. math:: h_t = \mathrm{diag}(e^{gk_t})\, h_{t-1}\, \mathrm{diag}(e^{gv_t}) + k_t v_t^\top,
        \quad o_t = s\, h_t^\top q_t

    Args:
        q, k, gk: ``[B, T, H, K]`` (``[B, H, T, K]`` if ``head_first``); ``gk`` is the log decay
            on the key dimension (<= 0; ``-inf`` is a hard reset), or None for no decay.
        v, gv: ``[B, T, H, V]``; K and V are independent (1..512; above 256 as slices: fla_ext/wide.py). ``gv`` is the log decay on
            the value dimension (<= 0, ``-inf`` allowed), or None. ``gk`` and ``gv`` may be given
            together; every gradient (``gk`` and ``gv`` included) is returned by autograd.
        scale: defaults to ``K ** -0.5``.
        initial_state, output_final_state, reverse, cu_seqlens, head_first: as in
            :func:`fused_recurrent_rwkv6`.
        state_v_first: as in fla: the initial and final states are ``[N, H, V, K]`` (the
            transposed layout). ``transpose_state_layout``: fla's older name for it.

    Returns:
        ``(o, final_state)``: ``o`` like ``v`` in the input dtype; ``final_state`` or None.

    Example::

        >>> B, T, H, K, V = 2, 64, 4, 64, 32
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
        >>> gv = torch.nn.functional.logsigmoid(torch.randn(B, T, H, V))
        >>> o, ht = fused_recurrent_gla(q, k, v, gv=gv, output_final_state=True)
    """
    _require_tensors(q=q, k=k, v=v)
    initial_state = _lift_state(initial_state, q)
    if gk is not None:
        _require_tensors(gk=gk)
    if gv is not None:
        _require_tensors(gv=gv)
    _check_host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q, head_first)
    if transpose_state_layout is not None:
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first` (as in "
                      "fla)", DeprecationWarning, stacklevel=2)
        if state_v_first:
            raise ValueError("fla_ext: pass `state_v_first` or its older name "
                             "`transpose_state_layout`, not both")
        state_v_first = bool(transpose_state_layout)
    if cp_context is not None:
        _cp.check_inputs(cp_context, q, head_first, cu_seqlens, reverse, name="q")
        o, ht = _cp.gla(fused_recurrent_gla, cp_context, q, k, v, gk, gv, scale,
                        _state_in(initial_state, state_v_first, k, v), output_final_state, {})
        return o, (_state_out(ht, state_v_first) if output_final_state else None)
    if _wide.needs_slices(q.shape[-1], k.shape[-1], v.shape[-1]):
        o, ht = _wide.by_slices(
            lambda x, y, h0: torch.ops.fla.fused_recurrent_gla(
                x["q"], x["k"], y["v"], x["gk"], y["gv"], _full_scale(scale, k), h0, output_final_state,
                reverse, cu_seqlens, head_first),
            dict(q=q, k=k, gk=gk), dict(v=v, gv=gv), _state_in(initial_state, state_v_first, k, v),
            output_final_state)
        return o, (_state_out(ht, state_v_first) if output_final_state else None)
    o, ht = torch.ops.fla.fused_recurrent_gla(
        q, k, v, gk, gv, scale, _state_in(initial_state, state_v_first, k, v), output_final_state,
        reverse, cu_seqlens, head_first
    )
    return o, (_state_out(ht, state_v_first) if output_final_state else None)


def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    *,
    gv: Optional[torch.Tensor] = None,
    head_first: bool = False,
    cp_context=None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""Gated linear attention, chunk-parallel (for training), with a key-side and/or a
    value-side decay:

    .. math:: h_t = \mathrm{diag}(e^{g_t})\, h_{t-1}\, \mathrm{diag}(e^{gv_t}) + k_t v_t^\top,\quad
              o_t = s\, h_t^\top q_t

    computed chunk by chunk (64 rows) with every decay factor formed so that its exponent is
    never positive (any log decay ``<= 0``, ``-inf`` included). With ``g`` alone this is
    :func:`fused_recurrent_gla` with ``gk=g``. ``gv`` decays the value (column) dimension of the
    state: Gated Slot Attention's first pass is ``chunk_gla(q, k, s, gv=g)`` (slots as values).

    Args:
        q, k: ``[B, T, H, K]`` (``[B, H, T, K]`` if ``head_first``). v: ``[B, T, H, V]``.
        g: optional key-side log decay ``[B, T, H, K]``; None: no key-side decay.
        gv: optional value-side log decay ``[B, T, H, V]``; None: no value-side decay.
            On CUDA, ``g`` and ``gv`` are not yet accepted together (the CPU backend takes both).
        scale (default ``K ** -0.5``), initial_state (``[N, H, K, V]``), output_final_state,
            cu_seqlens, head_first: as in :func:`fused_recurrent_rwkv6`.
        state_v_first: as in fla: the initial and final states are ``[N, H, V, K]``.
        cu_seqlens_cpu: the host copy of a CUDA ``cu_seqlens`` (as in fla): its values are
            checked without a device synchronisation.
        The positional order is fla's (``gv`` and ``head_first`` are keyword-only).

    Returns:
        ``(o, final_state)``; ``o`` is ``[B, T, H, V]`` in q's dtype.

    A float32 ``q`` may come with bf16 / fp16 ``k``, ``v`` and decays (a "wide q", as GSA's
    passes use it): the kernels then run in k's dtype with ``q`` rounded to it, and ``o`` (and
    under autograd ``dq``) come out in float32 from the fp32 accumulators. The same holds for
    :func:`fused_recurrent_gla`.

    Example::

        >>> q, k = torch.randn(2, 128, 4, 64), torch.randn(2, 128, 4, 64)
        >>> s = torch.randn(2, 128, 4, 32)                      # GSA slot keys, M = 32
        >>> g = torch.nn.functional.logsigmoid(torch.randn(2, 128, 4, 32))
        >>> ok, hk = fla_ext.chunk_gla(q, k, s, gv=g, output_final_state=True)  # GSA pass 1
    """
    _require_tensors(q=q, k=k, v=v)
    initial_state = _lift_state(initial_state, q)
    if cp_context is not None:
        _cp.check_inputs(cp_context, q, head_first, cu_seqlens, name="q")
        o, ht = _cp.gla(chunk_gla, cp_context, q, k, v, g, gv, scale,
                        _state_in(initial_state, state_v_first, k, v), output_final_state, {})
        return o, (_state_out(ht, state_v_first) if output_final_state else None)
    _check_host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q, head_first)
    _optional_tensors(g=g, gv=gv)
    if _wide.needs_slices(q.shape[-1], k.shape[-1], v.shape[-1]):
        o, ht = _wide.by_slices(
            lambda x, y, h0: torch.ops.fla.chunk_gla(
                x["q"], x["k"], y["v"], x["g"], y["gv"], _full_scale(scale, k), h0, output_final_state,
                cu_seqlens, head_first),
            dict(q=q, k=k, g=g), dict(v=v, gv=gv), _state_in(initial_state, state_v_first, k, v),
            output_final_state)
        return o, (_state_out(ht, state_v_first) if output_final_state else None)
    o, ht = torch.ops.fla.chunk_gla(
        q, k, v, g, gv, scale, _state_in(initial_state, state_v_first, k, v), output_final_state,
        cu_seqlens, head_first
    )
    return o, (_state_out(ht, state_v_first) if output_final_state else None)


def chunk_rwkv6(
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    head_first: bool = False,
    *,
    chunk_size: Optional[int] = None,
    cp_context=None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""RWKV6, chunk-parallel (for training): the same map as :func:`fused_recurrent_rwkv6`
    (exclusive read plus the bonus ``u``), computed chunk by chunk with never-positive decay
    exponents. Arguments and returns as in :func:`fused_recurrent_rwkv6` (no ``reverse``), in
    fla's positional order; ``cu_seqlens_cpu``: the host copy of a CUDA ``cu_seqlens``;
    ``chunk_size``: fla's tuning hint, accepted and without effect (the kernels' chunk is their
    own), checked as fla checks it."""
    _require_tensors(r=r, k=k, v=v, w=w, u=u)
    _check_fla_hints(chunk_size=chunk_size)
    initial_state = _lift_state(initial_state, r)
    if cp_context is not None:
        _cp.check_inputs(cp_context, r, head_first, cu_seqlens, name="r")
        return _cp.rwkv6(chunk_rwkv6, cp_context, r, k, v, w, u, scale, initial_state,
                         output_final_state)
    _check_host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, r, head_first)
    if _wide.needs_slices(r.shape[-1], k.shape[-1], v.shape[-1]):
        return _wide.by_slices(
            lambda x, y, h0: torch.ops.fla.chunk_rwkv6(
                x["r"], x["k"], y["v"], x["w"], x["u"], _full_scale(scale, k), h0, output_final_state,
                cu_seqlens, head_first),
            dict(r=r, k=k, w=w, u=u), dict(v=v), initial_state, output_final_state)
    o, ht = torch.ops.fla.chunk_rwkv6(
        r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, head_first
    )
    return o, (ht if output_final_state else None)


def fused_recurrent_rwkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = True,
    cu_seqlens: Optional[torch.Tensor] = None,
    head_first: bool = False,
    reverse: bool = False,
    *,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    cp_context=None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""RWKV7 recurrence (diagonal plus low rank), step by step (fused recurrent kernel):

    .. math:: h_t = \mathrm{diag}(e^{w_t}) h_{t-1} + b_t (a_t^\top h_{t-1}) + k_t v_t^\top,\quad
              o_t = s\, h_t^\top r_t

    Unlike fla's (inference only), this op has a backward: gradients for r, w, k, v, a, b and
    the initial state, also through the final state.

    Args:
        r, w, k, a, b: ``[B, T, H, K]`` (``[B, H, T, K]`` if ``head_first``); ``w`` is the log
            decay (<= 0; ``-inf`` is a hard reset). RWKV-7 layers pass ``a = -kk`` and
            ``b = kk * iclr`` (see :func:`fused_mul_recurrent_rwkv7`); any a, b are accepted.
        v: ``[B, T, H, V]``; K and V are independent (1..256).
        scale: defaults to ``K ** -0.5``, as fla's ``fused_recurrent_rwkv7`` (which forwards
            ``scale=None`` to ``fused_recurrent_dplr_delta_rule``). RWKV-7 models use ``1.0``.
        initial_state: float32 ``[N, H, K, V]`` (a float16 / bfloat16 one, as fla takes it, is
            lifted to float32 exactly; its gradient comes back in its dtype).
        output_final_state: also return the float32 final state ``[N, H, K, V]``; default
            ``True``, as in fla.
        cu_seqlens: int64 ``[N + 1]`` sequence boundaries (B must be 1).
        head_first: inputs are ``[B, H, T, D]``.
        reverse: run the recurrence from the last token to the first (not in fla's signature
            of this function; :func:`fused_mul_recurrent_rwkv7` has it).

    Returns:
        ``(o, final_state)``: ``o`` like ``v`` in the input dtype; ``final_state`` or None.

    Example::

        >>> B, T, H, K, V = 2, 64, 4, 64, 64
        >>> r, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
        >>> v = torch.randn(B, T, H, V)
        >>> w = -0.6 * torch.sigmoid(torch.randn(B, T, H, K))
        >>> kk = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
        >>> iclr = torch.rand(B, T, H, K)
        >>> o, ht = fused_recurrent_rwkv7(r, w, k, v, -kk, kk * iclr, scale=1.0)
    """
    _require_tensors(r=r, w=w, k=k, v=v, a=a, b=b)
    initial_state = _lift_state(initial_state, r)
    if cp_context is not None:
        _cp.check_inputs(cp_context, r, head_first, cu_seqlens, reverse, name="r")
        return _cp.rwkv7(fused_recurrent_rwkv7, cp_context, r, w, k, v, a, b, scale, initial_state,
                         output_final_state)
    _check_host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, r, head_first)
    o, ht = torch.ops.fla.fused_recurrent_rwkv7(
        r, w, k, v, a, b, scale, initial_state, output_final_state, reverse, cu_seqlens, head_first
    )
    return o, (ht if output_final_state else None)


def fused_mul_recurrent_rwkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kk: torch.Tensor,
    a: torch.Tensor,
    scale: Optional[float] = 1.0,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    head_first: bool = False,
    *,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    cp_context=None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""RWKV-7 with the low-rank pair formed from ``kk`` and ``a`` (fla's inference entry point):
    :func:`fused_recurrent_rwkv7` with ``a_op = -kk`` and ``b_op = kk * a``, i.e.

    .. math:: h_t = \mathrm{diag}(e^{w_t}) h_{t-1} - (kk_t \odot a_t)(kk_t^\top h_{t-1})
              + k_t v_t^\top,\quad o_t = s\, h_t^\top r_t

    Here ``a`` is RWKV-7's in-context learning rate (iclr, in [0, 1]) and ``kk`` the
    L2-normalised removal key, exactly as fla's ``fused_mul_recurrent_rwkv7``. Differentiable
    (the products are formed with torch ops, so gradients reach ``kk`` and ``a``).

    Args:
        r, w, k, kk, a: ``[B, T, H, K]`` (``[B, H, T, K]`` if ``head_first``); ``w`` is the log
            decay (<= 0).
        v: ``[B, T, H, V]``.
        scale: defaults to ``1.0`` as in fla; ``None`` means ``K ** -0.5``.
        initial_state, cu_seqlens, head_first: as in :func:`fused_recurrent_rwkv7`.
        output_final_state: default ``False``, as in fla.
        reverse: run the recurrence from the last token to the first.

    Returns:
        ``(o, final_state)``: ``o`` like ``v`` in the input dtype; ``final_state`` or None.
    """
    _require_tensors(r=r, w=w, k=k, v=v, kk=kk, a=a)
    if cp_context is not None:
        _cp.check_inputs(cp_context, r, head_first, cu_seqlens, reverse, name="r")
        return _cp.rwkv7(fused_recurrent_rwkv7, cp_context, r, w, k, v, -kk, kk * a, scale,
                         initial_state, output_final_state)
    if kk.shape != a.shape:
        raise ValueError(f"fla_ext: `kk` {tuple(kk.shape)} and `a` {tuple(a.shape)} must have "
                         "the same shape")
    if checks_enabled():  # the op below sees -kk and kk * a: check them under the user's names
        check_finite(kk, "kk")
        check_finite(a, "a")
    return fused_recurrent_rwkv7(r, w, k, v, -kk, kk * a, scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                 head_first=head_first, reverse=reverse,
                                 cu_seqlens_cpu=cu_seqlens_cpu)


def chunk_rwkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: Optional[float] = 1.0,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    safe_gate: bool = False,
    chunk_size: Optional[int] = None,
    disable_recompute: bool = False,
    cp_context=None,
    lower_bound: Optional[float] = None,
    head_first: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""RWKV7 (diagonal plus low rank), chunk-parallel (training path): the map of
    :func:`fused_recurrent_rwkv7`,

    .. math:: h_t = \mathrm{diag}(e^{w_t}) h_{t-1} + b_t (a_t^\top h_{t-1}) + k_t v_t^\top,\quad
              o_t = s\, h_t^\top r_t

    computed in the WY/UT form over 16-row chunks (docs/algorithms.md §6). Every decay factor is a
    sum of log decays, never a difference, so any ``w <= 0`` including ``-inf`` is exact.

    Args:
        r, w, k, a, b: ``[B, T, H, K]`` (``[B, H, T, K]`` if ``head_first``); ``w`` is the log
            decay (<= 0; ``-inf`` is a hard reset). RWKV-7 layers pass ``a = -kk`` and
            ``b = kk * iclr``; any a, b are accepted.
        v: ``[B, T, H, V]``; K and V are independent (1..256).
        scale: default ``1.0`` as in fla's ``chunk_rwkv7``; ``None`` means ``K ** -0.5``.
        initial_state: float32 ``[N, H, K, V]`` (a float16 / bfloat16 one, as fla takes it, is
            lifted to float32 exactly; its gradient comes back in its dtype).
        output_final_state: also return the float32 final state; default ``False``, as in fla.
        cu_seqlens: int64 ``[N + 1]`` sequence boundaries (B must be 1).
        head_first: inputs are ``[B, H, T, D]``.
        cu_seqlens_cpu: the host copy of a CUDA ``cu_seqlens`` (as in fla): its values are
            checked without a device synchronisation.
        safe_gate, chunk_size, disable_recompute, lower_bound: fla's tuning hints, accepted so
            that fla call sites run unchanged and ignored: no bound on ``w`` is needed here,
            and the chunk size is the kernel's own (a ``lower_bound >= 0`` is refused, as fla
            refuses it). All in fla 0.6.0's positional order; ``head_first`` comes after them.
        cp_context: a context from :func:`fla_ext.cp.build_cp_context`: this call is one rank's
            slice of a packed batch split across a process group (fla_ext/cp.py).

    Returns:
        ``(o, final_state)``: ``o`` like ``v`` in the input dtype; ``final_state`` or None.
    """
    _require_tensors(r=r, w=w, k=k, v=v, a=a, b=b)
    _check_fla_hints(lower_bound=lower_bound)
    initial_state = _lift_state(initial_state, r)
    if cp_context is not None:
        _cp.check_inputs(cp_context, r, head_first, cu_seqlens, name="r")
        return _cp.rwkv7(chunk_rwkv7, cp_context, r, w, k, v, a, b, scale, initial_state,
                         output_final_state)
    _check_host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, r, head_first)
    o, ht = torch.ops.fla.chunk_rwkv7(
        r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, head_first
    )
    return o, (ht if output_final_state else None)


def _gsa_states(initial_state) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    if initial_state is None:
        return None, None
    if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
        raise TypeError("fla_ext: `initial_state` of GSA must be None or a pair (hk0, hv0) of "
                        f"float32 [N, H, K, M] and [N, H, M, V] tensors, got {type(initial_state).__name__}")
    hk0, hv0 = initial_state
    _optional_tensors(**{"initial_state[0]": hk0, "initial_state[1]": hv0})
    return hk0, hv0


def _fla_states(result):
    """(o, [hk, hv]): GSA's final states as the list fla 0.6.0 returns (fla unpacks them from its
    Function's outputs); unpacking and passing them back as ``initial_state`` work either way."""
    o, (hk, hv) = result
    return o, [hk, hv]


def _gsa_by_passes(gla_op, q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens,
                   cu_seqlens_cpu, head_first, **more):
    """GSA as its two GLA passes (gsa_passes.py) for head dims above the kernels' 256, each pass
    as slices; the GSA-level shapes checked first, naming GSA's arguments."""
    hd = 1 if head_first else 2
    lead = lambda t: tuple(t.shape[:hd]) + tuple(t.shape[hd + 1:-1])  # noqa: E731  (B, T)
    for name, t in (("k", k), ("v", v), ("s", s), ("g", g)):
        if t is not None and (t.dim() != 4 or lead(t) != lead(q)):
            raise ValueError(f"fla_ext: `{name}` must be 4-D with the batch and time of `q`, got "
                             f"{tuple(t.shape)} and {tuple(q.shape)}")
    H = k.shape[hd]
    if k.shape[-1] != q.shape[-1] or q.shape[hd] % H or v.shape[hd] != H or s.shape[hd] != H:
        raise ValueError(f"fla_ext: GSA needs q [.., HQ, K], k [.., H, K], v [.., H, V], s [.., H, M] "
                         f"with H dividing HQ; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, s {tuple(s.shape)}")
    if g is not None and g.shape != s.shape:
        raise ValueError(f"fla_ext: `g` must have the shape of `s` {tuple(s.shape)}, got {tuple(g.shape)}")
    K, V, M = k.shape[-1], v.shape[-1], s.shape[-1]
    for name, h, want in (("initial_state[0]", hk0, (H, K, M)), ("initial_state[1]", hv0, (H, M, V))):
        if h is not None and (h.dim() != 4 or tuple(h.shape[1:]) != want):
            raise ValueError(f"fla_ext: `{name}` must be [N, {', '.join(map(str, want))}], got {tuple(h.shape)}")
    if g is None:
        if more.get("reverse"):
            raise NotImplementedError("fla_ext: fused_recurrent_gsa with g=None and reverse=True at head "
                                      "dims above 256")
        keys, g = slot_gate(s, cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens, head_first)
        s, g = keys.to(k.dtype), g.to(s.dtype)
    init = None if hk0 is None and hv0 is None else (hk0, hv0)
    return two_passes(
        lambda q_, k_, v_, gk, gv, scale_, h0: gla_op(
            q_, k_, v_, gk, gv=gv, scale=scale_, initial_state=h0, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, head_first=head_first, **more),
        q, k, v, s, g, scale, init, output_final_state, heads_dim=hd)


def chunk_gsa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    output_final_state: bool = False,
    checkpoint_level: int = 2,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    head_first: bool = False,
    *,
    chunk_size: Optional[int] = None,
    cp_context=None,
) -> Tuple[torch.Tensor, Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]:
    r"""Gated Slot Attention, chunk-parallel (for training): two GLA passes sharing the slot gate
    ``g`` around a float32 softmax over the M slots:

    .. math:: H^k_t = H^k_{t-1} \mathrm{diag}(e^{g_t}) + k_t s_t^\top,\quad
              p_t = \mathrm{softmax}(\text{scale}\, {H^k_t}^\top q_t),\quad
              H^v_t = \mathrm{diag}(e^{g_t}) H^v_{t-1} + s_t v_t^\top,\quad o_t = {H^v_t}^\top p_t

    The slot logits and their gradient stay float32 between the passes for bf16 / fp16 inputs
    (fla rounds both to the input dtype, an error that grows with the logits); p enters the
    second pass in the inputs' dtype, as in fla.

    Args:
        q: ``[B, T, HQ, K]``; k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; s (slot keys) and g (log
            decay over the slots, <= 0): ``[B, T, H, M]`` (``[B, H, T, *]`` if ``head_first``).
            HQ may be a multiple of H (grouped heads, as in fla). K, V, M up to 512 (above 256
            as the two GLA passes over slices).
        g: None reproduces fla (ABC without a learned gate): with ``z_t = logcumsumexp(s)`` per
            sequence, the slot keys become ``exp(s - z)`` and ``g_t = z_{t-1} - z_t``.
        scale: defaults to ``K ** -0.5``.
        initial_state: None or ``(hk0, hv0)``, float32 ``[N, H, K, M]`` and ``[N, H, M, V]`` (16-bit
            ones lifted, as in :func:`fused_recurrent_rwkv6`).
        output_final_state, cu_seqlens, head_first: as in :func:`chunk_gla`.
        cu_seqlens_cpu: fla's host copy of a CUDA ``cu_seqlens`` (its values are then checked).
        checkpoint_level, chunk_size: accepted for drop-in use (fla's positional order) and
            without effect: a training forward keeps the float32 softmax and, on CUDA, the
            passes' chunk-start states and pair matrices. Values fla refuses are refused.

    Returns:
        ``(o, [hk, hv])``: ``o`` ``[B, T, HQ, V]``; the final states, or ``[None, None]`` (a
        list, as fla returns them).

    Example::

        >>> B, T, H, K, V, M = 2, 128, 4, 64, 64, 32
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
        >>> s = torch.randn(B, T, H, M)
        >>> g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, M))
        >>> o, (hk, hv) = fla_ext.chunk_gsa(q, k, v, s, g, output_final_state=True)
    """
    _require_tensors(q=q, k=k, v=v, s=s)
    _check_fla_hints(chunk_size=chunk_size, checkpoint_level=checkpoint_level)
    if cp_context is not None:
        _cp.check_inputs(cp_context, q, head_first, cu_seqlens, name="q")
        return _fla_states(_cp.gsa(chunk_gla, cp_context, q, k, v, s, g, scale, initial_state,
                                   output_final_state))
    _check_host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q, head_first)
    _optional_tensors(g=g)
    hk0, hv0 = (_lift_state(h, q) for h in _gsa_states(initial_state))
    if _wide.needs_slices(q.shape[-1], k.shape[-1], v.shape[-1], s.shape[-1]):
        return _fla_states(_gsa_by_passes(chunk_gla, q, k, v, s, g, scale, hk0, hv0, output_final_state,
                                          cu_seqlens, cu_seqlens_cpu, head_first))
    o, hk, hv = torch.ops.fla.chunk_gsa(q, k, v, s, g, scale, hk0, hv0, output_final_state,
                                        cu_seqlens, head_first)
    return _fla_states((o, (hk, hv) if output_final_state else (None, None)))


def fused_recurrent_gsa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    head_first: bool = False,
    *,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    cp_context=None,
) -> Tuple[torch.Tensor, Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]:
    r"""Gated Slot Attention step by step (decoding, and the check of :func:`chunk_gsa`): the same
    map and arguments as :func:`chunk_gsa`, plus ``reverse`` (run each sequence backwards in time),
    through two :func:`fused_recurrent_gla` passes.

    Example::

        >>> o, (hk, hv) = fla_ext.fused_recurrent_gsa(q[:, -1:], k[:, -1:], v[:, -1:], s[:, -1:],
        ...                                           g[:, -1:], initial_state=(hk, hv),
        ...                                           output_final_state=True)  # one decode step
    """
    _require_tensors(q=q, k=k, v=v, s=s)
    if cp_context is not None:
        _cp.check_inputs(cp_context, q, head_first, cu_seqlens, reverse, name="q")
        return _fla_states(_cp.gsa(fused_recurrent_gla, cp_context, q, k, v, s, g, scale, initial_state,
                                   output_final_state))
    _check_host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q, head_first)
    _optional_tensors(g=g)
    hk0, hv0 = (_lift_state(h, q) for h in _gsa_states(initial_state))
    if _wide.needs_slices(q.shape[-1], k.shape[-1], v.shape[-1], s.shape[-1]):
        return _fla_states(_gsa_by_passes(fused_recurrent_gla, q, k, v, s, g, scale, hk0, hv0,
                                          output_final_state, cu_seqlens, cu_seqlens_cpu, head_first,
                                          reverse=reverse))
    o, hk, hv = torch.ops.fla.fused_recurrent_gsa(q, k, v, s, g, scale, hk0, hv0,
                                                  output_final_state, reverse, cu_seqlens,
                                                  head_first)
    return _fla_states((o, (hk, hv) if output_final_state else (None, None)))
