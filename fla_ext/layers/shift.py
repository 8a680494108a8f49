"""fla's token shift (docs/layers.md §0): delta = previous token - current token, the RWKV layers'
time mix, and the cache it leaves (each sequence's last token)."""
from typing import Optional

import torch
import torch.nn.functional as F


def token_shift(x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                cache: Optional[torch.Tensor] = None):
    """x [B, T, C] (B = 1 with cu_seqlens) -> (delta [B, T, C], last token of each sequence [N, C]).
    At a sequence start the previous token is that sequence's row of `cache` [N, C], or 0."""
    shifted = F.pad(x, (0, 0, 1, -1))
    if cu_seqlens is None:
        if cache is not None:
            shifted[:, 0] = cache.to(x.dtype)
        return shifted - x, x[:, -1]
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    nonempty = ends > starts
    shifted[0, starts[nonempty]] = (cache[nonempty].to(x.dtype) if cache is not None else 0)
    last = x[0, (ends - 1).clamp(min=0)]
    if cache is not None:  # an empty sequence keeps its cache
        last = torch.where(nonempty[:, None], last, cache.to(x.dtype))
    else:
        last = torch.where(nonempty[:, None], last, torch.zeros_like(last))
    return shifted - x, last
