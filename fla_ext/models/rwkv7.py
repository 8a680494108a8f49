"""RWKV-7 language model in transformers' conventions, with fla's config fields and parameter
names, so that a checkpoint saved by fla's ``RWKV7ForCausalLM`` loads here unchanged: embeddings,
RWKV blocks (time mix: fla_ext's RWKV7Attention; channel mix: the token-shifted squared-ReLU FFN),
the final LayerNorm and the head. ``v_first`` (layer 0's values) passes from block to block."""
import math
from typing import Optional

import torch
import torch.nn as nn

from ..layers import RWKV7Attention
from .blocks import RWKVBlock
from .causal_lm import (CausalLMGenerationMixin, LMBackbone, LMPreTrainedModel, config_base, set_fields,
                        unsupported_attn)
from .channel_mix import RWKV7FeedForward

PreTrainedConfig = config_base()


class RWKV7Config(PreTrainedConfig):
    """fla's RWKV7Config fields and defaults (``attn``: fla's hybrid-attention layers, not
    supported here: must be None)."""
    model_type = "rwkv7"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, attn_mode: str = "chunk", hidden_size: int = 2048, hidden_ratio: Optional[int] = 4,
                 intermediate_size: Optional[int] = None, num_hidden_layers: int = 24,
                 head_dim: Optional[int] = 64, num_heads: Optional[int] = None, decay_low_rank_dim: int = 64,
                 gate_low_rank_dim: int = 128, a_low_rank_dim: int = 64, v_low_rank_dim: int = 16,
                 hidden_act: str = "sqrelu", max_position_embeddings: int = 2048, norm_first: bool = True,
                 norm_bias: bool = True, norm_eps: float = 1e-5, attn=None, use_cache: bool = True,
                 pad_token_id: Optional[int] = None, bos_token_id: int = 1, eos_token_id: int = 2,
                 tie_word_embeddings: bool = False, initializer_range: float = 0.02, fuse_norm: bool = True,
                 fuse_cross_entropy: bool = True, fuse_linear_cross_entropy: bool = False,
                 use_l2warp: bool = True, vocab_size: int = 32000, value_dim=None, **kwargs):
        unsupported_attn(attn, "RWKV7")
        if head_dim is None and num_heads is not None:
            head_dim = hidden_size // num_heads
        elif head_dim is not None and num_heads is None:
            num_heads = hidden_size // head_dim
        if value_dim is None:
            value_dim = [hidden_size] * num_hidden_layers
        elif isinstance(value_dim, int):
            value_dim = [value_dim] * num_hidden_layers
        if len(value_dim) != num_hidden_layers or any(v < hidden_size or v % hidden_size for v in value_dim):
            raise ValueError("fla_ext.models: value_dim must be a multiple of hidden_size (per layer)")
        super().__init__(**set_fields(self, locals()), **kwargs)


class RWKV7Block(RWKVBlock):
    passes_v_first = True

    @staticmethod
    def make_attn(config, layer_idx):
        return RWKV7Attention(mode=config.attn_mode, hidden_size=config.hidden_size, head_dim=config.head_dim,
                              num_heads=config.num_heads, decay_low_rank_dim=config.decay_low_rank_dim,
                              gate_low_rank_dim=config.gate_low_rank_dim, a_low_rank_dim=config.a_low_rank_dim,
                              v_low_rank_dim=config.v_low_rank_dim, norm_eps=config.norm_eps,
                              fuse_norm=config.fuse_norm, layer_idx=layer_idx,
                              value_dim=config.value_dim[layer_idx], num_hidden_layers=config.num_hidden_layers)

    @staticmethod
    def make_ffn(config, layer_idx):
        return RWKV7FeedForward(config.hidden_size, config.hidden_ratio, config.intermediate_size,
                                config.hidden_act, layer_idx, config.num_hidden_layers)


class RWKV7PreTrainedModel(LMPreTrainedModel):
    config_class = RWKV7Config
    _no_split_modules = ["RWKV7Block"]

    @torch.no_grad()
    def _init_weights(self, module):
        """What the blocks do not initialise themselves (RWKV7Attention and the channel mix use
        RWKV-7's own init at construction): the embeddings U(-1e-4, 1e-4) and the head,
        orthogonal with gain 0.5 sqrt(vocab / hidden) (RWKV-LM's)."""
        if isinstance(module, nn.Embedding):
            nn.init.uniform_(module.weight, -1e-4, 1e-4)
        elif isinstance(module, nn.Linear) and module is getattr(self, "lm_head", None):
            c = self.config
            gain = 0.5 * math.sqrt(c.vocab_size / c.hidden_size) if c.vocab_size > c.hidden_size else 0.5
            if module.weight.device.type != "meta":
                w = torch.empty(module.weight.shape, dtype=torch.float32, device=module.weight.device)
                module.weight.copy_(nn.init.orthogonal_(w, gain=gain))


class RWKV7Model(LMBackbone, RWKV7PreTrainedModel):
    block_class = RWKV7Block

    def initial_carry(self, h):
        return torch.zeros_like(h)  # v_first, set by block 0


class RWKV7ForCausalLM(CausalLMGenerationMixin, RWKV7PreTrainedModel):
    backbone_class = RWKV7Model
