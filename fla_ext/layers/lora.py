"""fla's LoRA (docs/layers.md §0): Sequential(Linear(in -> r, no bias), act, Linear(r -> out, bias)) as
`lora`, with fla's init: the first factor 0, the second orthogonal with gain
0.1 * sqrt(r / out) (r > out) or 0.1, the bias 0; float32 values copied into any dtype."""
import math
from typing import Optional

import torch
import torch.nn as nn

from .init import orthogonal_


class LoRA(nn.Module):
    def __init__(self, input_dim: int, output_dim: int, low_rank_dim: int, bias: bool = True,
                 activation: Optional[str] = "tanh") -> None:
        super().__init__()
        acts = {"tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "relu": nn.ReLU, None: nn.Identity}
        if activation not in acts:
            raise ValueError(f"fla_ext: LoRA activation {activation!r} is not one of {list(acts)}")
        self.input_dim, self.output_dim, self.low_rank_dim = input_dim, output_dim, low_rank_dim
        self.lora = nn.Sequential(nn.Linear(input_dim, low_rank_dim, bias=False), acts[activation](),
                                  nn.Linear(low_rank_dim, output_dim, bias=bias))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.lora[0].weight.zero_()
        r, out = self.low_rank_dim, self.output_dim
        orthogonal_(self.lora[2].weight, 0.1 * (math.sqrt(r / out) if r > out else 1.0))
        if self.lora[2].bias is not None:
            self.lora[2].bias.zero_()

    def forward(self, x):
        return self.lora(x)
