"""GLA language model in transformers' conventions with fla's GLAConfig fields and parameter
names: embeddings, pre-norm blocks (fla_ext's GatedLinearAttention, a SwiGLU MLP), the final
RMSNorm and the head."""
from typing import Optional

from ..layers import GatedLinearAttention
from .blocks import GatedMLPBlock
from .causal_lm import (CausalLMGenerationMixin, LMBackbone, LMPreTrainedModel, config_base, set_fields,
                        unsupported_attn)

PreTrainedConfig = config_base()


class GLAConfig(PreTrainedConfig):
    """fla's GLAConfig fields and defaults (``use_gk`` / ``use_gv`` are kept and, as in fla's
    model, not passed to the layer; ``attn``, hybrid attention layers, and
    ``attnres_block_size`` are not supported: they must be None)."""
    model_type = "gla"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, hidden_size: int = 2048, expand_k: float = 0.5, expand_v: float = 1.0,
                 hidden_ratio: Optional[int] = 4, intermediate_size: Optional[int] = None,
                 num_hidden_layers: int = 24, num_heads: int = 4, num_kv_heads: Optional[int] = None,
                 feature_map: Optional[str] = None, attn_mode: str = "chunk", use_short_conv: bool = False,
                 conv_size: int = 4, use_output_gate: bool = True, clamp_min: Optional[float] = None,
                 hidden_act: str = "swish", max_position_embeddings: int = 2048,
                 elementwise_affine: Optional[bool] = True, norm_eps: float = 1e-6, use_gk: bool = True,
                 use_gv: bool = False, attn=None, use_cache: bool = True, pad_token_id: Optional[int] = None,
                 bos_token_id: int = 1, eos_token_id: int = 2, tie_word_embeddings: bool = False,
                 initializer_range: float = 0.02, fuse_norm: bool = True, fuse_swiglu: bool = True,
                 fuse_cross_entropy: bool = True, fuse_linear_cross_entropy: bool = False,
                 use_l2warp: bool = False, vocab_size: int = 32000, attnres_block_size: Optional[int] = None,
                 **kwargs):
        unsupported_attn(attn, "GLA", attnres_block_size)
        super().__init__(**set_fields(self, locals()), **kwargs)


class GLABlock(GatedMLPBlock):
    @staticmethod
    def make_attn(config, layer_idx):
        return GatedLinearAttention(mode=config.attn_mode, hidden_size=config.hidden_size,
                                    expand_k=config.expand_k, expand_v=config.expand_v,
                                    num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                                    feature_map=config.feature_map, use_short_conv=config.use_short_conv,
                                    conv_size=config.conv_size, use_output_gate=config.use_output_gate,
                                    gate_fn=config.hidden_act, elementwise_affine=config.elementwise_affine,
                                    norm_eps=config.norm_eps, clamp_min=config.clamp_min,
                                    fuse_norm=config.fuse_norm, layer_idx=layer_idx)


class GLAPreTrainedModel(LMPreTrainedModel):
    config_class = GLAConfig
    _no_split_modules = ["GLABlock"]


class GLAModel(LMBackbone, GLAPreTrainedModel):
    block_class = GLABlock


class GLAForCausalLM(CausalLMGenerationMixin, GLAPreTrainedModel):
    backbone_class = GLAModel
