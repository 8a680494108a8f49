"""GatedSlotAttention, fla's drop-in (docs/layers.md §3): same constructor, parameter names, shapes,
forward and cache; the op is fla_ext's chunk_gsa / fused_recurrent_gsa."""
import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import chunk_gsa, fused_recurrent_gsa
from .cache import Cache
from .checks import begin_forward
from .conv import add_qkv_convs, project_qkv
from .norm import RMSNorm
from .padding import repad, unpad_inputs


class _T2R(nn.Module):
    """fla's 't2r' feature map: relu(Linear(D -> D, no bias)); state-dict name `layer`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layer = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return F.relu(self.layer(x))


class GatedSlotAttention(nn.Module):
    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 1.0,
                 expand_v: float = 1.0, num_heads: int = 4, num_kv_heads: Optional[int] = None,
                 use_short_conv: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 num_slots: Optional[int] = None, elementwise_affine: Optional[bool] = True,
                 norm_eps: float = 1e-5, gate_logit_normalizer: int = 8,
                 feature_map: str = "swish", use_output_gate: bool = False, use_norm: bool = True,
                 layer_idx: Optional[int] = None, scale: Optional[float] = 1.0, **kwargs) -> None:
        super().__init__()
        if mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"fla_ext: GatedSlotAttention `mode` must be 'chunk' or "
                             f"'fused_recurrent', got {mode!r}")
        self.mode = mode
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"fla_ext: num_heads ({num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        self.num_kv_groups = num_heads // self.num_kv_heads
        self.key_dim = int(hidden_size * expand_k)
        self.value_dim = int(hidden_size * expand_v)
        if self.key_dim % num_heads or self.value_dim % num_heads:
            raise ValueError(f"fla_ext: key_dim {self.key_dim} and value_dim {self.value_dim} "
                             f"must be divisible by num_heads {num_heads}")
        if self.value_dim != hidden_size:
            # g_norm is sized by hidden_size and applied to value_dim features (as in fla)
            raise ValueError(f"fla_ext: GatedSlotAttention needs expand_v = 1 (value_dim "
                             f"{self.value_dim} != hidden_size {hidden_size}), as fla's does")
        self.key_dim_per_group = self.key_dim // self.num_kv_groups
        self.value_dim_per_group = self.value_dim // self.num_kv_groups
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads
        self.num_slots = num_slots if num_slots is not None else self.head_k_dim
        self.gate_logit_normalizer = gate_logit_normalizer
        self.use_short_conv = use_short_conv
        self.conv_size, self.conv_bias = conv_size, conv_bias
        self.use_output_gate, self.use_norm = use_output_gate, use_norm  # accepted, unused (fla)
        self.scale = scale
        self.norm_eps = norm_eps
        self.layer_idx = layer_idx
        if layer_idx is None:
            warnings.warn("fla_ext: GatedSlotAttention without `layer_idx` cannot use a cache")

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim_per_group, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim_per_group, bias=False)
        self.f_proj = nn.Linear(hidden_size, self.num_kv_heads * self.num_slots, bias=False)
        if use_short_conv:
            add_qkv_convs(self, self.key_dim, self.key_dim_per_group, self.value_dim_per_group,
                          conv_size, conv_bias)
        if feature_map == "t2r":
            self.feature_map = _T2R(self.head_k_dim)
        elif feature_map in ("swish", "silu"):
            self.feature_map = nn.SiLU()
        elif feature_map == "relu":
            self.feature_map = nn.ReLU()
        else:
            raise ValueError(f"fla_ext: unknown feature_map {feature_map!r} "
                             f"('swish', 'relu' or 't2r')")
        self.g_norm = RMSNorm(hidden_size, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[Cache] = None, use_cache: Optional[bool] = False,
                output_attentions: Optional[bool] = False, **kwargs):
        """As :meth:`GatedLinearAttention.forward` (the same mask, cu_seqlens and cache rules:
        padded tokens are removed, wherever they are)."""
        cu_seqlens, cu_seqlens_cpu, cp_context, last = begin_forward(
            self, hidden_states, attention_mask, past_key_values, use_cache, kwargs.get("cu_seqlens"), kwargs,
            left_padded=False)
        B, T, _ = hidden_states.shape
        mode = "fused_recurrent" if T <= 64 else self.mode
        x, indices, cu_seqlens = unpad_inputs(hidden_states, attention_mask, cu_seqlens)

        q, k, v, conv_state = project_qkv(self, x, last, use_cache, cu_seqlens, cu_seqlens_cpu, cp_context)
        f = self.f_proj(x)
        f = f.unflatten(-1, (self.num_kv_heads, self.num_slots))
        q, k = self.feature_map(q), self.feature_map(k)
        v = F.silu(v)
        f = F.logsigmoid(f) / self.gate_logit_normalizer
        s = (1 - f.exp()).to(f.dtype)
        # The ops take grouped heads (k, v, s, f per key head): no repeat here.
        state = last["recurrent_state"] if last is not None else None
        op = chunk_gsa if mode == "chunk" else fused_recurrent_gsa
        if cp_context is not None:
            o, (hk, hv) = op(q, k, v, s, f, scale=self.scale, cp_context=cp_context)
        else:
            o, (hk, hv) = op(q, k, v, s, f, scale=self.scale,
                             initial_state=tuple(state) if state is not None else None,
                             output_final_state=bool(use_cache), cu_seqlens=cu_seqlens,
                             cu_seqlens_cpu=cu_seqlens_cpu)
        if past_key_values is not None:
            past_key_values.update(self.layer_idx, recurrent_state=(hk, hv) if use_cache else None,
                                   conv_state=conv_state, offset=T)
        o = o.flatten(-2)
        o = self.o_proj(self.g_norm(F.silu(o), eps=1e-5))  # fla's fused norm: eps 1e-5
        if indices is not None:
            o = repad(o, indices, B, T)
        return o, None, past_key_values
