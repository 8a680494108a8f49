"""RWKV-7 language model in transformers' conventions, with fla's config fields and parameter
names, so that a checkpoint saved by fla's ``RWKV7ForCausalLM`` loads here unchanged: embeddings,
blocks of (time mix: fla_ext's RWKV7Attention; channel mix: token-shifted squared-ReLU FFN), each
with its LayerNorms (a pre-norm after the embeddings in block 0), the final norm and the head.
``v_first`` (layer 0's values) passes from block to block."""
import math
from typing import Optional

import torch
import torch.nn as nn
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers 4
    from transformers import PretrainedConfig as PreTrainedConfig

from ..layers import Cache, RWKV7Attention
from ..layers.shift import token_shift
from .losses import L2Wrap, chunked_cross_entropy


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
        if attn is not None:
            raise NotImplementedError("fla_ext.models: RWKV7Config(attn=...) (hybrid attention layers) "
                                      "is not supported")
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
        self.attn_mode, self.hidden_size, self.hidden_ratio = attn_mode, hidden_size, hidden_ratio
        self.intermediate_size, self.num_hidden_layers = intermediate_size, num_hidden_layers
        self.head_dim, self.num_heads, self.value_dim = head_dim, num_heads, value_dim
        self.decay_low_rank_dim, self.gate_low_rank_dim = decay_low_rank_dim, gate_low_rank_dim
        self.a_low_rank_dim, self.v_low_rank_dim = a_low_rank_dim, v_low_rank_dim
        self.hidden_act, self.max_position_embeddings = hidden_act, max_position_embeddings
        self.norm_first, self.norm_bias, self.norm_eps, self.attn = norm_first, norm_bias, norm_eps, attn
        self.use_cache, self.initializer_range, self.fuse_norm = use_cache, initializer_range, fuse_norm
        self.fuse_cross_entropy, self.fuse_linear_cross_entropy = fuse_cross_entropy, fuse_linear_cross_entropy
        self.use_l2warp, self.vocab_size = use_l2warp, vocab_size
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)


