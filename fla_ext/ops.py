"""Python entry points with fla's signatures (plus ``head_first``).

Layouts: activations are ``[B, T, H, D]``, or ``[B, H, T, D]`` with ``head_first=True`` (read by
strides, never copied). States are float32 ``[N, H, K, V]``; N = B, or the number of sequences
with ``cu_seqlens`` (then B must be 1). Log decays ``w <= 0`` multiply the state by ``exp(w)``.
"""
import os
from typing import Optional, Tuple

import torch

__all__ = [
    "chunk_gla",
    "chunk_rwkv6",
    "fused_recurrent_gla",
    "fused_recurrent_rwkv6",
    "set_checks",
]


def set_checks(enabled: bool = True) -> None:
    """Turn on value checks that read device memory (non-finite inputs, positive log decays,
    malformed ``cu_seqlens``). Same as ``FLA_EXT_CHECKS=1``. They synchronise with the host,
    so leave them off in production and inside CUDA-graph capture."""
    os.environ["FLA_EXT_CHECKS"] = "1" if enabled else "0"


def _require_tensors(**named) -> None:
    # The dispatcher's own message for None/non-tensors ("tensor does not have a device") does
    # not say which argument is wrong.
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"fla_ext: `{name}` must be a torch.Tensor, got {type(x).__name__}")


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
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""RWKV6 recurrence, step by step (fused recurrent kernel):

    .. math:: o_t = s\,(h_{t-1} + \mathrm{diag}(u) k_t v_t^\top)^\top r_t,\quad
              h_t = \mathrm{diag}(e^{w_t}) h_{t-1} + k_t v_t^\top

    Args:
        r, k, w: ``[B, T, H, K]`` (``[B, H, T, K]`` if ``head_first``); ``w`` is the log decay
            (<= 0; ``-inf`` is a hard reset).
        v: ``[B, T, H, V]``; K and V are independent (1..256).
        u: ``[H, K]`` bonus for the current token.
        scale: defaults to ``K ** -0.5``.
        initial_state: float32 ``[N, H, K, V]``.
        output_final_state: also return the float32 final state ``[N, H, K, V]``.
        reverse: run the recurrence from the last token to the first.
        cu_seqlens: int64 ``[N + 1]`` sequence boundaries (B must be 1).
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
    cu_seqlens: Optional[torch.Tensor] = None,
    head_first: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""Gated linear attention, step by step (fused recurrent kernel):

    .. math:: h_t = \mathrm{diag}(e^{g_t}) h_{t-1} + k_t v_t^\top,\quad o_t = s\, h_t^\top q_t

    Args:
        q, k, gk: ``[B, T, H, K]`` (``[B, H, T, K]`` if ``head_first``); ``gk`` is the log decay
            on the key dimension (<= 0; ``-inf`` is a hard reset), or None for no decay.
        v: ``[B, T, H, V]``; K and V are independent (1..256).
        gv: value-side decay of fla's signature: not supported yet (raises).
        scale: defaults to ``K ** -0.5``.
        initial_state: float32 ``[N, H, K, V]``; output_final_state, reverse, cu_seqlens,
            head_first: as in :func:`fused_recurrent_rwkv6`.

    Returns:
        ``(o, final_state)``: ``o`` like ``v`` in the input dtype; ``final_state`` or None.
    """
    if gv is not None:
        raise NotImplementedError("fla_ext.fused_recurrent_gla: the value-side decay `gv` is not "
                                  "supported yet; pass the key-side decay `gk`")
    _require_tensors(q=q, k=k, v=v)
    if gk is not None:
        _require_tensors(gk=gk)
    o, ht = torch.ops.fla.fused_recurrent_gla(
        q, k, v, gk, scale, initial_state, output_final_state, reverse, cu_seqlens, head_first
    )
    return o, (ht if output_final_state else None)


def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    head_first: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""Gated linear attention, chunk-parallel (for training): the same map as
    :func:`fused_recurrent_gla` with ``gk=g``, computed chunk by chunk (64 rows) with every decay
    factor formed so that its exponent is never positive (any ``g <= 0``, ``-inf`` included).

    Args:
        q, k, g: ``[B, T, H, K]`` (``[B, H, T, K]`` if ``head_first``); ``g`` is the log decay.
        v: ``[B, T, H, V]``. scale (default ``K ** -0.5``), initial_state, output_final_state,
            cu_seqlens, head_first: as in :func:`fused_recurrent_rwkv6`.

    Returns:
        ``(o, final_state)``.
    """
    _require_tensors(q=q, k=k, v=v, g=g)
    o, ht = torch.ops.fla.chunk_gla(
        q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, head_first
    )
    return o, (ht if output_final_state else None)


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
    head_first: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""RWKV6, chunk-parallel (for training): the same map as :func:`fused_recurrent_rwkv6`
    (exclusive read plus the bonus ``u``), computed chunk by chunk with never-positive decay
    exponents. Arguments and returns as in :func:`fused_recurrent_rwkv6` (no ``reverse``)."""
    _require_tensors(r=r, k=k, v=v, w=w, u=u)
    o, ht = torch.ops.fla.chunk_rwkv6(
        r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, head_first
    )
    return o, (ht if output_final_state else None)
