"""Drop-in layers (docs/layers.md, issue 6): parameter names and shapes as fla's, a fresh layer gives
finite outputs and gradients, decoding with the cache reproduces the full forward, left padding
equals running each sequence alone, chunk and recurrent modes agree."""
import pytest
import torch

from conftest import DEVICES
from fla_ext.layers import Cache, GatedLinearAttention, GatedSlotAttention, RWKV6Attention


def padded_batch(lens, device):
    """Sequences of the given lengths, alone and as one left-padded batch with its mask."""
    xs = [torch.randn(1, n, 64, device=device) for n in lens]
    T = max(lens)
    batch = torch.zeros(len(lens), T, 64, device=device)
    mask = torch.zeros(len(lens), T, dtype=torch.long, device=device)
    for i, (x, n) in enumerate(zip(xs, lens)):
        batch[i, T - n:] = x[0]
        mask[i, T - n:] = 1
    return xs, batch, mask, T


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


def test_gsa_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        GatedSlotAttention(mode="parallel", hidden_size=32, num_heads=2, layer_idx=0)
    with pytest.raises(ValueError, match="expand_v"):
        GatedSlotAttention(hidden_size=32, num_heads=2, expand_v=2, layer_idx=0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        GatedSlotAttention(hidden_size=32, num_heads=4, num_kv_heads=3, layer_idx=0)


# ---------------------------------------------------------------------------------------------
# RWKV6Attention



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


# ---------------------------------------------------------------------------------------------
# RWKV7Attention

from fla_ext.layers import RWKV7Attention  # noqa: E402


def rwkv7_stack(device, dtype=torch.float32, L=2, drawn=True, C=64, head_dim=16):
    """Layers 0..L-1 of one model; `drawn` also draws o_proj and the zero LoRA inputs (0 at init:
    the outputs would be 0 and the cache checks vacuous)."""
    torch.manual_seed(0)
    layers = [RWKV7Attention(hidden_size=C, head_dim=head_dim, layer_idx=i, num_hidden_layers=L)
              for i in range(L)]
    if drawn:
        with torch.no_grad():
            for layer in layers:
                layer.o_proj.weight.normal_(0, 0.2)
                for lora in [layer.w_lora, layer.a_lora, layer.g_lora] + (
                        [layer.v_lora] if layer.has_v_lora else []):
                    lora.lora[0].weight.normal_(0, 0.2)
    return [layer.to(device=device, dtype=dtype) for layer in layers]


def run_stack(layers, x, **kw):
    v_first, h = None, x
    for layer in layers:
        o, _, _, v_first = layer(h, v_first=v_first, **kw)
        h = h + o
    return h


def test_rwkv7_parameters_match_fla():
    l0, l1 = rwkv7_stack("cpu", drawn=False)
    names0 = {n: tuple(p.shape) for n, p in l0.named_parameters()}
    names1 = {n: tuple(p.shape) for n, p in l1.named_parameters()}
    assert not any(n.startswith("v_lora") for n in names0)  # layer 0 has no value residual
    assert names1["v_lora.lora.0.weight"] == (32, 64) and names1["v_lora.lora.2.bias"] == (64,)
    assert names1["x_r"] == (1, 1, 64) and names1["r_k"] == (4, 16) and names1["k_k"] == (64,)
    assert names1["w_lora.lora.2.weight"] == (64, 32) and names1["g_lora.lora.2.weight"] == (64, 32)
    assert "g_lora.lora.2.bias" not in names1
    big = RWKV7Attention(hidden_size=1024, head_dim=64, layer_idx=0, num_hidden_layers=24)
    # docs/layers.md §2.1: half-to-even rounding gives 64 (not 96) at C = 1024
    assert (big.decay_low_rank_dim, big.gate_low_rank_dim, big.a_low_rank_dim,
            big.v_low_rank_dim) == (64, 160, 64, 64)


@pytest.mark.parametrize("layer_idx,L", [(0, 1), (0, 24), (5, 24), (23, 24)])
def test_rwkv7_official_init(layer_idx, L):
    C, N = 128, 64
    layer = RWKV7Attention(hidden_size=C, head_dim=N, layer_idx=layer_idx, num_hidden_layers=L)
    r01 = layer_idx / (L - 1) if L > 1 else 0.0
    r10 = 1 - layer_idx / L
    n = torch.arange(C, dtype=torch.float32)
    ddd, linear = n / C, n / (C - 1) - 0.5
    z = ((n % N) - (N - 1) / 2) / ((N - 1) / 2)
    zigzag = z * z.abs()
    www = -6 + 6 * (n / (C - 1)) ** (1 + r01 ** 0.3)
    torch.testing.assert_close(layer.x_r.data.flatten(), 1 - ddd ** (0.2 * r10))
    torch.testing.assert_close(layer.x_a.data.flatten(), 1 - ddd ** (0.9 * r10))
    torch.testing.assert_close(layer.k_k.data, 0.71 - 0.1 * linear)
    assert torch.all(layer.k_a == 1.02) and torch.all(layer.r_k == -0.04)
    torch.testing.assert_close(layer.w_lora.lora[2].bias.data, www + 0.5 + 2.5 * zigzag)
    torch.testing.assert_close(layer.a_lora.lora[2].bias.data, -0.19 + 0.3 * zigzag + 0.4 * linear)
    if layer_idx:
        torch.testing.assert_close(layer.v_lora.lora[2].bias.data, 0.73 - 0.4 * linear)
    torch.testing.assert_close(layer.g_norm.weight.data, torch.full((C,), ((layer_idx + 1) / L) ** 0.7))
    assert layer.g_norm.eps == pytest.approx(64e-5)
    assert layer.o_proj.weight.abs().max() == 0
    k = layer.k_proj.weight.data
    torch.testing.assert_close(k @ k.T, 0.01 * torch.eye(C), atol=1e-6, rtol=0)
    for name, p in layer.named_parameters():
        assert torch.isfinite(p).all(), name


def test_rwkv7_bf16_module_gets_the_orthogonal_init():
    """fla loses the r/k/v_proj init when the module is built in bf16; here it lands."""
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = RWKV7Attention(hidden_size=64, head_dim=16, layer_idx=1, num_hidden_layers=2)
    finally:
        torch.set_default_dtype(torch.float32)
    assert layer.k_proj.weight.dtype == torch.bfloat16
    k = layer.k_proj.weight.float()
    torch.testing.assert_close(k @ k.T, 0.01 * torch.eye(64), atol=2e-4, rtol=0)
    assert torch.all(layer.k_a == 1.02) and torch.isfinite(layer.w_lora.lora[2].bias).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("drawn", [False, True], ids=["init", "drawn"])
def test_rwkv7_fresh_stack_is_finite(device, dtype, L, drawn):
    """The all-NaN RWKV7 report: a freshly built stack (single-layer too), training mode."""
    layers = rwkv7_stack(device, dtype, L=L, drawn=drawn)
    x = torch.randn(2, 80, 64, device=device, dtype=dtype, requires_grad=True)
    h = run_stack(layers, x)
    h.float().square().mean().backward()
    assert torch.isfinite(h).all() and torch.isfinite(x.grad).all()
    for layer in layers:
        for n, p in layer.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), n


