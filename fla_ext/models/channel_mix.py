"""RWKV's channel mix (the feed-forward half of a block): a token-shifted squared-ReLU FFN, as
RWKV-6 (key and receptance through token-shift mixes, a sigmoid receptance gate) and RWKV-7
(one mix into the key, no gate) define it. The shift reads the previous token across a cache
(generation) and across ranks (context parallelism). The backward keeps the squared ReLU's input
and the mix's x and delta only (layers/lean_linear.py)."""
from typing import Optional

import torch
import torch.nn as nn

from ..layers import Cache
from ..layers.rwkv6 import LerpLinear
from ..layers.lean_linear import mixed, squared_relu
from ..layers.shift import token_shift


def _shift(layer_idx, x, attention_mask, cache: Optional[Cache], cu_seqlens, cp_context):
    """(x masked, x_{t-1} - x_t): the previous token from the cache's ``ffn_state`` when decoding,
    from the previous rank under ``cp_context``; the cache gets the last token."""
    if attention_mask is not None:
        x = x * attention_mask[:, -x.shape[1]:, None].to(x.dtype)
    last = cache[layer_idx]["ffn_state"] if cache is not None and len(cache) > layer_idx else None
    if cp_context is not None:  # the row before the slice, from the previous rank
        from .. import cp
        last = cp.halo(cp_context, x, 1)[:, -1]
        cu_seqlens = cp_context.cu_seqlens
    delta, state = token_shift(x, cu_seqlens, last)
    if cache is not None:
        cache.update(layer_idx, ffn_state=state, offset=0)
    return x, delta


def _intermediate(hidden_size, hidden_ratio, intermediate_size, default_ratio):
    if intermediate_size is None:
        intermediate_size = 32 * ((int(hidden_size * (hidden_ratio or default_ratio)) + 31) // 32)
    return intermediate_size


def _sqrelu_only(hidden_act, family):
    if hidden_act != "sqrelu":
        raise NotImplementedError(f"fla_ext.models: {family} hidden_act {hidden_act!r} (only 'sqrelu')")


class RWKV6FeedForward(nn.Module):
    """sigmoid(receptance(x + delta mu_r)) * value(relu(key(x + delta mu_k))^2)."""

    def __init__(self, hidden_size: int, hidden_ratio: Optional[float] = None,
                 intermediate_size: Optional[int] = None, hidden_act: str = "sqrelu", layer_idx: int = 0):
        super().__init__()
        _sqrelu_only(hidden_act, "RWKV6")
        intermediate_size = _intermediate(hidden_size, hidden_ratio, intermediate_size, 3.5)
        self.hidden_size, self.intermediate_size, self.layer_idx = hidden_size, intermediate_size, layer_idx
        self.key = LerpLinear(hidden_size, intermediate_size)
        self.value = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.receptance = LerpLinear(hidden_size, hidden_size)

    def forward(self, x, attention_mask=None, cache: Optional[Cache] = None, cu_seqlens=None, **kwargs):
        x, delta = _shift(self.layer_idx, x, attention_mask, cache, cu_seqlens, kwargs.get("cp_context"))
        value = squared_relu(self.value, self.key(x, delta))
        return torch.sigmoid(self.receptance(x, delta)) * value


class RWKV7FeedForward(nn.Module):
    """value(relu(key(x + delta x_k))^2)."""

    def __init__(self, hidden_size: int, hidden_ratio: Optional[int] = None,
                 intermediate_size: Optional[int] = None, hidden_act: str = "sqrelu",
                 layer_idx: int = 0, num_hidden_layers: int = 1):
        super().__init__()
        _sqrelu_only(hidden_act, "RWKV7")
        intermediate_size = _intermediate(hidden_size, hidden_ratio, intermediate_size, 4)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.layer_idx, self.num_hidden_layers = layer_idx, num_hidden_layers
        self.x_k = nn.Parameter(torch.zeros(hidden_size))
        self.key = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.value = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """RWKV-7's channel-mix init (x_k from the layer depth, key orthogonal, value zero),
        computed in float32."""
        ratio = 1.0 - self.layer_idx / max(1, self.num_hidden_layers)
        ddd = torch.arange(self.hidden_size, dtype=torch.float32) / self.hidden_size
        self.x_k.copy_(1.0 - torch.pow(ddd, ratio ** 4))
        w = torch.empty(self.key.weight.shape, dtype=torch.float32, device=self.key.weight.device)
        if w.device.type != "meta":
            self.key.weight.copy_(nn.init.orthogonal_(w))
        self.value.weight.zero_()

    def forward(self, x, attention_mask=None, cache: Optional[Cache] = None, cu_seqlens=None, **kwargs):
        x, delta = _shift(self.layer_idx, x, attention_mask, cache, cu_seqlens, kwargs.get("cp_context"))
        return squared_relu(self.value, mixed(self.key, x, delta, self.x_k))
