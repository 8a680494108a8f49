"""A small language model built from fla_ext's layers: embedding, pre-norm blocks (token mixer +
SwiGLU MLP), norm, tied head. Used by demo.py (MQAR training) and generate.py (decoding)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from fla_ext.layers import (Cache, GatedLinearAttention, GatedSlotAttention, RWKV6Attention,
                            RWKV7Attention)

LAYER_TYPES = ("rwkv7", "rwkv6", "gsa", "gla")


def make_mixer(kind: str, d: int, heads: int, idx: int, n_layers: int) -> nn.Module:
    if kind == "rwkv7":
        return RWKV7Attention(hidden_size=d, head_dim=d // heads, layer_idx=idx,
                              num_hidden_layers=n_layers)
    if kind == "rwkv6":
        return RWKV6Attention(hidden_size=d, num_heads=heads, proj_low_rank_dim=16,
                              gate_low_rank_dim=32, layer_idx=idx, num_hidden_layers=n_layers)
    if kind == "gsa":
        return GatedSlotAttention(hidden_size=d, num_heads=heads, num_slots=32, layer_idx=idx)
    if kind == "gla":
        return GatedLinearAttention(hidden_size=d, num_heads=heads, layer_idx=idx)
    raise ValueError(f"unknown layer type {kind!r} (one of {LAYER_TYPES})")


class Block(nn.Module):
    def __init__(self, kind: str, d: int, heads: int, idx: int, n_layers: int) -> None:
        super().__init__()
        self.kind = kind
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.mixer = make_mixer(kind, d, heads, idx, n_layers)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x, cache=None, v_first=None):
        kw = dict(past_key_values=cache, use_cache=cache is not None)
        if self.kind == "rwkv7":
            o, _, _, v_first = self.mixer(self.norm1(x), v_first=v_first, **kw)
        else:
            o, _, _ = self.mixer(self.norm1(x), **kw)
        x = x + o
        a, b = self.up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(a) * b), v_first


class TinyLM(nn.Module):
    def __init__(self, kind: str, vocab: int, d: int = 64, n_layers: int = 2, heads: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(kind, d, heads, i, n_layers) for i in range(n_layers))
        self.norm = nn.RMSNorm(d)

    def forward(self, tokens: torch.Tensor, cache: Cache = None) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab]; with a cache, continues from its states."""
        x, v_first = self.embed(tokens), None
        for block in self.blocks:
            x, v_first = block(x, cache, v_first)
        return self.norm(x) @ self.embed.weight.T
