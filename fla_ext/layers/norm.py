"""fla's RMSNorm (docs/layers.md §0): float32 weight of ones, normalised in float32, output in the
input's dtype; `gate` multiplies swish(gate) in (fla's FusedRMSNormGated)."""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = (nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
                       if elementwise_affine else None)

    def forward(self, x: torch.Tensor, gate: Optional[torch.Tensor] = None,
                eps: Optional[float] = None) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + (self.eps if eps is None else eps))
        if self.weight is not None:
            y = y * self.weight.float()
        if gate is not None:
            y = y * F.silu(gate.float())
        return y.to(x.dtype)
