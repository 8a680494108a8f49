"""Padded batches as varlen ones: a 2-D ``attention_mask`` [B, >= T] becomes the packed rows and
``cu_seqlens`` the ops take, and back. Any nonzero mask value is a kept token (checks.py says what
a mask may be; the layers check it before coming here)."""
from typing import Tuple

import torch
import torch.nn.functional as F


def kept_tokens(mask: torch.Tensor, T: int) -> torch.Tensor:
    """The bool [B, T] of the tokens kept by `mask` [B, >= T]: its last T columns, nonzero =
    kept (one reading for every layer, so a value like 2 never scales a token)."""
    return mask[:, mask.shape[1] - T:].bool()  # (not [:, -T:], which is every column at T = 0)


def unpad(x: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T, ...], mask [B, >= T] (its last T columns are used) -> (x [1, n, ...] of the kept
    rows, indices [n] into the flattened [B*T], cu_seqlens [B+1] int64)."""
    B, T = x.shape[:2]
    keep = kept_tokens(mask, T)
    indices = keep.flatten().nonzero(as_tuple=True)[0]
    cu = F.pad(keep.sum(1).cumsum(0), (1, 0)).to(torch.int64)
    return x.flatten(0, 1).index_select(0, indices).unsqueeze(0), indices, cu


def repad(x: torch.Tensor, indices: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """Inverse of unpad: x [1, n, ...] -> [B, T, ...] with zeros at the padded positions."""
    out = x.new_zeros(B * T, *x.shape[2:])
    out.index_copy_(0, indices, x[0])
    return out.view(B, T, *x.shape[2:])


def unpad_inputs(x: torch.Tensor, attention_mask, cu_seqlens):
    """The layers' entry: explicit cu_seqlens win; else a mask turns the batch into varlen.
    Returns (x, indices or None, cu_seqlens or None)."""
    if cu_seqlens is None and attention_mask is not None:
        return unpad(x, attention_mask)
    return x, None, cu_seqlens
