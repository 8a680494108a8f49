"""Drop-in layers (LAYERS.md, issue 6): parameter names and shapes as fla's, a fresh layer gives
finite outputs and gradients, decoding with the cache reproduces the full forward, left padding
equals running each sequence alone, chunk and recurrent modes agree."""
import pytest
import torch

from conftest import DEVICES
from fla_ext.layers import Cache, GatedSlotAttention


def gsa_layer(device, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    args = dict(hidden_size=64, num_heads=4, num_kv_heads=2, num_slots=8, layer_idx=0)
    args.update(kw)
    return GatedSlotAttention(**args).to(device=device, dtype=dtype)


def test_gsa_parameters_match_fla():
    layer = gsa_layer("cpu")
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {"q_proj.weight": (64, 64), "k_proj.weight": (32, 64),
                      "v_proj.weight": (32, 64), "f_proj.weight": (16, 64),
                      "g_norm.weight": (64,), "o_proj.weight": (64, 64)}
    assert layer.g_norm.weight.dtype == torch.float32 and torch.equal(layer.g_norm.weight, torch.ones(64))
    t2r = GatedSlotAttention(hidden_size=32, num_heads=2, feature_map="t2r", layer_idx=0)
    assert tuple(t2r.feature_map.layer.weight.shape) == (16, 16)
    assert t2r.num_slots == 16  # default: head_k_dim


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [40, 130], ids=["fused", "chunk"])
def test_gsa_fresh_layer_is_finite(device, dtype, T):
    layer = gsa_layer(device, dtype)
    x = torch.randn(2, T, 64, device=device, dtype=dtype, requires_grad=True)
    o, _, _ = layer(x)
    assert o.shape == x.shape and o.dtype == dtype
    o.float().square().mean().backward()
    assert torch.isfinite(o).all() and torch.isfinite(x.grad).all()
    for n, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


@pytest.mark.parametrize("device", DEVICES)
def test_gsa_decoding_with_cache_matches_full_forward(device):
    """Prompt of 70 tokens (chunk mode), then token by token, then a piece of 5: equal to one
    forward over everything (fp32 <= 1e-5)."""
    layer = gsa_layer(device)
    x = torch.randn(2, 90, 64, device=device)
    full, _, _ = layer(x)
    cache = Cache()
    outs = [layer(x[:, :70], past_key_values=cache, use_cache=True)[0]]
    for t in range(70, 85):
        outs.append(layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0])
    outs.append(layer(x[:, 85:], past_key_values=cache, use_cache=True)[0])
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 90


@pytest.mark.parametrize("device", DEVICES)
def test_gsa_left_padding_is_each_sequence_alone(device):
    layer = gsa_layer(device)
    lens = [100, 67, 3]
    xs = [torch.randn(1, n, 64, device=device) for n in lens]
    T = max(lens)
    batch = torch.zeros(len(lens), T, 64, device=device)
    mask = torch.zeros(len(lens), T, dtype=torch.long, device=device)
    for i, (x, n) in enumerate(zip(xs, lens)):
        batch[i, T - n:] = x[0]
        mask[i, T - n:] = 1
    o, _, _ = layer(batch, attention_mask=mask)
    for i, (x, n) in enumerate(zip(xs, lens)):
        alone, _, _ = layer(x)
        torch.testing.assert_close(o[i, T - n:], alone[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(o[i, :T - n], torch.zeros_like(o[i, :T - n]))


def test_gsa_modes_agree():
    chunk = gsa_layer("cpu", mode="chunk")
    rec = gsa_layer("cpu", mode="fused_recurrent")
    rec.load_state_dict(chunk.state_dict())
    x = torch.randn(2, 150, 64)
    torch.testing.assert_close(chunk(x)[0], rec(x)[0], rtol=1e-5, atol=1e-5)


def test_gsa_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        GatedSlotAttention(mode="parallel", hidden_size=32, num_heads=2, layer_idx=0)
    with pytest.raises(ValueError, match="expand_v"):
        GatedSlotAttention(hidden_size=32, num_heads=2, expand_v=2, layer_idx=0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        GatedSlotAttention(hidden_size=32, num_heads=4, num_kv_heads=3, layer_idx=0)
