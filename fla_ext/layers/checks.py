"""Input checks the layers run at the start of forward, so that a bad input fails in the layer's
terms (its argument names, its hidden_size, its layer_idx) instead of producing silent garbage or a
raw torch error about a tensor the user never passed (``initial_state``, a broadcast deep inside).

Mask semantics (all layers): ``attention_mask`` is bool or integer, [B, T'] with T' >= T; its
last T columns are the tokens of ``hidden_states`` (fla's decoding convention: the mask may cover
the tokens already in the cache). Any nonzero value is a kept token, 0 a padded one (what
``mask.bool()`` reads). A floating mask is refused: an additive mask (0 keeps, -inf drops) would
read inverted, and a fractional one would scale tokens instead of masking them.

Only metadata is read, except for values that sit on the host (a CPU mask or ``cu_seqlens``,
``cu_seqlens_cpu``) or, with ``fla_ext.checks.set_checks(True)``, device values: reading those
synchronises with the GPU."""
from typing import Any, Dict, Optional

import torch

from .. import cp as _cp
from ..checks import check_cu_seqlens_values, checks_enabled
from .cache import layer_cache

__all__ = ["require_tensor", "require_floating", "check_hidden_states", "check_mask_dtype",
           "check_attention_mask", "check_cu_seqlens", "check_cache", "check_v_first",
           "check_forward"]

_STATE_KEYS = ("recurrent_state", "conv_state")  # the entries whose rows are the sequences


def _who(layer) -> str:
    return f"fla_ext: {type(layer).__name__}"


def _shape(t: torch.Tensor) -> str:
    return str(list(t.shape))


def require_tensor(layer, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{_who(layer)} expects `{name}` to be a torch.Tensor, got "
                        f"{type(t).__name__}")


def require_floating(layer, name: str, t) -> None:
    require_tensor(layer, name, t)
    if not t.is_floating_point():
        raise ValueError(f"{_who(layer)} expects a floating-point `{name}`, got {t.dtype}")


def check_hidden_states(layer, x) -> None:
    """x must be [B, T, hidden_size]: the projections would otherwise fail with a matmul error
    (wrong size) or mix batch and time (rank 2)."""
    require_floating(layer, "hidden_states", x)
    if x.dim() != 3 or x.shape[-1] != layer.hidden_size:
        raise ValueError(f"{_who(layer)} expects hidden_states [B, T, {layer.hidden_size}], "
                         f"got {_shape(x)}")


def check_mask_dtype(layer, name: str, mask) -> None:
    """bool or integer only (module docstring: a floating mask may be additive)."""
    require_tensor(layer, name, mask)
    if mask.is_floating_point() or mask.is_complex():
        raise ValueError(f"{_who(layer)} expects a bool or integer `{name}` (nonzero = a kept "
                         f"token), got {mask.dtype}: a floating mask may be additive (0 keeps, "
                         f"-inf drops) and would read inverted; pass a 0/1 mask as .bool()")


def _first_unpadded_row(keep: torch.Tensor) -> int:
    """Index of the first row of the bool mask `keep` that has a padded token after a kept one
    (a row that is not 0...0 1...1), or -1."""
    bad = (keep[:, :-1] & ~keep[:, 1:]).any(1)
    rows = bad.nonzero()
    return int(rows[0, 0]) if rows.numel() else -1


def check_attention_mask(layer, mask, x: torch.Tensor, left_padded: bool) -> None:
    """mask [B, T'] with T' >= T (module docstring). A shorter mask would misalign its rows
    with the tokens; a [1, T'] mask would broadcast over the batch. `left_padded`: the layer
    zeroes padded tokens instead of removing them (the RWKV layers), so a padded token after a
    kept one would still decay the state; every row must then be 0...0 1...1. That is a value
    check: run on a CPU mask, and on a device mask when the value checks are on."""
    if mask is None:
        return
    check_mask_dtype(layer, "attention_mask", mask)
    B, T = x.shape[:2]
    if mask.dim() != 2 or mask.shape[0] != B or mask.shape[1] < T:
        raise ValueError(f"{_who(layer)} expects attention_mask [B, T'] with B = {B} and "
                         f"T' >= T = {T} (its last T columns mark the tokens of hidden_states), "
                         f"got {_shape(mask)}")
    if mask.device != x.device:
        raise ValueError(f"{_who(layer)}: attention_mask is on {mask.device} but hidden_states "
                         f"on {x.device}")
    if left_padded and (mask.device.type == "cpu" or checks_enabled()):
        row = _first_unpadded_row(mask.bool())
        if row >= 0:
            raise ValueError(f"{_who(layer)} needs a left-padded attention_mask (each row "
                             f"0...0 1...1): it zeroes padded tokens rather than removing them, "
                             f"so a padded token after a kept one would still change the state; "
                             f"row {row} is not (for packed sequences pass cu_seqlens)")


