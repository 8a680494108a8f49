"""RWKV6Attention, fla's drop-in (docs/layers.md §1): fla's constructor, parameter names, shapes,
forward and cache; the op is fla_ext's chunk_rwkv6 / fused_recurrent_rwkv6.

Initialisation follows the official RWKV-6 recipe (RWKV-LM, RWKV_Tmix_x060 and
generate_init_weight), not fla's: fla leaves every token-shift mix at 0, the bonus at 0 and the
decay at exp(-1) for every channel and layer (docs/layers.md §1.2). The recipe depends on the layer's
depth, so the constructor takes `num_hidden_layers` (fla's layer does not; its model does).
Everything is computed in float32 and copied into the parameters, so a bfloat16 module gets the
same values rounded once."""
import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import chunk_rwkv6, fused_recurrent_rwkv6
from .cache import Cache
from .checks import begin_forward
from .init import rwkv_orthogonal_
from .lora import LoRA
from .padding import kept_tokens
from .lean_linear import mixed
from .shift import token_shift
from .. import cp as _cp


class LerpLinear(nn.Module):
    """linear(x + delta * mu): a static token-shift mix `mu` [in] (the backward keeps x and delta,
    not the mix: lean_linear.mixed)."""

    def __init__(self, input_dim: int, output_dim: int, low_rank_dim: Optional[int] = None) -> None:
        super().__init__()
        self.linear = (nn.Linear(input_dim, output_dim, bias=False) if low_rank_dim is None
                       else LoRA(input_dim, output_dim, low_rank_dim))
        self.mu = nn.Parameter(torch.zeros(input_dim))

    def forward(self, x, delta):
        return mixed(self.linear, x, delta, self.mu)


class DDLerpLinear(nn.Module):
    """linear(x + delta * mu) with a data-dependent mix `mu` [B, T, in] given by the caller."""

    def __init__(self, input_dim: int, output_dim: int, low_rank_dim: Optional[int] = None) -> None:
        super().__init__()
        self.linear = (nn.Linear(input_dim, output_dim, bias=False) if low_rank_dim is None
                       else LoRA(input_dim, output_dim, low_rank_dim))

    def forward(self, x, mu, delta):
        return mixed(self.linear, x, delta, mu)


