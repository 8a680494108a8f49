"""Linear maps that keep less for their backward than autograd would, for the RWKV layers and
channel mixes, where these inputs are most of a layer's activations:

- ``mixed_linear(x, delta, mu, weight)`` = linear(x + delta * mu): keeps x and delta (shared by
  all of a layer's mixes) instead of each mix's own input, and forms the mix again in the
  backward.
- ``squared_relu_linear(k, weight)`` = linear(relu(k)^2): keeps k instead of relu(k) and relu(k)^2.

Forward values are autograd's (the same ops); gradients are the same sums (per-channel ones
with a float32 accumulator).

The layers take these forms under ``fla_ext.keep_workspaces(False)``, the memory-lean setting;
by default they run the plain modules on the mix, which measured faster per training step
(benchmarks/NOTES.md c26)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..memory import keeps_workspaces
from .lora import LoRA


def _lean():
    """Whether the layers' mixes and channel mixes keep less (keep_workspaces(False))."""
    return not keeps_workspaces()


def _sum_to(t, shape):
    """t summed over the dimensions `shape` broadcasts along, with a float32 accumulator for
    16-bit t (no float32 copy of t)."""
    shape = tuple(shape)
    if tuple(t.shape) == shape:
        return t
    lead = t.dim() - len(shape)
    dims = list(range(lead)) + [lead + i for i, n in enumerate(shape) if n == 1 and t.shape[lead + i] != 1]
    acc = torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype
    return t.sum(dims, keepdim=True, dtype=acc).reshape(shape)


def _linear_grads(dy, inp, weight, need_in, need_w, need_b):
    """(d input, d weight, d bias) of linear(inp, weight, bias) for output gradient dy, each
    None unless needed."""
    d_in = dy @ weight if need_in else None
    flat_dy = dy.reshape(-1, dy.shape[-1])
    d_w = flat_dy.t() @ inp.reshape(-1, inp.shape[-1]) if need_w else None
    d_b = _sum_to(flat_dy, flat_dy.shape[-1:]).to(dy.dtype) if need_b else None
    return d_in, d_w, d_b


class _MixedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, delta, mu, weight, bias):
        ctx.save_for_backward(x, delta, mu, weight)
        ctx.has_bias = bias is not None
        return F.linear(torch.addcmul(x, delta, mu), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, delta, mu, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        d_mix, d_w, d_b = _linear_grads(dy, torch.addcmul(x, delta, mu), weight, any(need[:3]), need[3],
                                        ctx.has_bias and need[4])
        dx = d_mix if ctx.needs_input_grad[0] else None
        d_delta = d_mix * mu if ctx.needs_input_grad[1] else None
        d_mu = _sum_to(d_mix * delta, mu.shape).to(mu.dtype) if ctx.needs_input_grad[2] else None
        return dx, d_delta, d_mu, d_w, d_b


class _SquaredReluLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, weight, bias):
        ctx.save_for_backward(k, weight)
        ctx.has_bias = bias is not None
        return F.linear(torch.relu(k).square(), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        k, weight = ctx.saved_tensors
        relu = torch.relu(k)
        need = ctx.needs_input_grad
        d_sq, d_w, d_b = _linear_grads(dy, relu.square(), weight, need[0], need[1], ctx.has_bias and need[2])
        dk = d_sq * (2 * relu) if ctx.needs_input_grad[0] else None
        return dk, d_w, d_b


def mixed_linear(x, delta, mu, weight, bias=None):
    """linear(x + delta * mu, weight, bias), the mix as torch.addcmul forms it; mu broadcasts
    against x (a per-channel mix [.., in] or a data-dependent one like x)."""
    return _MixedLinear.apply(x, delta, mu, weight, bias)


def squared_relu_linear(k, weight, bias=None):
    """linear(relu(k) ** 2, weight, bias)."""
    return _SquaredReluLinear.apply(k, weight, bias)


def _no_hooks(*modules):
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in modules)


def mixed(module, x, delta, mu):
    """module(x + delta * mu) for the RWKV layers' projections: an nn.Linear, or fla_ext's LoRA
    (its first factor takes the mix), through mixed_linear. Anything else (an adapter wrapping
    the Linear), or a module with forward hooks (FSDP's unsharding, say), is called as a module on
    the mix. By default (workspaces kept) every module is called on the mix."""
    if _lean():
        if type(module) is nn.Linear and _no_hooks(module):
            return mixed_linear(x, delta, mu, module.weight, module.bias)
        if type(module) is LoRA and type(module.lora[0]) is nn.Linear and _no_hooks(module, module.lora, *module.lora):
            first, act, second = module.lora
            return second(act(mixed_linear(x, delta, mu, first.weight, first.bias)))
    return module(torch.addcmul(x, delta, mu))


def squared_relu(value, k):
    """value(relu(k) ** 2) for a channel mix's value projection (an nn.Linear without hooks goes
    through squared_relu_linear under keep_workspaces(False))."""
    if _lean() and type(value) is nn.Linear and _no_hooks(value):
        return squared_relu_linear(k, value.weight, value.bias)
    return value(torch.relu(k).square())