def _layer_norm(config):
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class RWKV7FeedForward(nn.Module):
    """RWKV-7's channel mix: relu(key(x + delta * x_k))^2 -> value, delta the token shift."""

    def __init__(self, hidden_size: int, hidden_ratio: Optional[int] = None,
                 intermediate_size: Optional[int] = None, hidden_act: str = "sqrelu",
                 layer_idx: int = 0, num_hidden_layers: int = 1):
        super().__init__()
        if hidden_act != "sqrelu":
            raise NotImplementedError(f"fla_ext.models: RWKV7 hidden_act {hidden_act!r} (only 'sqrelu')")
        if intermediate_size is None:
            intermediate_size = 32 * ((int(hidden_size * (hidden_ratio or 4)) + 31) // 32)
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
        if attention_mask is not None:
            x = x * attention_mask[:, -x.shape[1]:, None].to(x.dtype)
        last = cache[self.layer_idx]["ffn_state"] if cache is not None and len(cache) > self.layer_idx else None
        cp_context = kwargs.get("cp_context")
        if cp_context is not None:  # the row before the slice, from the previous rank
            from .. import cp
            last = cp.halo(cp_context, x, 1)[:, -1]
            cu_seqlens = cp_context.cu_seqlens
        delta, state = token_shift(x, cu_seqlens, last)
        if cache is not None:
            cache.update(self.layer_idx, ffn_state=state, offset=0)
        return self.value(torch.relu(self.key(torch.addcmul(x, delta, self.x_k))).square())


class RWKV7Block(nn.Module):
    def __init__(self, config: RWKV7Config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        if config.norm_first and layer_idx == 0:
            self.pre_norm = _layer_norm(config)
        self.attn_norm = _layer_norm(config)
        self.attn = RWKV7Attention(mode=config.attn_mode, hidden_size=config.hidden_size,
                                   head_dim=config.head_dim, num_heads=config.num_heads,
                                   decay_low_rank_dim=config.decay_low_rank_dim,
                                   gate_low_rank_dim=config.gate_low_rank_dim,
                                   a_low_rank_dim=config.a_low_rank_dim, v_low_rank_dim=config.v_low_rank_dim,
                                   norm_eps=config.norm_eps, fuse_norm=config.fuse_norm, layer_idx=layer_idx,
                                   value_dim=config.value_dim[layer_idx],
                                   num_hidden_layers=config.num_hidden_layers)
        self.ffn_norm = _layer_norm(config)
        self.ffn = RWKV7FeedForward(config.hidden_size, config.hidden_ratio, config.intermediate_size,
                                    config.hidden_act, layer_idx, config.num_hidden_layers)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
                v_first=None, **kwargs):
        residual = self.pre_norm(hidden_states) if hasattr(self, "pre_norm") else hidden_states
        h, _, past_key_values, v_first = self.attn(self.attn_norm(residual), attention_mask=attention_mask,
                                                   past_key_values=past_key_values, use_cache=use_cache,
                                                   v_first=v_first, **kwargs)
        residual = residual + h
        h = self.ffn(self.ffn_norm(residual), attention_mask, past_key_values if use_cache else None,
                     kwargs.get("cu_seqlens"), cp_context=kwargs.get("cp_context"))
        return residual + h, past_key_values, v_first


class RWKV7PreTrainedModel(PreTrainedModel):
    config_class = RWKV7Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
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


class RWKV7Model(RWKV7PreTrainedModel):
    def __init__(self, config: RWKV7Config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([RWKV7Block(config, i) for i in range(config.num_hidden_layers)])
        self.norm = _layer_norm(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, past_key_values=None,
                use_cache=None, output_hidden_states=None, return_dict=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("fla_ext.models: pass exactly one of input_ids and inputs_embeds")
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        h = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if use_cache and past_key_values is None:
            past_key_values = Cache()
        hidden = () if output_hidden_states else None
        v_first = torch.zeros_like(h)
        for layer in self.layers:
            if output_hidden_states:
                hidden += (h,)
            args = (h, attention_mask, past_key_values, use_cache, v_first)
            if self.gradient_checkpointing and self.training:
                h, past_key_values, v_first = self._gradient_checkpointing_func(layer.__call__, *args, **kwargs)
            else:
                h, past_key_values, v_first = layer(*args, **kwargs)
        h = self.norm(h)
        if output_hidden_states:
            hidden += (h,)
        if not return_dict:
            return tuple(x for x in (h, past_key_values, hidden) if x is not None)
        return BaseModelOutputWithPast(last_hidden_state=h, past_key_values=past_key_values, hidden_states=hidden)


class RWKV7ForCausalLM(RWKV7PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: RWKV7Config):
        super().__init__(config)
        self.model = RWKV7Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the layers keep recurrent states in fla_ext.layers.Cache, made by the model

    def get_input_embeddings(self):
        return self.model.embeddings

    def set_input_embeddings(self, value):
        self.model.embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      inputs_embeds=None, use_cache=True, **kwargs):
        """With a cache, only the tokens it has not seen (the last one while decoding)."""
        if past_key_values is not None and len(past_key_values) > 0:
            input_ids = input_ids[:, past_key_values.get_seq_length():]
            inputs_embeds = None
        out = {"past_key_values": past_key_values, "use_cache": use_cache, "attention_mask": attention_mask}
        out["inputs_embeds" if inputs_embeds is not None else "input_ids"] = (
            inputs_embeds if inputs_embeds is not None else input_ids)
        return out

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, past_key_values=None,
                labels=None, use_cache=None, output_hidden_states=None, return_dict=None,
                logits_to_keep: int = 0, **kwargs):
        """labels (as input_ids; -100 ignored) give the mean next-token loss. With
        ``config.fuse_linear_cross_entropy`` the loss is taken in row chunks without the full
        float32 logits (then logits are not returned); ``config.use_l2warp`` adds RWKV's L2Wrap."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        for unused in ("output_attentions", "cache_position", "num_items_in_batch", "shift_labels"):
            kwargs.pop(unused, None)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                         past_key_values=past_key_values, use_cache=use_cache,
                         output_hidden_states=output_hidden_states, return_dict=True, **kwargs)
        h = out.last_hidden_state
        loss = logits = None
        if labels is not None:
            target = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
            if self.config.fuse_linear_cross_entropy:
                loss = chunked_cross_entropy(h, self.lm_head.weight, target, l2wrap=self.config.use_l2warp)
            else:
                logits = self.lm_head(h)
                flat = logits.float().reshape(-1, logits.shape[-1])
                loss = nn.functional.cross_entropy(flat, target.reshape(-1), ignore_index=-100)
                if self.config.use_l2warp:
                    loss = L2Wrap.apply(loss, flat)
        else:
            logits = self.lm_head(h if not logits_to_keep else h[:, -logits_to_keep:])
        if not return_dict:
            rest = (logits, out.past_key_values, out.hidden_states)
            rest = tuple(x for x in rest if x is not None)
            return ((loss,) + rest) if loss is not None else rest
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values,
                                      hidden_states=out.hidden_states)