class RWKV6Attention(nn.Module):
    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 0.5,
                 expand_v: float = 1.0, num_heads: int = 4, gate_fn: str = "swish",
                 proj_low_rank_dim: int = 32, gate_low_rank_dim: int = 64,
                 fuse_norm: bool = True, elementwise_affine: Optional[bool] = True,
                 norm_eps: float = 1e-5, layer_idx: Optional[int] = None,
                 num_hidden_layers: int = 24, **kwargs) -> None:
        super().__init__()
        if mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"fla_ext: RWKV6Attention `mode` must be 'chunk' or "
                             f"'fused_recurrent', got {mode!r}")
        if gate_fn not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"fla_ext: RWKV6Attention `gate_fn` must be 'swish' or 'sigmoid', "
                             f"got {gate_fn!r}")
        self.mode, self.hidden_size, self.num_heads = mode, hidden_size, num_heads
        self.key_dim, self.value_dim = int(hidden_size * expand_k), int(hidden_size * expand_v)
        if self.key_dim % num_heads or self.value_dim % num_heads:
            raise ValueError(f"fla_ext: key_dim {self.key_dim} and value_dim {self.value_dim} "
                             f"must be divisible by num_heads {num_heads}")
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads
        self.proj_low_rank_dim, self.gate_low_rank_dim = proj_low_rank_dim, gate_low_rank_dim
        self.gate_fn = gate_fn
        self.layer_idx, self.num_hidden_layers = layer_idx, num_hidden_layers
        if layer_idx is None:
            warnings.warn("fla_ext: RWKV6Attention without `layer_idx`: initialised as layer 0, "
                          "and it cannot use a cache")

        C, R = hidden_size, proj_low_rank_dim
        self.x_proj = nn.Sequential(LerpLinear(C, 5 * R), nn.Tanh(), nn.Linear(5 * R, C, bias=False))
        self.x_bias = nn.Parameter(torch.zeros(5, C))
        self.r_proj = DDLerpLinear(C, self.key_dim)
        self.w_proj = DDLerpLinear(C, self.key_dim, low_rank_dim=gate_low_rank_dim)
        self.k_proj = DDLerpLinear(C, self.key_dim)
        self.v_proj = DDLerpLinear(C, self.value_dim)
        self.g_proj = DDLerpLinear(C, self.value_dim)
        self.bonus = nn.Parameter(torch.zeros(num_heads, self.head_k_dim))
        self.g_norm = nn.GroupNorm(num_heads, self.value_dim, eps=norm_eps,
                                   affine=bool(elementwise_affine))
        self.o_proj = nn.Linear(self.value_dim, C, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The official RWKV-6 init (module docstring), for layer `layer_idx` of
        `num_hidden_layers`; a single-layer model gets the first layer's ratios."""
        C, L = self.hidden_size, max(self.num_hidden_layers, 1)
        layer = self.layer_idx or 0
        r01 = layer / (L - 1) if L > 1 else 0.0  # 0 at the first layer, 1 at the last
        r10 = 1.0 - layer / L                     # 1 at the first layer
        ddd = torch.arange(C, dtype=torch.float32) / C
        copy = lambda p, v: p.data.copy_(v)  # noqa: E731  (fp32 values into any dtype)
        copy(self.x_proj[0].mu, 1 - ddd.pow(r10))
        mix_fast, mix_slow = 1 - ddd.pow(r10), 1 - ddd.pow(0.5 * r10)
        mix_v = 1 - (ddd.pow(r10) + 0.3 * r01)
        copy(self.x_bias, torch.stack([mix_slow, mix_fast, mix_fast, mix_v, mix_slow]))  # r w k v g
        self.x_proj[0].linear.weight.zero_()
        copy(self.x_proj[2].weight, torch.empty(self.x_proj[2].weight.shape).uniform_(-0.01, 0.01))
        lora = self.w_proj.linear.lora
        lora[0].weight.zero_()
        copy(lora[2].weight, torch.empty(lora[2].weight.shape).uniform_(-0.01, 0.01))
        D = self.key_dim
        n = torch.arange(D, dtype=torch.float32)
        copy(lora[2].bias, -6 + 5 * (n / max(D - 1, 1)).pow(0.7 + 1.3 * r01))
        bonus = r01 * (1 - n / max(D - 1, 1)) + ((n + 1) % 3 - 1) * 0.1
        copy(self.bonus, bonus.view(self.num_heads, self.head_k_dim))
        rwkv_orthogonal_(self.r_proj.linear.weight, 1.0)
        rwkv_orthogonal_(self.k_proj.linear.weight, 0.1)
        rwkv_orthogonal_(self.v_proj.linear.weight, 1.0)
        rwkv_orthogonal_(self.g_proj.linear.weight, 0.1)
        self.o_proj.weight.zero_()
        if self.g_norm.affine:
            self.g_norm.weight.fill_(((layer + 1) / L) ** 0.7)
            self.g_norm.bias.zero_()

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[Cache] = None, use_cache: Optional[bool] = False,
                output_attentions: Optional[bool] = False, cu_seqlens=None, **kwargs):
        """hidden_states [B, T, hidden_size] -> (o like it, None, past_key_values).

        attention_mask: bool or integer [B, T'] (T' >= T; its last T columns are used), nonzero
        = a kept token, and left padding only (each row 0...0 1...1, checked on a CPU mask or
        with the value checks on): padded tokens are zeroed, not removed, so they must come
        before a sequence's first token. cu_seqlens [N + 1] packs N sequences along T (B = 1);
        kwargs ``cu_seqlens_cpu`` is its host copy (values checked without a device sync).
        A cache (past_key_values) needs layer_idx and belongs to one batch of N sequences.
        Every input is checked first (layers/checks.py)."""
        cu_seqlens, cu_seqlens_cpu, cp_context, last = begin_forward(
            self, hidden_states, attention_mask, past_key_values, use_cache, cu_seqlens, kwargs,
            left_padded=True)
        B, T, C = hidden_states.shape
        mode = "fused_recurrent" if T <= 64 else self.mode
        x = hidden_states
        if attention_mask is not None:
            keep = kept_tokens(attention_mask, T).unsqueeze(-1)
            x = x * keep.to(x.dtype)
        shift_cache = last["conv_state"] if last else None
        if cp_context is not None:  # the row before the slice, from the previous rank
            shift_cache = _cp.halo(cp_context, x, 1)[:, -1]
        delta, conv_state = token_shift(x, cu_seqlens, shift_cache)

        R = self.proj_low_rank_dim
        z = self.x_proj[1](self.x_proj[0](x, delta)).view(B, T, 5, R)
        w2 = self.x_proj[2].weight.view(C, 5, R)
        mix = torch.einsum("btnr,cnr->btnc", z, w2) + self.x_bias
        mr, mw, mk, mv, mg = mix.unbind(2)
        r = self.r_proj(x, mr, delta)
        w = self.w_proj(x, mw, delta)
        k = self.k_proj(x, mk, delta)
        v = self.v_proj(x, mv, delta)
        g = self.g_proj(x, mg, delta)
        if attention_mask is not None:
            v = v * keep.to(v.dtype)
        r, w, k = (t.unflatten(-1, (self.num_heads, self.head_k_dim)) for t in (r, w, k))
        v = v.unflatten(-1, (self.num_heads, self.head_v_dim))
        w = -torch.exp(w)
        state = last["recurrent_state"] if last is not None else None
        op = chunk_rwkv6 if mode == "chunk" else fused_recurrent_rwkv6
        if cp_context is not None:
            o, ht = op(r, k, v, w, self.bonus, scale=1.0, cp_context=cp_context)
        else:
            o, ht = op(r, k, v, w, self.bonus, scale=1.0, initial_state=state,
                       output_final_state=bool(use_cache), cu_seqlens=cu_seqlens,
                       cu_seqlens_cpu=cu_seqlens_cpu)
        if past_key_values is not None:
            past_key_values.update(self.layer_idx, recurrent_state=ht if use_cache else None,
                                   conv_state=conv_state if use_cache else None, offset=T)
        o = self.g_norm(o.reshape(B * T, self.value_dim)).view(B, T, self.value_dim)
        o = o * (F.silu(g) if self.gate_fn in ("swish", "silu") else torch.sigmoid(g))
        return self.o_proj(o), None, past_key_values
