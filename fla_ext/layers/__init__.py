"""Drop-in nn.Module layers with fla's constructor arguments, parameter names and forward."""
from .cache import Cache
from .gsa import GatedSlotAttention

__all__ = ["Cache", "GatedSlotAttention"]
