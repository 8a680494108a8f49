"""Drop-in nn.Module layers with fla's constructor arguments, parameter names and forward."""
from .cache import Cache
from .gsa import GatedSlotAttention
from .rwkv6 import RWKV6Attention
from .rwkv7 import RWKV7Attention

__all__ = ["Cache", "GatedSlotAttention", "RWKV6Attention", "RWKV7Attention"]
