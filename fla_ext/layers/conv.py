"""fla's ShortConvolution (fla.modules.ShortConvolution): a causal depthwise Conv1d on [B, T, D]
with optional SiLU, a residual, varlen and a decode cache, in plain torch ops (CPU and CUDA).

The cache is fla's: [N, D, W], the last W inputs of each sequence, oldest first (slot W-1 is the
latest token). Only slots 1..W-1 enter the next output; slot 0 is kept so that fla's and our
caches are interchangeable."""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .checks import check_cu_seqlens, check_mask_dtype, require_floating, require_tensor
from .padding import kept_tokens


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 inputs are summed in fp32 and rounded once, as fla's kernel does
    return torch.promote_types(dtype, torch.float32)


def _stream_index(n, p, starts, N: int, W: int):
    """Index into the stream [cache rows (N*W) ; tokens (T)] of position `p` (relative to its
    sequence start, may be negative down to -W) in sequence `n`."""
    return torch.where(p >= 0, N * W + starts[n] + p, n * W + W + p)


class ShortConvolution(nn.Conv1d):
    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False,
                 activation: Optional[str] = "silu", backend: Optional[str] = "triton",
                 device=None, dtype=None, **kwargs) -> None:
        if kernel_size < 1:
            raise ValueError(f"fla_ext: ShortConvolution kernel_size must be >= 1, "
                             f"got {kernel_size}")
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"fla_ext: ShortConvolution activation must be 'silu', 'swish' or "
                             f"None, got {activation!r}")
        super().__init__(hidden_size, hidden_size, kernel_size, padding=kernel_size - 1,
                         groups=hidden_size, bias=bias, device=device, dtype=dtype)
        self.hidden_size, self.activation = hidden_size, activation
        self.backend = backend  # accepted for fla's signature; there is one torch implementation

    @property
    def state_size(self) -> int:
        return self.hidden_size * self.kernel_size[0]

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                mask: Optional[torch.Tensor] = None, cache: Optional[torch.Tensor] = None,
                output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                *, cu_seqlens_cpu: Optional[torch.Tensor] = None,
                **kwargs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x [B, T, D] (or [B, T, ...] flattening to D; B = 1 with cu_seqlens), mask [B, T] bool or
        integer (nonzero = a kept token; a padded token enters the conv as 0), cache [N, D, W]
        -> (y like x, final cache [N, D, W] or None). cu_seqlens [N + 1] is checked before it
        indexes anything (as in the layers: always on the CPU, through ``cu_seqlens_cpu``, its
        host copy, or with the value checks on). Unlike fla, neither x nor the cache is
        modified in place."""
        require_floating(self, "x", x)
        shape, D, W = x.shape, self.hidden_size, self.kernel_size[0]
        if x.dim() < 3:
            raise ValueError(f"fla_ext: ShortConvolution x must be [B, T, D], got {tuple(shape)}")
        x = x.flatten(2)
        if x.shape[-1] != D:
            raise ValueError(f"fla_ext: ShortConvolution x has {x.shape[-1]} features, "
                             f"expected hidden_size {D}")
        B, T = x.shape[:2]
        check_cu_seqlens(self, cu_seqlens, cu_seqlens_cpu, x)
        if cu_seqlens is not None and mask is not None:
            raise ValueError("fla_ext: ShortConvolution takes `mask` or `cu_seqlens`, not both")
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        if cache is not None and tuple(cache.shape) != (N, D, W):
            raise ValueError(f"fla_ext: ShortConvolution cache must be [N, D, W] = {(N, D, W)}, "
                             f"got {tuple(cache.shape)}")
        if mask is not None:
            require_tensor(self, "mask", mask)
            if tuple(mask.shape) != (B, T):
                raise ValueError(f"fla_ext: ShortConvolution mask must be [B, T] = {(B, T)}, "
                                 f"got {tuple(mask.shape)}")
            check_mask_dtype(self, "mask", mask)
            x = x * kept_tokens(mask, T).unsqueeze(-1).to(x.dtype)
        if cu_seqlens is None and T == 1 and cache is not None:
            y, state = self.step(x, cache)
        else:
            y, state = self._full(x, cache, cu_seqlens, N)
        if residual is not None:
            y = y + residual.reshape(y.shape)
        return y.reshape(shape), (state if output_final_state else None)

    def _finish(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        if self.activation is not None:
            y = F.silu(y)
        return y.to(dtype)

    def step(self, x: torch.Tensor, cache: torch.Tensor):
        """One token per sequence: x [N, 1, D], cache [N, D, W] -> (y [N, 1, D], new cache)."""
        state = torch.cat([cache[..., 1:].to(x.dtype), x.transpose(1, 2)], -1)
        acc = _acc_dtype(x.dtype)
        y = (state.to(acc) * self.weight[:, 0].to(acc)).sum(-1)
        return self._finish(y, x.dtype).unsqueeze(1), state

    def _full(self, x: torch.Tensor, cache: Optional[torch.Tensor], cu_seqlens, N: int):
        """Every sequence is laid out as [its last W-1 cached inputs (or zeros) ; its tokens] in
        one stream, and a valid (unpadded) conv runs over it: windows then never cross from one
        sequence into another, and the cache enters exactly where fla's kernel puts it."""
        B, T, D = x.shape
        W, dev = self.kernel_size[0], x.device
        if cu_seqlens is None:
            cu = torch.arange(B + 1, device=dev) * T
        else:
            cu = cu_seqlens.to(device=dev, dtype=torch.int64)
        starts, lens = cu[:-1], cu.diff()
        if cache is None:
            cache = x.new_zeros(N, D, W)
        stream = torch.cat([cache.transpose(1, 2).reshape(N * W, D).to(x.dtype), x.reshape(-1, D)])

        # Row r of the laid-out input: sequence n owns rows cu[n] + n*(W-1) .. cu[n+1] + (n+1)*(W-1)
        seg = cu + torch.arange(N + 1, device=dev) * (W - 1)
        rows = torch.arange(N * (W - 1) + B * T, device=dev)
        n = torch.searchsorted(seg[1:], rows, right=True)
        laid = stream.index_select(0, _stream_index(n, rows - seg[n] - (W - 1), starts, N, W))
        acc = _acc_dtype(x.dtype)
        if B * T:  # (with no token the laid-out rows can be fewer than W)
            y = F.conv1d(laid.t().unsqueeze(0).to(acc), self.weight.to(acc), groups=D)[0].t()
            # the output of token t (sequence n) is the window ending at its row t + (n+1)(W-1)
            tok = torch.arange(B * T, device=dev)
            y = y.index_select(0, tok + torch.searchsorted(cu[1:], tok, right=True) * (W - 1))
        else:
            y = laid.new_zeros(0, D, dtype=acc)
        y = self._finish(y, x.dtype).reshape(B, T, D)

        # the last W inputs of each sequence, reaching into its cache when it is shorter than W
        p = lens[:, None] - W + torch.arange(W, device=dev)
        idx = _stream_index(torch.arange(N, device=dev)[:, None].expand(N, W), p, starts, N, W)
        state = stream.index_select(0, idx.flatten()).view(N, W, D).transpose(1, 2).contiguous()
        return y, state


