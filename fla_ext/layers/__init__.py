"""Drop-in nn.Module layers with fla's constructor arguments, parameter names and forward."""
from .cache import Cache
from .conv import ShortConvolution
from .gla import GatedLinearAttention
from .gsa import GatedSlotAttention
from .rwkv6 import RWKV6Attention
from .rwkv7 import RWKV7Attention

__all__ = ["Cache", "GatedLinearAttention", "GatedSlotAttention", "RWKV6Attention",
           "RWKV7Attention", "ShortConvolution"]