def check_cu_seqlens(layer, cu, cu_cpu, x: torch.Tensor) -> None:
    """cu_seqlens [N + 1] over the T packed tokens of x [1, T, ...]. Its values are read from
    `cu_cpu` (fla's ``cu_seqlens_cpu``: no device synchronisation) when given, else from a CPU
    `cu` always and from a device `cu` only when the value checks are on. Unchecked, malformed
    boundaries make the ops return meaningless rows, and the conv and token shift index with
    them."""
    if cu is None:
        if cu_cpu is not None:
            raise ValueError(f"{_who(layer)} was given `cu_seqlens_cpu` without `cu_seqlens`")
        return
    require_tensor(layer, "cu_seqlens", cu)
    if cu.dim() != 1 or cu.shape[0] < 2 or cu.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{_who(layer)} expects cu_seqlens as a 1-D integer (int64 or int32) "
                         f"tensor of N + 1 sequence boundaries, got {cu.dtype} {_shape(cu)}")
    if x.shape[0] != 1:
        raise ValueError(f"{_who(layer)} with cu_seqlens needs B = 1 (the sequences packed along "
                         f"T), got B = {x.shape[0]}")
    T = x.shape[1]
    if cu_cpu is not None:
        _cu_values(layer, cu_cpu, T, "cu_seqlens_cpu", cu)
    elif cu.device.type == "cpu" or checks_enabled():
        _cu_values(layer, cu.cpu(), T, "cu_seqlens")


def _cu_values(layer, cu, total: int, name: str, device_copy=None) -> None:
    """fla_ext.checks' value check, its message prefixed with the layer (which one of a model's
    layers got the bad argument)."""
    try:
        check_cu_seqlens_values(cu, total, name, device_copy)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{_who(layer)}: {str(e).removeprefix('fla_ext: ')}") from None


def _rows(value):
    """The leading sizes of the tensors in a cache entry (a tensor or a tuple of them)."""
    if isinstance(value, torch.Tensor):
        return [value.shape[0]] if value.dim() else []
    if isinstance(value, (tuple, list)):
        return [n for v in value for n in _rows(v)]
    return []


def check_cache(layer, cache, num_seqs: int) -> Optional[Dict[str, Any]]:
    """Returns the layer's cache entry (or None). A layer without layer_idx has no slot in a
    shared cache (it would read and write another layer's); a cache filled for another batch
    would hand its states to the wrong sequences (or fail in the op on `initial_state`)."""
    if cache is None:
        return None
    if layer.layer_idx is None:
        raise ValueError(f"{_who(layer)} was built with layer_idx=None, so it has no slot in the "
                         f"Cache given as past_key_values; build it with layer_idx set to its "
                         f"index in the model")
    entry = layer_cache(cache, layer.layer_idx)
    for key in _STATE_KEYS:
        for n in _rows((entry or {}).get(key)):
            if n != num_seqs:
                raise ValueError(f"{_who(layer)} layer {layer.layer_idx}: the cache was built "
                                 f"for {n} sequences but the input has {num_seqs}; pass a new "
                                 f"Cache() for a new batch")
    return entry


def check_v_first(layer, v_first, shape) -> None:
    """RWKV7's value residual is lerped into this layer's v [B, T, value_dim]; another shape
    would broadcast (a [1, T, C] v_first mixes one sequence's values into all)."""
    if v_first is None:
        raise ValueError(f"{_who(layer)} layer {layer.layer_idx} needs `v_first` (layer 0's "
                         f"values, returned by its forward)")
    require_tensor(layer, "v_first", v_first)
    if tuple(v_first.shape) != tuple(shape):
        raise ValueError(f"{_who(layer)} layer {layer.layer_idx} expects v_first {list(shape)} "
                         f"(layer 0's values: the shape of this layer's v), got "
                         f"{_shape(v_first)}")


def check_forward(layer, hidden_states, attention_mask, past_key_values, cu_seqlens,
                  cu_seqlens_cpu, left_padded: bool) -> Optional[Dict[str, Any]]:
    """The checks every attention layer runs first, in argument order; returns the layer's
    cache entry (None when there is none)."""
    check_hidden_states(layer, hidden_states)
    check_attention_mask(layer, attention_mask, hidden_states, left_padded)
    check_cu_seqlens(layer, cu_seqlens, cu_seqlens_cpu, hidden_states)
    num_seqs = hidden_states.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return check_cache(layer, past_key_values, num_seqs)


def begin_forward(layer, hidden_states, attention_mask, past_key_values, use_cache, cu_seqlens,
                  kwargs, left_padded: bool):
    """What every attention layer's forward does first: the call's sequences (``cu_seqlens``
    with fla's ``cu_seqlens_cpu`` from kwargs, or, with kwargs ``cp_context``, this rank's slice
    of a batch split across ranks: fla_ext.cp), then check_forward. Returns (cu_seqlens,
    cu_seqlens_cpu, cp_context, the layer's cache entry or None)."""
    cu_seqlens_cpu, cp_context = kwargs.get("cu_seqlens_cpu"), kwargs.get("cp_context")
    if cp_context is not None:
        cu_seqlens, cu_seqlens_cpu = _cp.layer_inputs(layer, cp_context, hidden_states, attention_mask,
                                                      past_key_values, use_cache, cu_seqlens)
    last = check_forward(layer, hidden_states, attention_mask, past_key_values, cu_seqlens,
                         cu_seqlens_cpu, left_padded)
    return cu_seqlens, cu_seqlens_cpu, cp_context, last
