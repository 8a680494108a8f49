"""GatedLinearAttention, fla's drop-in (fla/layers/gla.py): same constructor, parameter names,
shapes, forward and cache; the ops are fla_ext's chunk_gla / fused_recurrent_gla. fla's
'fused_chunk' mode runs the chunk op (the same map). Parameters keep PyTorch's default init, as
fla's layer does (its model applies its own)."""
import math
import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import chunk_gla, fused_recurrent_gla
from .cache import Cache
from .checks import begin_forward
from .conv import add_qkv_convs, project_qkv
from .norm import RMSNorm
from .padding import repad, unpad_inputs

_ACT = {"swish": F.silu, "silu": F.silu, "sigmoid": torch.sigmoid, "relu": F.relu,
        "gelu": F.gelu, "tanh": torch.tanh}


class GatedLinearAttention(nn.Module):
    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 0.5,
                 expand_v: float = 1.0, num_heads: int = 4, num_kv_heads: Optional[int] = None,
                 feature_map: Optional[str] = None, use_short_conv: bool = False,
                 conv_size: int = 4, conv_bias: bool = False, use_output_gate: bool = True,
                 gate_fn: str = "swish", elementwise_affine: Optional[bool] = True,
                 norm_eps: float = 1e-5, gate_logit_normalizer: int = 16,
                 gate_low_rank_dim: int = 16, clamp_min: Optional[float] = None,
                 fuse_norm: bool = True, layer_idx: Optional[int] = None, **kwargs) -> None:
        super().__init__()
        if mode not in ("chunk", "fused_recurrent", "fused_chunk"):
            raise ValueError(f"fla_ext: GatedLinearAttention `mode` must be 'chunk', "
                             f"'fused_recurrent' or 'fused_chunk', got {mode!r}")
        for name, fn in (("feature_map", feature_map), ("gate_fn", gate_fn)):
            if fn is not None and fn not in _ACT:
                raise ValueError(f"fla_ext: unknown {name} {fn!r} (one of {sorted(_ACT)})")
        self.mode, self.hidden_size, self.num_heads = mode, hidden_size, num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"fla_ext: num_heads ({num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        self.num_kv_groups = num_heads // self.num_kv_heads
        key_dim, value_dim = hidden_size * expand_k, hidden_size * expand_v
        self.key_dim, self.value_dim = round(key_dim), round(value_dim)
        if not (math.isclose(key_dim, self.key_dim) and math.isclose(value_dim, self.value_dim)):
            raise ValueError("fla_ext: hidden_size * expand_k and * expand_v must be integers")
        if self.key_dim % num_heads or self.value_dim % num_heads:
            raise ValueError(f"fla_ext: key_dim {self.key_dim} and value_dim {self.value_dim} "
                             f"must be divisible by num_heads {num_heads}")
        self.key_dim_per_group = self.key_dim // self.num_kv_groups
        self.value_dim_per_group = self.value_dim // self.num_kv_groups
        self.head_k_dim, self.head_v_dim = self.key_dim // num_heads, self.value_dim // num_heads
        self.feature_map_fn = _ACT[feature_map] if feature_map is not None else None
        self.use_short_conv, self.use_output_gate = use_short_conv, use_output_gate
        self.conv_size, self.conv_bias = conv_size, conv_bias
        self.gate_logit_normalizer, self.clamp_min = gate_logit_normalizer, clamp_min
        self.layer_idx = layer_idx
        if layer_idx is None:
            warnings.warn("fla_ext: GatedLinearAttention without `layer_idx` cannot use a cache")

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim_per_group, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim_per_group, bias=False)
        if use_output_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if use_short_conv:
            add_qkv_convs(self, self.key_dim, self.key_dim_per_group, self.value_dim_per_group,
                          conv_size, conv_bias)
        self.gk_proj = nn.Sequential(nn.Linear(hidden_size, gate_low_rank_dim, bias=False),
                                     nn.Linear(gate_low_rank_dim, self.key_dim_per_group, bias=True))
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.fuse_norm_and_gate = gate_fn == "swish" and fuse_norm and use_output_gate
        norm = RMSNorm(self.head_v_dim, elementwise_affine=bool(elementwise_affine), eps=norm_eps)
        if self.fuse_norm_and_gate:
            self.g_norm_swish_gate = norm
        else:
            self.g_norm = norm
            self.gate_fn = _ACT[gate_fn]

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[Cache] = None, use_cache: Optional[bool] = False,
                output_attentions: Optional[bool] = False, **kwargs):
        """hidden_states [B, T, hidden_size] -> (o like it, None, past_key_values).

        attention_mask: bool or integer [B, T'] (T' >= T; its last T columns are used), nonzero
        = a kept token. The kept tokens of each row, in order, are its sequence: padded tokens
        are removed (left, right or inside a row) and get a zero output.
        kwargs ``cu_seqlens`` [N + 1] (B = 1: N sequences packed along T; it wins over a mask)
        and fla's ``cu_seqlens_cpu`` (its host copy: values checked without a device sync).
        A cache (past_key_values) needs layer_idx and belongs to one batch of N sequences.
        Every input is checked first (layers/checks.py)."""
        cu_seqlens, cu_seqlens_cpu, cp_context, last = begin_forward(
            self, hidden_states, attention_mask, past_key_values, use_cache, kwargs.get("cu_seqlens"), kwargs,
            left_padded=False)
        B, T, _ = hidden_states.shape
        mode = "fused_recurrent" if T <= 64 else self.mode
        x, indices, cu_seqlens = unpad_inputs(hidden_states, attention_mask, cu_seqlens)
        q, k, v, conv_state = project_qkv(self, x, last, use_cache, cu_seqlens, cu_seqlens_cpu, cp_context)
        gk = self.gk_proj(x).unflatten(-1, (self.num_kv_heads, self.head_k_dim))
        if self.num_kv_groups > 1:  # kv head i feeds query heads i*g .. i*g+g-1 (as fla)
            k, v, gk = (t.repeat_interleave(self.num_kv_groups, 2) for t in (k, v, gk))
        gk = F.logsigmoid(gk) / self.gate_logit_normalizer
        if self.clamp_min is not None:
            gk = torch.clamp_min(gk, self.clamp_min)
        if self.feature_map_fn is not None:
            q, k = self.feature_map_fn(q), self.feature_map_fn(k)
        state = last["recurrent_state"] if last else None
        kw = dict(initial_state=state, output_final_state=bool(use_cache), cu_seqlens=cu_seqlens,
                  cu_seqlens_cpu=cu_seqlens_cpu)
        if cp_context is not None:
            kw = dict(cp_context=cp_context)
        if mode == "fused_recurrent":
            o, ht = fused_recurrent_gla(q, k, v, gk=gk, **kw)
        else:
            o, ht = chunk_gla(q, k, v, gk, **kw)
        if past_key_values is not None:
            past_key_values.update(self.layer_idx, recurrent_state=ht if use_cache else None,
                                   conv_state=conv_state, offset=T)
        if self.use_output_gate:
            g = self.g_proj(x)
            if self.fuse_norm_and_gate:
                o = self.g_norm_swish_gate(o, g.unflatten(-1, (self.num_heads, self.head_v_dim)))
                o = o.flatten(-2)
            else:
                o = self.g_norm(o).flatten(-2) * self.gate_fn(g)
        else:
            o = self.g_norm(o).flatten(-2)
        o = self.o_proj(o)
        if indices is not None:
            o = repad(o, indices, B, T)
        return o, None, past_key_values
