"""RWKV-6 language model in transformers' conventions with fla's RWKV6Config fields and parameter
names: embeddings, RWKV blocks (time mix: fla_ext's RWKV6Attention; channel mix: the token-shifted
squared-ReLU FFN with its receptance gate), the final LayerNorm and the head."""
from typing import Optional

from ..layers import RWKV6Attention
from .blocks import RWKVBlock
from .causal_lm import (CausalLMGenerationMixin, LMBackbone, LMPreTrainedModel, config_base, set_fields,
                        unsupported_attn)
from .channel_mix import RWKV6FeedForward

PreTrainedConfig = config_base()


class RWKV6Config(PreTrainedConfig):
    """fla's RWKV6Config fields and defaults (``attn`` must be None)."""
    model_type = "rwkv6"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, attn_mode: str = "chunk", hidden_size: int = 2048, expand_k: float = 0.5,
                 expand_v: float = 1.0, hidden_ratio: Optional[float] = 3.5, intermediate_size: Optional[int] = None,
                 num_hidden_layers: int = 24, num_heads: int = 4, proj_low_rank_dim: int = 32,
                 gate_low_rank_dim: int = 64, hidden_act: str = "sqrelu", max_position_embeddings: int = 2048,
                 norm_first: bool = True, norm_bias: bool = True, norm_eps: float = 1e-5, attn=None,
                 use_cache: bool = True, pad_token_id: Optional[int] = None, bos_token_id: int = 1,
                 eos_token_id: int = 2, tie_word_embeddings: bool = False, initializer_range: float = 0.02,
                 fuse_norm: bool = True, fuse_cross_entropy: bool = True, fuse_linear_cross_entropy: bool = False,
                 use_l2warp: bool = False, vocab_size: int = 32000, **kwargs):
        unsupported_attn(attn, "RWKV6")
        super().__init__(**set_fields(self, locals()), **kwargs)


class RWKV6Block(RWKVBlock):
    @staticmethod
    def make_attn(config, layer_idx):
        return RWKV6Attention(mode=config.attn_mode, hidden_size=config.hidden_size, expand_k=config.expand_k,
                              expand_v=config.expand_v, num_heads=config.num_heads,
                              proj_low_rank_dim=config.proj_low_rank_dim,
                              gate_low_rank_dim=config.gate_low_rank_dim, norm_eps=config.norm_eps,
                              fuse_norm=config.fuse_norm, layer_idx=layer_idx)

    @staticmethod
    def make_ffn(config, layer_idx):
        return RWKV6FeedForward(config.hidden_size, config.hidden_ratio, config.intermediate_size,
                                config.hidden_act, layer_idx)


class RWKV6PreTrainedModel(LMPreTrainedModel):
    config_class = RWKV6Config
    _no_split_modules = ["RWKV6Block"]
    rescale_output = True


class RWKV6Model(LMBackbone, RWKV6PreTrainedModel):
    block_class = RWKV6Block


class RWKV6ForCausalLM(CausalLMGenerationMixin, RWKV6PreTrainedModel):
    backbone_class = RWKV6Model