def add_qkv_convs(layer: nn.Module, q_dim: int, k_dim: int, v_dim: int, conv_size: int,
                  conv_bias: bool) -> None:
    """fla's q_conv1d / k_conv1d / v_conv1d (SiLU), under its attribute names so that its
    state dicts load."""
    for name, dim in (("q_conv1d", q_dim), ("k_conv1d", k_dim), ("v_conv1d", v_dim)):
        setattr(layer, name, ShortConvolution(dim, conv_size, bias=conv_bias, activation="silu"))


def project_qkv(layer: nn.Module, x: torch.Tensor, last, use_cache, cu_seqlens,
                cu_seqlens_cpu=None, cp_context=None):
    """The q, k, v projections of x, through the layer's short convolutions when it has them
    (fla: before any feature map; the gates read x itself), split into heads: q
    [.., num_heads, head_k_dim], k [.., num_kv_heads, head_k_dim], v [.., num_kv_heads,
    head_v_dim]. Returns (q, k, v, the conv_state tuple to cache or None). With a cp_context
    (fla_ext.cp) each convolution reads the rows before the slice from the previous rank."""
    q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    conv_state = None
    if layer.use_short_conv:
        caches = (last or {}).get("conv_state") or (None, None, None)
        convs = (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)
        if cp_context is not None:  # the rows before the slice, from the previous rank
            from .. import cp
            caches = tuple(cp.halo(cp_context, t, conv.kernel_size[0]).transpose(1, 2)
                           for conv, t in zip(convs, (q, k, v)))
        out = [conv(t, cache=c, output_final_state=bool(use_cache), cu_seqlens=cu_seqlens,
                    cu_seqlens_cpu=cu_seqlens_cpu)
               for conv, t, c in zip(convs, (q, k, v), caches)]
        (q, cq), (k, ck), (v, cv) = out
        conv_state = (cq, ck, cv) if use_cache else None
    return (q.unflatten(-1, (layer.num_heads, layer.head_k_dim)),
            k.unflatten(-1, (layer.num_kv_heads, layer.head_k_dim)),
            v.unflatten(-1, (layer.num_kv_heads, layer.head_v_dim)), conv_state)