@pytest.mark.parametrize("device", DEVICES)
def test_rwkv7_decoding_with_cache_matches_full_forward(device):
    """Two layers in eval mode: a 70-token prompt (chunk), then token by token (fused recurrent),
    then a piece of 5, equal to one forward over everything."""
    layers = rwkv7_stack(device)
    for layer in layers:
        layer.eval()
    x = torch.randn(2, 90, 64, device=device)
    with torch.no_grad():
        full = run_stack(layers, x)
        cache = Cache()
        outs = [run_stack(layers, x[:, :70], past_key_values=cache, use_cache=True)]
        for t in range(70, 85):
            outs.append(run_stack(layers, x[:, t:t + 1], past_key_values=cache, use_cache=True))
        outs.append(run_stack(layers, x[:, 85:], past_key_values=cache, use_cache=True))
    assert (full - x).abs().max() > 1e-3
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_rwkv7_left_padding_and_varlen_are_each_sequence_alone(device):
    layers = rwkv7_stack(device)
    lens = [90, 67, 3]
    xs, batch, mask, T = padded_batch(lens, device)
    o = run_stack(layers, batch, attention_mask=mask)
    packed = run_stack(layers, torch.cat(xs, 1), cu_seqlens=torch.tensor([0, 90, 157, 160], device=device))
    at = 0
    for i, (x, n) in enumerate(zip(xs, lens)):
        alone = run_stack(layers, x)
        torch.testing.assert_close(o[i, T - n:], alone[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[0, at:at + n], alone[0], rtol=1e-5, atol=1e-5)
        at += n


def test_rwkv7_needs_v_first():
    _, l1 = rwkv7_stack("cpu")
    with pytest.raises(ValueError, match="v_first"):
        l1(torch.randn(1, 5, 64))


# ---------------------------------------------------------------------------------------------
# GatedLinearAttention

def gla_layer(device, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    args = dict(hidden_size=64, num_heads=4, num_kv_heads=2, layer_idx=0)
    args.update(kw)
    return GatedLinearAttention(**args).to(device=device, dtype=dtype)


def test_gla_parameters_match_fla():
    shapes = {n: tuple(p.shape) for n, p in gla_layer("cpu").named_parameters()}
    assert shapes == {"q_proj.weight": (32, 64), "k_proj.weight": (16, 64),
                      "v_proj.weight": (32, 64), "g_proj.weight": (64, 64),
                      "gk_proj.0.weight": (16, 64), "gk_proj.1.weight": (16, 16),
                      "gk_proj.1.bias": (16,), "o_proj.weight": (64, 64),
                      "g_norm_swish_gate.weight": (16,)}
    unfused = {n for n, _ in gla_layer("cpu", fuse_norm=False).named_parameters()}
    assert "g_norm.weight" in unfused and "g_norm_swish_gate.weight" not in unfused


# ---------------------------------------------------------------------------------------------
# use_short_conv: fla's q/k/v ShortConvolution in front of GLA and GSA

def gla_conv_layer(device, dtype=torch.float32, **kw):
    return gla_layer(device, dtype, use_short_conv=True, conv_bias=True, **kw)


def gsa_conv_layer(device, dtype=torch.float32, **kw):
    return gsa_layer(device, dtype, use_short_conv=True, conv_size=3, **kw)


def test_short_conv_parameters_match_fla():
    gla = {n: tuple(p.shape) for n, p in gla_conv_layer("cpu").named_parameters() if "conv" in n}
    assert gla == {"q_conv1d.weight": (32, 1, 4), "q_conv1d.bias": (32,),
                   "k_conv1d.weight": (16, 1, 4), "k_conv1d.bias": (16,),
                   "v_conv1d.weight": (32, 1, 4), "v_conv1d.bias": (32,)}
    gsa = {n: tuple(p.shape) for n, p in gsa_conv_layer("cpu").named_parameters() if "conv" in n}
    assert gsa == {"q_conv1d.weight": (64, 1, 3), "k_conv1d.weight": (32, 1, 3),
                   "v_conv1d.weight": (32, 1, 3)}
    assert gsa_conv_layer("cpu").q_conv1d.activation == "silu"


@pytest.mark.parametrize("make", [gla_conv_layer, gsa_conv_layer], ids=["gla", "gsa"])
def test_short_conv_cache_holds_fla_conv_state(make):
    """conv_state is fla's tuple (q, k, v), each [N, D, W]: the last W projected inputs."""
    layer = make("cpu")
    x = torch.randn(2, 9, 64)
    cache = Cache()
    layer(x, past_key_values=cache, use_cache=True)
    cq, ck, cv = cache[0]["conv_state"]
    W = layer.conv_size
    assert cq.shape == (2, layer.key_dim, W) and ck.shape == (2, layer.key_dim_per_group, W)
    assert cv.shape == (2, layer.value_dim_per_group, W)
    torch.testing.assert_close(ck, layer.k_proj(x)[:, -W:].transpose(1, 2), rtol=0, atol=0)
    assert layer(x, past_key_values=Cache())[2][0]["conv_state"] is None  # use_cache=False


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [gla_conv_layer, gsa_conv_layer], ids=["gla", "gsa"])
def test_short_conv_left_padded_prompt_then_decoding(device, make):
    """A left-padded prompt (attention_mask), then tokens one by one with the growing mask:
    each row equals its sequence run alone in one forward."""
    layer = make(device)
    lens, extra = [12, 5, 2], 4
    xs, batch, mask, T = padded_batch(lens, device)
    more = torch.randn(len(lens), extra, 64, device=device)
    cache = Cache()
    outs = [layer(batch, attention_mask=mask, past_key_values=cache, use_cache=True)[0]]
    for t in range(extra):
        mask = torch.cat([mask, mask.new_ones(len(lens), 1)], 1)
        outs.append(layer(more[:, t:t + 1], attention_mask=mask, past_key_values=cache,
                          use_cache=True)[0])
    o = torch.cat(outs, 1)
    for i, (x, n) in enumerate(zip(xs, lens)):
        alone, _, _ = layer(torch.cat([x, more[i:i + 1]], 1))
        torch.testing.assert_close(o[i, T - n:], alone[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# What every layer with fla's 3-tuple return must do (RWKV7, with v_first, has its own above)

LAYERS = {"gsa": gsa_layer, "gla": gla_layer, "rwkv6": rwkv6_layer,
          "gsa_conv": gsa_conv_layer, "gla_conv": gla_conv_layer}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [40, 130], ids=["fused", "chunk"])
def test_fresh_layer_is_finite(device, kind, dtype, T):
    layers = [LAYERS[kind](device, dtype)]
    if kind == "rwkv6":
        layers.append(rwkv6_layer(device, dtype, trained=False))  # the init itself: o_proj = 0
    for layer in layers:
        x = torch.randn(2, T, 64, device=device, dtype=dtype, requires_grad=True)
        o, _, _ = layer(x)
        assert o.shape == x.shape and o.dtype == dtype
        o.float().square().mean().backward()
        assert torch.isfinite(o).all() and torch.isfinite(x.grad).all()
        for n, p in layer.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(LAYERS))
def test_decoding_with_cache_matches_full_forward(device, kind):
    """A 70-token prompt (chunk mode), then token by token, then a piece of 5: equal to one
    forward over everything (fp32 <= 1e-5)."""
    layer = LAYERS[kind](device)
    x = torch.randn(2, 90, 64, device=device)
    full, _, _ = layer(x)
    assert full.abs().max() > 1e-3
    cache = Cache()
    outs = [layer(x[:, :70], past_key_values=cache, use_cache=True)[0]]
    for t in range(70, 85):
        outs.append(layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0])
    outs.append(layer(x[:, 85:], past_key_values=cache, use_cache=True)[0])
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
    if layer.layer_idx == 0:  # the cache counts tokens at layer 0 (fla's convention)
        assert cache.get_seq_length() == 90


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(LAYERS))
def test_left_padding_and_varlen_are_each_sequence_alone(device, kind):
    layer = LAYERS[kind](device)
    lens = [100, 67, 3]
    xs, batch, mask, T = padded_batch(lens, device)
    o, _, _ = layer(batch, attention_mask=mask)
    packed, _, _ = layer(torch.cat(xs, 1), cu_seqlens=torch.tensor([0, 100, 167, 170], device=device))
    at = 0
    for i, (x, n) in enumerate(zip(xs, lens)):
        alone, _, _ = layer(x)
        torch.testing.assert_close(o[i, T - n:], alone[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[0, at:at + n], alone[0], rtol=1e-5, atol=1e-5)
        if kind != "rwkv6":  # RWKV6 zeroes padded inputs, not outputs (as fla)
            assert torch.equal(o[i, :T - n], torch.zeros_like(o[i, :T - n]))
        at += n


@pytest.mark.parametrize("kind", list(LAYERS))
def test_modes_agree(kind):
    chunk = LAYERS[kind]("cpu", mode="chunk")
    rec = LAYERS[kind]("cpu", mode="fused_recurrent")
    rec.load_state_dict(chunk.state_dict())
    x = torch.randn(2, 150, 64)
    torch.testing.assert_close(chunk(x)[0], rec(x)[0], rtol=1e-5, atol=1e-5)
