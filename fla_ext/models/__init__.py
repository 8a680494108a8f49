"""Language models in transformers' conventions (``pip install fla_ext[models]``), with fla's
config fields and parameter names: ``RWKV7Config``, ``RWKV7Model``, ``RWKV7ForCausalLM``,
registered with transformers' Auto classes under fla's model type (``rwkv7``)."""
from .losses import L2Wrap, chunked_cross_entropy
from .rwkv7 import RWKV7Block, RWKV7Config, RWKV7FeedForward, RWKV7ForCausalLM, RWKV7Model

__all__ = ["L2Wrap", "chunked_cross_entropy", "RWKV7Block", "RWKV7Config", "RWKV7FeedForward",
           "RWKV7ForCausalLM", "RWKV7Model"]


def _register() -> None:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    AutoConfig.register(RWKV7Config.model_type, RWKV7Config, exist_ok=True)
    AutoModel.register(RWKV7Config, RWKV7Model, exist_ok=True)
    AutoModelForCausalLM.register(RWKV7Config, RWKV7ForCausalLM, exist_ok=True)


_register()
