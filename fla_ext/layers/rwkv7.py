"""RWKV7Attention, fla's drop-in (docs/layers.md §2): fla's constructor, parameter names, shapes,
forward (value residual `v_first`, 4-tuple return) and cache; the ops are fla_ext's chunk_rwkv7
(training, or T >= 64) and fused_recurrent_rwkv7 (decoding; unlike fla's, it has a backward).

Initialisation: the official RWKV-7 recipe, which fla's matches (docs/layers.md §2.2), without fla's
failure modes: it always runs (no `layer_idx` -> layer 0 with a warning), a single-layer model
(L = 1) gets the first layer's ratios instead of a division by zero, and every value is computed in
float32 and copied into the parameter, so a bfloat16 module gets the orthogonal projections too
(fla's init of r/k/v_proj is lost in bf16). Every parameter has an explicit initialiser."""
import math
import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import chunk_rwkv7, fused_recurrent_rwkv7
from .cache import Cache
from .checks import begin_forward, check_v_first
from .init import rwkv_orthogonal_
from .lean_linear import mixed
from .lora import LoRA
from .padding import kept_tokens
from .shift import token_shift
from .. import cp as _cp

_EXP_MINUS_HALF = math.exp(-0.5)  # the log decay is -e^-0.5 * sigmoid(.) in (-0.6065, 0)


def _rank(C: int, mult: float, factor: float) -> int:
    # Python's round (half to even), as fla and the official code compute it
    return max(32, int(round(mult * math.sqrt(C) * factor / 32) * 32))


