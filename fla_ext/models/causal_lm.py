"""What the four language models share: the pre-trained base (fla's weight init), the backbone
(embeddings, blocks, final norm, and a value handed from block to block: RWKV-7's v_first) and
the causal-LM head (the loss from labels, the chunked cross-entropy, generation with fla_ext's
recurrent cache). A family defines its config, its block and three one-line classes."""
import math

import torch
import torch.nn as nn
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel

from ..layers import Cache
from .losses import chunked_cross_entropy, cross_entropy


class LMPreTrainedModel(PreTrainedModel):
    """fla's init for GLA, GSA and RWKV6 models: Linear / Conv1d weights and embeddings
    N(0, initializer_range), biases zero, norms reset; the layers' own parameters (decay biases,
    token-shift mixes) keep their construction init. ``rescale_output``: also fla's GPT-2 scheme
    for the blocks' output projections (kaiming uniform over sqrt(2 * layers))."""
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    rescale_output = False

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif hasattr(module, "reset_parameters") and not any(True for _ in module.children()):
            module.reset_parameters()  # norms; a layer with children keeps its own init
        o_proj = getattr(module, "o_proj", None)
        if self.rescale_output and isinstance(o_proj, nn.Linear):
            nn.init.kaiming_uniform_(o_proj.weight, a=math.sqrt(5))
            o_proj.weight /= math.sqrt(2 * self.config.num_hidden_layers)


class LMBackbone:
    """The model body, mixed into a family's ``PreTrainedModel``: ``block_class(config, i)``
    blocks between the embeddings and the block class's ``final_norm(config)``. A block's forward takes
    (h, attention_mask, cache, use_cache, carry, **kwargs) and returns (h, cache, carry);
    ``initial_carry(h)`` is what block 0 receives (None unless a family passes something on)."""
    block_class = None

    def initial_carry(self, h):
        return None

    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([self.block_class(config, i) for i in range(config.num_hidden_layers)])
        self.norm = self.block_class.final_norm(config)
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
        carry = self.initial_carry(h)
        for layer in self.layers:
            if output_hidden_states:
                hidden += (h,)
            args = (h, attention_mask, past_key_values, use_cache, carry)
            if self.gradient_checkpointing and self.training:
                h, past_key_values, carry = self._gradient_checkpointing_func(layer.__call__, *args, **kwargs)
            else:
                h, past_key_values, carry = layer(*args, **kwargs)
        h = self.norm(h)
        if output_hidden_states:
            hidden += (h,)
        if not return_dict:
            return tuple(x for x in (h, past_key_values, hidden) if x is not None)
        return BaseModelOutputWithPast(last_hidden_state=h, past_key_values=past_key_values, hidden_states=hidden)


class CausalLMGenerationMixin(GenerationMixin):
    """The language model, mixed into a family's ``PreTrainedModel`` (transformers recognises a
    generating class by a base whose name ends in GenerationMixin): ``backbone_class`` and a
    head. labels (as input_ids; -100 ignored) give the mean next-token loss (fla's conventions:
    ``shift_labels`` are targets as given, ``num_items_in_batch`` makes it the sum over that); with
    ``config.fuse_linear_cross_entropy`` it is taken in row chunks without the full float32
    logits (logits are then not returned); ``config.use_l2warp`` adds RWKV's L2Wrap."""
    backbone_class = None
    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = self.backbone_class(config)
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
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        for unused in ("output_attentions", "cache_position"):
            kwargs.pop(unused, None)
        num_items_in_batch, shift_labels = kwargs.pop("num_items_in_batch", None), kwargs.pop("shift_labels", None)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                         past_key_values=past_key_values, use_cache=use_cache,
                         output_hidden_states=output_hidden_states, return_dict=True, **kwargs)
        h = out.last_hidden_state
        loss = logits = None
        if labels is not None or shift_labels is not None:
            # fla's conventions: shift_labels are the targets as given; with num_items_in_batch
            # (transformers' Trainer under gradient accumulation) the summed loss is divided by it
            target = (shift_labels if shift_labels is not None
                      else torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)).to(h.device)
            kw = dict(l2wrap=self.config.use_l2warp, reduction="mean" if num_items_in_batch is None else "sum")
            if self.config.fuse_linear_cross_entropy:
                loss = chunked_cross_entropy(h, self.lm_head.weight, target, **kw)
            else:
                logits = self.lm_head(h)
                loss = cross_entropy(logits, target, **kw)
            if num_items_in_batch is not None:
                loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                               else num_items_in_batch)
        else:
            logits = self.lm_head(h if not logits_to_keep else h[:, -logits_to_keep:])
        if not return_dict:
            rest = (logits, out.past_key_values, out.hidden_states)
            rest = tuple(x for x in rest if x is not None)
            return ((loss,) + rest) if loss is not None else rest
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values,
                                      hidden_states=out.hidden_states)


_BASE_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings")


def set_fields(config, fields: dict) -> dict:
    """A config constructor's arguments (its ``locals()``) as attributes under their names, as
    fla's configs keep them; returns those that transformers' base config takes itself."""
    fields = {k: v for k, v in fields.items() if k not in ("self", "kwargs", "__class__")}
    for k, v in fields.items():
        if k not in _BASE_FIELDS:
            setattr(config, k, v)
    return {k: fields[k] for k in _BASE_FIELDS}


def config_base():
    """transformers' config base class (PreTrainedConfig in 5.x, PretrainedConfig in 4.x)."""
    try:
        from transformers import PreTrainedConfig
    except ImportError:  # transformers 4
        from transformers import PretrainedConfig as PreTrainedConfig
    return PreTrainedConfig


def unsupported_attn(attn, family, attnres_block_size=None):
    """fla's config fields for layer kinds fla_ext does not build (hybrid attention layers,
    attention residual blocks) must be None."""
    if attn is not None:
        raise NotImplementedError(f"fla_ext.models: {family}Config(attn=...) (hybrid attention layers) "
                                  "is not supported")
    if attnres_block_size is not None:
        raise NotImplementedError(f"fla_ext.models: {family}Config(attnres_block_size=...) is not supported")
