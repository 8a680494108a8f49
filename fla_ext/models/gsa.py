"""Gated Slot Attention language model in transformers' conventions with fla's GSAConfig fields
and parameter names: embeddings, pre-norm blocks (fla_ext's GatedSlotAttention, a SwiGLU MLP),
the final RMSNorm and the head."""
from typing import Optional

from ..layers import GatedSlotAttention
from .blocks import GatedMLPBlock
from .causal_lm import (CausalLMGenerationMixin, LMBackbone, LMPreTrainedModel, config_base, set_fields,
                        unsupported_attn)

PreTrainedConfig = config_base()


class GSAConfig(PreTrainedConfig):
    """fla's GSAConfig fields and defaults, its spelling of ``exapnd_k`` / ``exapnd_v`` included
    (stored as expand_k / expand_v); ``clamp_min`` / ``clamp_max`` are kept but, as in fla's
    model, not passed to the layer. ``attn`` and ``attnres_block_size`` must be None."""
    model_type = "gsa"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, hidden_size: int = 2048, gate_logit_normalizer: Optional[int] = 8,
                 clamp_min: Optional[float] = None, clamp_max: Optional[float] = None,
                 hidden_ratio: Optional[int] = 4, intermediate_size: Optional[int] = None,
                 num_hidden_layers: int = 24, num_heads: int = 4, num_kv_heads: Optional[int] = None,
                 num_slots: Optional[int] = 64, use_short_conv: bool = False, conv_size: int = 4,
                 exapnd_k: float = 1, exapnd_v: float = 1, feature_map: str = "swish",
                 use_output_gate: bool = False, use_norm: bool = True, max_position_embeddings: int = 2048,
                 hidden_act: str = "swish", elementwise_affine: Optional[bool] = True, norm_eps: float = 1e-6,
                 attn=None, use_cache: bool = True, pad_token_id: Optional[int] = None, bos_token_id: int = 1,
                 eos_token_id: int = 2, initializer_range: float = 0.02, tie_word_embeddings: bool = False,
                 fuse_norm: bool = True, fuse_swiglu: bool = True, fuse_cross_entropy: bool = True,
                 fuse_linear_cross_entropy: bool = False, use_l2warp: bool = False, vocab_size: int = 32000,
                 attnres_block_size: Optional[int] = None, **kwargs):
        unsupported_attn(attn, "GSA", attnres_block_size)
        # a saved config carries expand_k / expand_v (the attributes), a new one fla's spelling
        expand_k, expand_v = kwargs.pop("expand_k", exapnd_k), kwargs.pop("expand_v", exapnd_v)
        del exapnd_k, exapnd_v
        super().__init__(**set_fields(self, locals()), **kwargs)


class GSABlock(GatedMLPBlock):
    @staticmethod
    def make_attn(config, layer_idx):
        return GatedSlotAttention(hidden_size=config.hidden_size, expand_k=config.expand_k,
                                  expand_v=config.expand_v, num_heads=config.num_heads,
                                  num_kv_heads=config.num_kv_heads, num_slots=config.num_slots,
                                  use_short_conv=config.use_short_conv, conv_size=config.conv_size,
                                  feature_map=config.feature_map, use_output_gate=config.use_output_gate,
                                  use_norm=config.use_norm, gate_logit_normalizer=config.gate_logit_normalizer,
                                  elementwise_affine=config.elementwise_affine, norm_eps=config.norm_eps,
                                  layer_idx=layer_idx)


class GSAPreTrainedModel(LMPreTrainedModel):
    config_class = GSAConfig
    _no_split_modules = ["GSABlock"]


class GSAModel(LMBackbone, GSAPreTrainedModel):
    block_class = GSABlock


class GSAForCausalLM(CausalLMGenerationMixin, GSAPreTrainedModel):
    backbone_class = GSAModel
