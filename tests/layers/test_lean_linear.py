"""layers/lean_linear.py: the mixed and squared-ReLU linear maps against autograd's (float64
gradcheck, the same forward values), the module dispatch (hooks and adapters fall back to a
module call), and what an RWKV-7 model keeps for its backward."""
import pytest
import torch
import torch.nn as nn

import fla_ext
from fla_ext.layers.lean_linear import mixed, mixed_linear, squared_relu, squared_relu_linear
from fla_ext.layers.lora import LoRA

F64 = torch.float64


@pytest.mark.parametrize("mu_shape", [(6,), (1, 1, 6), (2, 5, 6)])
@pytest.mark.parametrize("bias", [False, True])
def test_mixed_linear_gradcheck(mu_shape, bias):
    gen = torch.Generator().manual_seed(0)
    x, d = (torch.randn(2, 5, 6, generator=gen, dtype=F64, requires_grad=True) for _ in range(2))
    mu = torch.randn(mu_shape, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(4, 6, generator=gen, dtype=F64, requires_grad=True)
    b = torch.randn(4, generator=gen, dtype=F64, requires_grad=True) if bias else None
    ins = (x, d, mu, w) + ((b,) if bias else ())
    assert torch.autograd.gradcheck(lambda *a: mixed_linear(*a), ins)
    torch.testing.assert_close(mixed_linear(*ins), nn.functional.linear(torch.addcmul(x, d, mu), w, b),
                               rtol=0, atol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_squared_relu_linear_gradcheck(bias):
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(3, 7, 8, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(5, 8, generator=gen, dtype=F64, requires_grad=True)
    b = torch.randn(5, generator=gen, dtype=F64, requires_grad=True) if bias else None
    ins = (k, w) + ((b,) if bias else ())
    assert torch.autograd.gradcheck(lambda *a: squared_relu_linear(*a), ins)
    torch.testing.assert_close(squared_relu_linear(*ins), nn.functional.linear(torch.relu(k).square(), w, b),
                               rtol=0, atol=0)


def test_bf16_gradients_match_autograd():
    gen = torch.Generator().manual_seed(2)
    x, d = (torch.randn(4, 33, 16, generator=gen).bfloat16() for _ in range(2))
    mu, w = torch.rand(16, generator=gen).bfloat16(), torch.randn(24, 16, generator=gen).bfloat16()
    ours = [t.clone().requires_grad_() for t in (x, d, mu, w)]
    ref = [t.clone().requires_grad_() for t in (x, d, mu, w)]
    gy = torch.randn(4, 33, 24, generator=gen).bfloat16()
    (mixed_linear(*ours) * gy).sum().backward()
    (nn.functional.linear(torch.addcmul(*ref[:3]), ref[3]) * gy).sum().backward()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("keep", [True, False], ids=["plain", "lean"])
def test_modules_dispatch(keep):
    with fla_ext.keep_workspaces(keep):
        _check_dispatch()


def _check_dispatch():
    torch.manual_seed(3)
    x, d, mu = torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(8)
    mix = torch.addcmul(x, d, mu)
    lin, lora = nn.Linear(8, 5), LoRA(8, 5, 3, activation="tanh")
    with torch.no_grad():
        lora.lora[0].weight.normal_()
    torch.testing.assert_close(mixed(lin, x, d, mu), lin(mix))
    torch.testing.assert_close(mixed(lora, x, d, mu), lora(mix))
    torch.testing.assert_close(squared_relu(lin, mix), lin(torch.relu(mix).square()))
    calls = []
    lin.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape))  # FSDP unshards so
    mixed(lin, x, d, mu), squared_relu(lin, mix)
    assert calls == [mix.shape, mix.shape]


def _saved_bytes_per_token(model, tokens):
    """Bytes of distinct storages the autograd graph of the loss keeps, per token, not counting
    parameters, the logits' cross-entropy and the fla ops (C++ nodes, not listed here)."""
    loss = model(input_ids=tokens, labels=tokens).loss
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total, stack, done = set(), 0, [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in done:
            continue
        done.add(node)
        saved = []
        if "CrossEntropy" not in type(node).__name__:
            for name in dir(node):
                if name.startswith("_saved_"):
                    v = getattr(node, name)
                    saved += [v] if isinstance(v, torch.Tensor) else [t for t in v if isinstance(t, torch.Tensor)] \
                        if isinstance(v, (tuple, list)) else []
            saved += list(getattr(node, "saved_tensors", ()))
        for t in saved:
            s = t.untyped_storage()
            if s.data_ptr() not in params and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        stack += [n for n, _ in node.next_functions]
    return total / tokens.numel()


def test_rwkv7_model_keeps_few_hidden_sized_tensors():
    """Under keep_workspaces(False) an RWKV-7 block (attention and channel mix) keeps ~28
    hidden-sized vectors per token for its backward besides the op's own; by default, with each
    mix and the squared ReLU's output kept by autograd, ~37 (the six mixes, relu(k) and
    relu(k)^2 at 4x the hidden size)."""
    pytest.importorskip("transformers")
    from fla_ext.models import RWKV7Config, RWKV7ForCausalLM
    torch.manual_seed(4)
    hidden, layers = 256, 2
    model = RWKV7ForCausalLM(RWKV7Config(hidden_size=hidden, num_hidden_layers=layers, head_dim=64,
                                         vocab_size=97, decay_low_rank_dim=16, gate_low_rank_dim=32,
                                         a_low_rank_dim=16, v_low_rank_dim=16))
    tokens = torch.randint(0, 97, (2, 64))
    per_layer = {}
    for keep in (True, False):
        with fla_ext.keep_workspaces(keep):
            per_layer[keep] = _saved_bytes_per_token(model, tokens) / layers / (4 * hidden)
    assert per_layer[False] <= 30, per_layer
    assert per_layer[True] >= per_layer[False] + 6, per_layer
