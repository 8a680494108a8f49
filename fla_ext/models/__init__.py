"""Language models in transformers' conventions (``pip install fla_ext[models]``), with fla's
config fields and parameter names, for RWKV-7, RWKV-6, GSA and GLA: ``<Family>Config``,
``<Family>Model``, ``<Family>ForCausalLM``, registered with transformers' Auto classes under fla's
model types (``rwkv7``, ``rwkv6``, ``gsa``, ``gla``). fla registers its own classes under the same
names when ``fla.models`` is imported, and the Auto classes then build fla's models; call
``register_auto()`` to make them build fla_ext's again. Shared pieces: causal_lm.py (backbone,
head, init), blocks.py (RWKV and gated-MLP blocks), channel_mix.py (RWKV's FFNs), losses.py."""
from .blocks import GatedMLP
from .channel_mix import RWKV6FeedForward, RWKV7FeedForward
from .gla import GLABlock, GLAConfig, GLAForCausalLM, GLAModel
from .gsa import GSABlock, GSAConfig, GSAForCausalLM, GSAModel
from .losses import L2Wrap, chunked_cross_entropy, cross_entropy, l2_warp
from .rwkv6 import RWKV6Block, RWKV6Config, RWKV6ForCausalLM, RWKV6Model
from .rwkv7 import RWKV7Block, RWKV7Config, RWKV7ForCausalLM, RWKV7Model

FAMILIES = {  # model type -> (config, model, causal LM)
    "rwkv7": (RWKV7Config, RWKV7Model, RWKV7ForCausalLM),
    "rwkv6": (RWKV6Config, RWKV6Model, RWKV6ForCausalLM),
    "gsa": (GSAConfig, GSAModel, GSAForCausalLM),
    "gla": (GLAConfig, GLAModel, GLAForCausalLM),
}

__all__ = ["FAMILIES", "register_auto", "GatedMLP", "L2Wrap", "chunked_cross_entropy", "cross_entropy", "l2_warp", "RWKV6FeedForward",
           "RWKV7FeedForward", "GLABlock", "GLAConfig", "GLAForCausalLM", "GLAModel", "GSABlock",
           "GSAConfig", "GSAForCausalLM", "GSAModel", "RWKV6Block", "RWKV6Config", "RWKV6ForCausalLM",
           "RWKV6Model", "RWKV7Block", "RWKV7Config", "RWKV7ForCausalLM", "RWKV7Model"]


def register_auto() -> None:
    """Registers (again) fla_ext's classes with transformers' AutoConfig, AutoModel and
    AutoModelForCausalLM under fla's model types: done at import; call it after importing
    ``fla.models``, whose import takes those names for fla's classes."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    for config, model, lm in FAMILIES.values():
        AutoConfig.register(config.model_type, config, exist_ok=True)
        AutoModel.register(config, model, exist_ok=True)
        AutoModelForCausalLM.register(config, lm, exist_ok=True)


register_auto()