class RWKV7Attention(nn.Module):
    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, head_dim: Optional[int] = 64,
                 num_heads: Optional[int] = None, decay_low_rank_dim: Optional[int] = None,
                 gate_low_rank_dim: Optional[int] = None, a_low_rank_dim: Optional[int] = None,
                 v_low_rank_dim: Optional[int] = None, elementwise_affine: Optional[bool] = True,
                 norm_eps: float = 1e-5, layer_idx: Optional[int] = None, fuse_norm: bool = False,
                 value_dim: Optional[int] = None, num_hidden_layers: Optional[int] = None,
                 **kwargs) -> None:
        super().__init__()
        if mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"fla_ext: RWKV7Attention `mode` must be 'chunk' or "
                             f"'fused_recurrent', got {mode!r}")
        self.mode, self.hidden_size, self.key_dim = mode, hidden_size, hidden_size
        if head_dim is None and num_heads is None:
            raise ValueError("fla_ext: RWKV7Attention needs `head_dim` or `num_heads`")
        if head_dim is not None:
            num_heads = hidden_size // head_dim
        else:
            head_dim = hidden_size // num_heads
        if head_dim * num_heads != hidden_size:
            raise ValueError(f"fla_ext: hidden_size {hidden_size} is not num_heads {num_heads} "
                             f"x head_dim {head_dim}")
        self.head_dim, self.num_heads = head_dim, num_heads
        self.value_dim = value_dim if value_dim is not None else hidden_size
        if self.value_dim != hidden_size:
            raise ValueError("fla_ext: RWKV7Attention supports value_dim == hidden_size only "
                             "(fla's init and output correction assume it)")
        self.head_v_dim = self.value_dim // num_heads
        factor = head_dim / 64
        C = hidden_size
        self.decay_low_rank_dim = decay_low_rank_dim or _rank(C, 2.5, factor)
        self.gate_low_rank_dim = gate_low_rank_dim or _rank(C, 5.0, 1.0)
        self.a_low_rank_dim = a_low_rank_dim or _rank(C, 2.5, factor)
        self.v_low_rank_dim = v_low_rank_dim or _rank(C, 1.7, factor)
        self.layer_idx, self.num_hidden_layers = layer_idx, num_hidden_layers
        self.fuse_norm = fuse_norm
        if layer_idx is None:
            warnings.warn("fla_ext: RWKV7Attention without `layer_idx`: initialised and run as "
                          "layer 0 (it makes v_first), and it cannot use a cache")
        if num_hidden_layers is None:
            warnings.warn("fla_ext: RWKV7Attention without `num_hidden_layers`: initialised as "
                          "a one-layer model")

        def vec(*shape):
            return nn.Parameter(torch.zeros(*shape))
        self.x_r, self.x_w, self.x_k = vec(1, 1, C), vec(1, 1, C), vec(1, 1, C)
        self.x_v, self.x_a, self.x_g = vec(1, 1, C), vec(1, 1, C), vec(1, 1, C)
        self.k_k, self.k_a, self.r_k = vec(C), vec(C), vec(num_heads, head_dim)
        self.r_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, C, bias=False)
        self.v_proj = nn.Linear(C, self.value_dim, bias=False)
        self.o_proj = nn.Linear(self.value_dim, C, bias=False)
        self.w_lora = LoRA(C, C, self.decay_low_rank_dim, activation="tanh")
        if (layer_idx or 0) != 0:
            self.v_lora = LoRA(C, self.value_dim, self.v_low_rank_dim, activation=None)
        self.a_lora = LoRA(C, C, self.a_low_rank_dim, activation=None)
        self.g_lora = LoRA(C, self.value_dim, self.gate_low_rank_dim, activation="sigmoid",
                           bias=False)
        self.g_norm = nn.GroupNorm(num_heads, self.value_dim, eps=head_dim * norm_eps,
                                   affine=bool(elementwise_affine))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        C, N = self.hidden_size, self.head_dim
        L, layer = max(self.num_hidden_layers or 1, 1), self.layer_idx or 0
        r01 = layer / (L - 1) if L > 1 else 0.0
        r10 = 1.0 - layer / L
        n = torch.arange(C, dtype=torch.float32)
        ddd = n / C
        linear = n / max(C - 1, 1) - 0.5
        half = max((N - 1) / 2, 0.5)
        z = ((n % N) - (N - 1) / 2) / half
        zigzag = z * z.abs()
        www = -6 + 6 * (n / max(C - 1, 1)).pow(1 + r01 ** 0.3)
        copy = lambda p, v: p.copy_(v.view(p.shape))  # noqa: E731  (fp32 values, any dtype)
        for p, e in [(self.x_r, 0.2), (self.x_w, 0.9), (self.x_k, 0.7), (self.x_v, 0.7),
                     (self.x_a, 0.9), (self.x_g, 0.2)]:
            copy(p, 1 - ddd.pow(e * r10))
        copy(self.k_k, 0.71 - 0.1 * linear)
        self.k_a.fill_(1.02)
        self.r_k.fill_(-0.04)
        rwkv_orthogonal_(self.r_proj.weight, 1.0)
        rwkv_orthogonal_(self.k_proj.weight, 0.1)
        rwkv_orthogonal_(self.v_proj.weight, 1.0)
        self.o_proj.weight.zero_()
        for lora in [self.w_lora, self.a_lora, self.g_lora] + ([self.v_lora] if self.has_v_lora else []):
            lora.reset_parameters()
        copy(self.w_lora.lora[2].bias, www + 0.5 + 2.5 * zigzag)
        copy(self.a_lora.lora[2].bias, -0.19 + 0.3 * zigzag + 0.4 * linear)
        if self.has_v_lora:
            copy(self.v_lora.lora[2].bias, 0.73 - 0.4 * linear)
        if self.g_norm.affine:
            self.g_norm.weight.fill_(((layer + 1) / L) ** 0.7)
            self.g_norm.bias.zero_()

    @property
    def has_v_lora(self) -> bool:
        return hasattr(self, "v_lora")

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[Cache] = None, use_cache: Optional[bool] = False,
                output_attentions: Optional[bool] = False, v_first: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, **kwargs):
        """hidden_states [B, T, hidden_size] -> (o like it, None, past_key_values, v_first).

        The mask, cu_seqlens (kwargs ``cu_seqlens_cpu``) and cache rules of
        :meth:`RWKV6Attention.forward`: left padding only, since padded tokens are zeroed, not
        removed. v_first: layer 0's values, [B, T, value_dim] like this layer's v (needed from
        layer 1 on; layer 0 makes it and ignores one given)."""
        cu_seqlens, cu_seqlens_cpu, cp_context, last = begin_forward(
            self, hidden_states, attention_mask, past_key_values, use_cache, cu_seqlens, kwargs,
            left_padded=True)
        B, T, C = hidden_states.shape
        if self.has_v_lora:
            check_v_first(self, v_first, (B, T, self.value_dim))
        H, N = self.num_heads, self.head_dim
        am = (kept_tokens(attention_mask, T).unsqueeze(-1).to(hidden_states.dtype)
              if attention_mask is not None else None)
        x = hidden_states * am if am is not None else hidden_states
        shift_cache = last["conv_state"] if last else None
        if cp_context is not None:  # the row before the slice, from the previous rank
            shift_cache = _cp.halo(cp_context, x, 1)[:, -1]
        delta, conv_state = token_shift(x, cu_seqlens, shift_cache)
        # Each projection of a token-shift mix x + delta * x_*: the backward keeps x and delta
        # for all six instead of each mix (lean_linear.mixed).
        r = mixed(self.r_proj, x, delta, self.x_r)
        w = -_EXP_MINUS_HALF * torch.sigmoid(mixed(self.w_lora, x, delta, self.x_w).float())
        k = mixed(self.k_proj, x, delta, self.x_k)
        v = mixed(self.v_proj, x, delta, self.x_v)
        if not self.has_v_lora:
            v_first = v
        else:
            v = torch.lerp(v, v_first, torch.sigmoid(mixed(self.v_lora, x, delta, self.x_v)))
        a = torch.sigmoid(mixed(self.a_lora, x, delta, self.x_a))
        g = mixed(self.g_lora, x, delta, self.x_g)
        kk = (k * self.k_k).view(B, T, H, N)
        if self.fuse_norm:
            kk = kk * torch.rsqrt(kk.float().square().sum(-1, keepdim=True) + 1e-6).to(kk.dtype)
        else:
            kk = F.normalize(kk, dim=-1, p=2.0)
        k = k.addcmul(k * (a - 1), self.k_a)
        if am is not None:
            v = v * am
        r, w, k, a = (t.view(B, T, H, N) for t in (r, w.to(r.dtype), k, a))
        v = v.view(B, T, H, self.head_v_dim)
        state = last["recurrent_state"] if last else None
        kw = dict(scale=1.0, initial_state=state, output_final_state=bool(use_cache),
                  cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        if cp_context is not None:
            kw = dict(scale=1.0, cp_context=cp_context)
        if self.training or T >= 64:
            o, ht = chunk_rwkv7(r, w, k, v, -kk, kk * a, **kw)
        else:
            o, ht = fused_recurrent_rwkv7(r, w, k, v, -kk, kk * a, **kw)
        if past_key_values is not None:
            past_key_values.update(self.layer_idx, recurrent_state=ht if use_cache else None,
                                   conv_state=conv_state if use_cache else None, offset=T)
        o = self.g_norm(o.reshape(B * T, self.value_dim)).view(B, T, self.value_dim)
        bonus = ((r * k * self.r_k).sum(-1, keepdim=True) * v).view(B, T, self.value_dim)
        o = self.o_proj((o + bonus) * g)
        return o, None, past_key_values, v_first
