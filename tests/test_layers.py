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


# ---------------------------------------------------------------------------------------------
# RWKV6Attention

from fla_ext.layers import RWKV6Attention  # noqa: E402


def rwkv6_layer(device, dtype=torch.float32, trained=True, **kw):
    """A layer with the official init; `trained` also draws o_proj (0 at init, which would make
    every output 0 and the cache checks vacuous) and the zero-initialised LoRA inputs."""
    torch.manual_seed(0)
    args = dict(hidden_size=64, num_heads=2, proj_low_rank_dim=8, gate_low_rank_dim=16,
                layer_idx=1, num_hidden_layers=4)
    args.update(kw)
    layer = RWKV6Attention(**args)
    if trained:
        with torch.no_grad():
            for p in (layer.o_proj.weight, layer.x_proj[0].linear.weight,
                      layer.w_proj.linear.lora[0].weight):
                p.normal_(0, 0.1)
    return layer.to(device=device, dtype=dtype)


def test_rwkv6_parameters_match_fla():
    layer = rwkv6_layer("cpu", trained=False)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {
        "x_proj.0.mu": (64,), "x_proj.0.linear.weight": (40, 64), "x_proj.2.weight": (64, 40),
        "x_bias": (5, 64), "r_proj.linear.weight": (32, 64),
        "w_proj.linear.lora.0.weight": (16, 64), "w_proj.linear.lora.2.weight": (32, 16),
        "w_proj.linear.lora.2.bias": (32,), "k_proj.linear.weight": (32, 64),
        "v_proj.linear.weight": (64, 64), "g_proj.linear.weight": (64, 64), "bonus": (2, 16),
        "g_norm.weight": (64,), "g_norm.bias": (64,), "o_proj.weight": (64, 64)}


@pytest.mark.parametrize("layer_idx,L", [(0, 1), (0, 4), (3, 4)])
def test_rwkv6_official_init(layer_idx, L):
    """The official RWKV-6 recipe, layer-dependent; a single-layer model divides by nothing."""
    layer = RWKV6Attention(hidden_size=64, num_heads=2, proj_low_rank_dim=8,
                           gate_low_rank_dim=16, layer_idx=layer_idx, num_hidden_layers=L)
    r01 = layer_idx / (L - 1) if L > 1 else 0.0
    r10 = 1 - layer_idx / L
    ddd = torch.arange(64) / 64
    torch.testing.assert_close(layer.x_proj[0].mu.data, 1 - ddd ** r10)
    torch.testing.assert_close(layer.x_bias.data[3], 1 - (ddd ** r10 + 0.3 * r01))
    torch.testing.assert_close(layer.x_bias.data[0], 1 - ddd ** (0.5 * r10))
    n = torch.arange(32.0)
    torch.testing.assert_close(layer.w_proj.linear.lora[2].bias.data,
                               -6 + 5 * (n / 31) ** (0.7 + 1.3 * r01))
    torch.testing.assert_close(layer.bonus.data.flatten(), r01 * (1 - n / 31) + ((n + 1) % 3 - 1) * 0.1)
    torch.testing.assert_close(layer.g_norm.weight.data, torch.full((64,), ((layer_idx + 1) / L) ** 0.7))
    assert layer.o_proj.weight.abs().max() == 0 and layer.x_proj[0].linear.weight.abs().max() == 0
    kw = layer.k_proj.linear.weight.data  # orthogonal rows, gain 0.1 (32 x 64: wide)
    torch.testing.assert_close(kw @ kw.T, 0.01 * torch.eye(32), atol=1e-6, rtol=0)
    assert layer.x_proj[2].weight.abs().max() <= 0.01
    for p in layer.parameters():
        assert torch.isfinite(p).all()


def test_rwkv6_init_in_bf16_matches_fp32():
    torch.manual_seed(1)
    a = RWKV6Attention(hidden_size=64, num_heads=2, proj_low_rank_dim=8, gate_low_rank_dim=16,
                       layer_idx=2, num_hidden_layers=4)
    b = RWKV6Attention(hidden_size=64, num_heads=2, proj_low_rank_dim=8, gate_low_rank_dim=16,
                       layer_idx=2, num_hidden_layers=4).to(torch.bfloat16)
    b.reset_parameters()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        if n in ("x_proj.2.weight", "w_proj.linear.lora.2.weight") or n.endswith("linear.weight"):
            continue  # random draws
        torch.testing.assert_close(q.float(), p.to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [40, 130], ids=["fused", "chunk"])
@pytest.mark.parametrize("trained", [False, True], ids=["init", "drawn"])
def test_rwkv6_fresh_layer_is_finite(device, dtype, T, trained):
    layer = rwkv6_layer(device, dtype, trained=trained)
    x = torch.randn(2, T, 64, device=device, dtype=dtype, requires_grad=True)
    o, _, _ = layer(x)
    assert o.shape == x.shape and o.dtype == dtype
    o.float().square().mean().backward()
    assert torch.isfinite(o).all() and torch.isfinite(x.grad).all()
    for n, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


@pytest.mark.parametrize("device", DEVICES)
def test_rwkv6_decoding_with_cache_matches_full_forward(device):
    layer = rwkv6_layer(device)
    x = torch.randn(2, 90, 64, device=device)
    full, _, _ = layer(x)
    assert full.abs().max() > 1e-3
    cache = Cache()
    outs = [layer(x[:, :70], past_key_values=cache, use_cache=True)[0]]
    for t in range(70, 85):
        outs.append(layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0])
    outs.append(layer(x[:, 85:], past_key_values=cache, use_cache=True)[0])
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_rwkv6_left_padding_and_varlen_are_each_sequence_alone(device):
    layer = rwkv6_layer(device)
    lens = [100, 67, 3]
    xs = [torch.randn(1, n, 64, device=device) for n in lens]
    T = max(lens)
    batch = torch.zeros(len(lens), T, 64, device=device)
    mask = torch.zeros(len(lens), T, dtype=torch.long, device=device)
    for i, (x, n) in enumerate(zip(xs, lens)):
        batch[i, T - n:] = x[0]
        mask[i, T - n:] = 1
    o, _, _ = layer(batch, attention_mask=mask)
    packed, _, _ = layer(torch.cat(xs, 1), cu_seqlens=torch.tensor([0, 100, 167, 170], device=device))
    at = 0
    for i, (x, n) in enumerate(zip(xs, lens)):
        alone, _, _ = layer(x)
        torch.testing.assert_close(o[i, T - n:], alone[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[0, at:at + n], alone[0], rtol=1e-5, atol=1e-5)
        at += n


def test_rwkv6_modes_agree():
    chunk = rwkv6_layer("cpu", mode="chunk")
    rec = rwkv6_layer("cpu", mode="fused_recurrent")
    rec.load_state_dict(chunk.state_dict())
    x = torch.randn(2, 150, 64)
    torch.testing.assert_close(chunk(x)[0], rec(x)[0], rtol=1e-5, atol=1e-5)
