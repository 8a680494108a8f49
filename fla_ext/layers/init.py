"""Orthogonal initialisation drawn in float32 and copied into the parameter, so that a bfloat16
(or float16) module gets the same values rounded once (fla's own init is lost in bf16)."""
import math

import torch
import torch.nn as nn


@torch.no_grad()
def orthogonal_(w: torch.Tensor, gain: float) -> None:
    value = torch.empty(w.shape, dtype=torch.float32)
    nn.init.orthogonal_(value, gain=gain)
    w.copy_(value)


def rwkv_orthogonal_(w: torch.Tensor, gain: float) -> None:
    """The official RWKV recipe (generate_init_weight): the gain grows by sqrt(out/in) for tall
    matrices."""
    out_f, in_f = w.shape
    orthogonal_(w, gain * (math.sqrt(out_f / in_f) if out_f > in_f else 1.0))
