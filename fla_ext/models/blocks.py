"""The two block shapes of the four models, each with fla's parameter names: RWKV blocks (RWKV-6,
RWKV-7: LayerNorms, the time mix, the channel mix, a pre-norm after the embeddings in block 0)
and pre-norm blocks with a gated MLP (GLA, GSA: RMSNorms, the attention layer, SwiGLU). A family
names its attention layer and channel mix; the block passes the backbone's carry through."""
from typing import Optional

import torch.nn as nn
import torch.nn.functional as F


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), fla's GatedMLP: intermediate size the multiple of 256 nearest
    above 2/3 * hidden_ratio * hidden_size unless given."""

    def __init__(self, hidden_size: int, hidden_ratio: Optional[int] = None,
                 intermediate_size: Optional[int] = None, hidden_act: str = "swish", **kwargs):
        super().__init__()
        if hidden_act != "swish":
            raise NotImplementedError(f"fla_ext.models: GatedMLP hidden_act {hidden_act!r} (only 'swish')")
        if intermediate_size is None:
            intermediate_size = int(hidden_size * (hidden_ratio or 4) * 2 / 3)
            intermediate_size = 256 * ((intermediate_size + 255) // 256)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x, **kwargs):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GatedMLPBlock(nn.Module):
    """h + attn(attn_norm(h)), then + mlp(mlp_norm(.)); ``make_attn(config, layer_idx)``."""

    @staticmethod
    def make_attn(config, layer_idx):
        raise NotImplementedError

    @staticmethod
    def final_norm(config):  # the model's, after the last block
        return nn.RMSNorm(config.hidden_size, eps=config.norm_eps)

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = self.make_attn(config, layer_idx)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.hidden_ratio, config.intermediate_size, config.hidden_act)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False, carry=None,
                **kwargs):
        h, _, past_key_values = self.attn(self.attn_norm(hidden_states), attention_mask=attention_mask,
                                          past_key_values=past_key_values, use_cache=use_cache, **kwargs)
        residual = hidden_states + h
        return residual + self.mlp(self.mlp_norm(residual)), past_key_values, carry


class RWKVBlock(nn.Module):
    """(pre_norm in block 0,) h + attn(attn_norm(h)), then + ffn(ffn_norm(.)), LayerNorms with
    ``norm_bias``; ``make_attn(config, layer_idx)`` and ``make_ffn(config, layer_idx)``.
    ``passes_v_first``: the attention takes and returns RWKV-7's v_first (the carry)."""
    passes_v_first = False

    @staticmethod
    def make_attn(config, layer_idx):
        raise NotImplementedError

    @staticmethod
    def make_ffn(config, layer_idx):
        raise NotImplementedError

    @staticmethod
    def final_norm(config):  # the model's, after the last block; the blocks' norms too
        return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        if config.norm_first and layer_idx == 0:
            self.pre_norm = self.final_norm(config)
        self.attn_norm = self.final_norm(config)
        self.attn = self.make_attn(config, layer_idx)
        self.ffn_norm = self.final_norm(config)
        self.ffn = self.make_ffn(config, layer_idx)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False, carry=None,
                **kwargs):
        residual = self.pre_norm(hidden_states) if hasattr(self, "pre_norm") else hidden_states
        more = dict(v_first=carry) if self.passes_v_first else {}
        out = self.attn(self.attn_norm(residual), attention_mask=attention_mask,
                        past_key_values=past_key_values, use_cache=use_cache, **more, **kwargs)
        h, past_key_values = out[0], out[2]
        if self.passes_v_first:
            carry = out[3]
        residual = residual + h
        h = self.ffn(self.ffn_norm(residual), attention_mask, past_key_values if use_cache else None,
                     kwargs.get("cu_seqlens"), cp_context=kwargs.get("cp_context"))
        return residual + h, past_key_values, carry
