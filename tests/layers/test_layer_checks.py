"""The layers check their inputs at the start of forward (no silent garbage, errors in the
user's terms): hidden_states, attention_mask, a cache without layer_idx or from another batch,
RWKV7's v_first, cu_seqlens / cu_seqlens_cpu (the layers and ShortConvolution), and a cp_context
not from fla_ext.cp. Each error names the layer and the argument; valid uses next to them still run."""
import re
import warnings

import pytest
import torch

from conftest import HAS_CUDA
from fla_ext.layers import (Cache, GatedLinearAttention, GatedSlotAttention, RWKV6Attention,
                            RWKV7Attention, ShortConvolution)

C = 32
BUILD = {
    "gla": lambda idx: GatedLinearAttention(hidden_size=C, num_heads=2, layer_idx=idx),
    "gla_conv": lambda idx: GatedLinearAttention(hidden_size=C, num_heads=2, layer_idx=idx,
                                                 use_short_conv=True, conv_size=3),
    "gsa": lambda idx: GatedSlotAttention(hidden_size=C, num_heads=2, num_slots=4, layer_idx=idx),
    "rwkv6": lambda idx: RWKV6Attention(hidden_size=C, num_heads=2, proj_low_rank_dim=8,
                                        gate_low_rank_dim=8, layer_idx=idx, num_hidden_layers=2),
    "rwkv7": lambda idx: RWKV7Attention(hidden_size=C, head_dim=16, layer_idx=idx,
                                        num_hidden_layers=2),
}
NAME = {"gla": "GatedLinearAttention", "gla_conv": "GatedLinearAttention",
        "gsa": "GatedSlotAttention", "rwkv6": "RWKV6Attention", "rwkv7": "RWKV7Attention"}
KINDS = list(BUILD)
RWKV = ["rwkv6", "rwkv7"]  # they zero padded tokens instead of removing them


def make(kind, layer_idx=0, device="cpu"):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layer_idx=None warns at construction
        layer = BUILD[kind](layer_idx)
    if kind.startswith("rwkv"):  # o_proj and the LoRA inputs are 0 at init: outputs would be 0
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if name == "o_proj.weight" or name.endswith("lora.0.weight") or \
                        name == "x_proj.0.linear.weight":
                    p.normal_(0, 0.2)
    return layer.to(device)


def x_of(B, T, device="cpu", gen=None):
    return torch.randn(B, T, C, generator=gen).to(device)


def left_mask(lens, T, device="cpu"):
    return (torch.arange(T) >= T - torch.tensor(lens)[:, None]).long().to(device)


def right_mask(lens, T):
    return (torch.arange(T) < torch.tensor(lens)[:, None]).long()


# ---------------------------------------------------------------------------------------------
# hidden_states

@pytest.mark.parametrize("kind", KINDS)
def test_hidden_states_of_the_wrong_size(kind):
    with pytest.raises(ValueError, match=rf"^fla_ext: {NAME[kind]} expects hidden_states "
                                         rf"\[B, T, 32\], got \[2, 7, 16\]$"):
        make(kind)(torch.randn(2, 7, 16))


@pytest.mark.parametrize("kind", KINDS)
def test_hidden_states_of_rank_2(kind):
    with pytest.raises(ValueError, match=rf"{NAME[kind]} expects hidden_states \[B, T, 32\], "
                                         rf"got \[7, 32\]"):
        make(kind)(torch.randn(7, C))


@pytest.mark.parametrize("kind", KINDS)
def test_hidden_states_not_a_floating_tensor(kind):
    layer = make(kind)
    with pytest.raises(TypeError, match=rf"{NAME[kind]} expects `hidden_states` to be a "
                                        rf"torch.Tensor, got list"):
        layer([[0.0] * C])
    with pytest.raises(ValueError, match=rf"{NAME[kind]} expects a floating-point "
                                         rf"`hidden_states`, got torch.int64"):
        layer(torch.ones(2, 7, C, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# attention_mask

@pytest.mark.parametrize("kind", KINDS)
def test_mask_of_another_batch_size(kind):
    """[1, T] for B = 2 used to broadcast (RWKV) or drop row 1 (GLA/GSA)."""
    with pytest.raises(ValueError, match=rf"{NAME[kind]} expects attention_mask \[B, T'\] with "
                                         rf"B = 2 and T' >= T = 7 .*got \[1, 7\]"):
        make(kind)(x_of(2, 7), attention_mask=torch.ones(1, 7, dtype=torch.long))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(2, 5), (7,), (2, 7, 1)], ids=["short", "1d", "3d"])
def test_mask_shorter_than_T_or_not_2d(kind, shape):
    """A mask shorter than T would misalign its rows with the tokens."""
    with pytest.raises(ValueError, match=rf"{NAME[kind]} expects attention_mask \[B, T'\] .*"
                                         rf"got {re.escape(str(list(shape)))}"):
        make(kind)(x_of(2, 7), attention_mask=torch.ones(*shape, dtype=torch.long))


@pytest.mark.parametrize("kind", KINDS)
def test_mask_of_floating_dtype(kind):
    """An additive float mask (0 keeps, -inf drops) would read inverted."""
    mask = torch.zeros(2, 7)
    mask[0, :3] = float("-inf")
    with pytest.raises(ValueError, match=rf"{NAME[kind]} expects a bool or integer "
                                         rf"`attention_mask` .*got torch.float32"):
        make(kind)(x_of(2, 7), attention_mask=mask)


@pytest.mark.parametrize("kind", RWKV)
@pytest.mark.parametrize("mask", [right_mask([7, 4], 7), torch.tensor([[1] * 7, [0, 1, 1, 0, 1, 1, 1]])],
                         ids=["right", "hole"])
def test_rwkv_mask_must_be_left_padded(kind, mask):
    """The RWKV layers zero a padded token: after a kept one it would still decay the state."""
    with pytest.raises(ValueError, match=rf"{NAME[kind]} needs a left-padded attention_mask "
                                         rf"\(each row 0...0 1...1\).* row 1 is not"):
        make(kind)(x_of(2, 7), attention_mask=mask)


@pytest.mark.parametrize("kind", RWKV)
def test_rwkv_mask_history_must_be_left_padded(kind):
    """Decoding: the mask [B, T'] covers the cached tokens too; a padded token among them (T'
    > T) means the state it carries was decayed by padding."""
    mask = left_mask([9, 4], 9)
    mask[0, 5] = 0
    layer = make(kind)
    with pytest.raises(ValueError, match=r"needs a left-padded attention_mask.* row 0 is not"):
        layer(x_of(2, 2), attention_mask=mask)
    mask[0, 5] = 1
    layer(x_of(2, 2), attention_mask=mask)  # a left-padded history is fine


@pytest.mark.parametrize("kind", RWKV)
def test_rwkv_mask_nonzero_is_kept(kind):
    """Any nonzero value is a kept token (as `.bool()` reads it): a 2 used to scale the token."""
    layer, x = make(kind), x_of(2, 7)
    mask = left_mask([7, 4], 7)
    o = layer(x, attention_mask=mask)[0]
    torch.testing.assert_close(layer(x, attention_mask=mask * 2)[0], o, rtol=0, atol=0)
    torch.testing.assert_close(layer(x, attention_mask=mask.bool())[0], o, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["gla", "gla_conv", "gsa"])
def test_removing_layers_take_any_padding(kind):
    """GLA and GSA remove padded tokens, so right padding is valid there: a row equals its
    sequence alone (and values other than 1 count as kept)."""
    layer, x = make(kind), x_of(2, 7)
    o = layer(x, attention_mask=right_mask([7, 4], 7) * 3)[0]
    torch.testing.assert_close(o[1, :4], layer(x[1:, :4])[0][0], rtol=1e-5, atol=1e-5)
    assert torch.all(o[1, 4:] == 0)


@pytest.mark.parametrize("kind", KINDS)
def test_mask_longer_than_T_uses_its_last_columns(kind):
    """fla's decoding convention stays valid: [B, T'] with T' > T reads the last T columns."""
    layer, x = make(kind), x_of(2, 3)
    mask = left_mask([8, 2], 8)
    torch.testing.assert_close(layer(x, attention_mask=mask)[0],
                               layer(x, attention_mask=mask[:, -3:])[0], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# the cache

@pytest.mark.parametrize("kind", KINDS)
def test_cache_needs_layer_idx(kind):
    """A layer without layer_idx used to read and write slot 0 of a shared cache (another
    layer's)."""
    layer = make(kind, layer_idx=None)
    layer(x_of(2, 5))  # without a cache it runs
    with pytest.raises(ValueError, match=rf"{NAME[kind]} was built with layer_idx=None, so it "
                                         rf"has no slot in the Cache given as past_key_values"):
        layer(x_of(2, 5), past_key_values=Cache(), use_cache=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_cache_of_another_batch(kind, varlen):
    """The states of 2 sequences used to reach the op as an `initial_state` the user never
    passed (or go to the wrong sequences)."""
    layer, cache = make(kind), Cache()
    layer(x_of(2, 5), past_key_values=cache, use_cache=True)
    kw = dict(cu_seqlens=torch.tensor([0, 1, 2, 3])) if varlen else {}
    with pytest.raises(ValueError, match=rf"{NAME[kind]} layer 0: the cache was built for 2 "
                                         rf"sequences but the input has 3; pass a new Cache\(\)"):
        layer(x_of(1, 3) if varlen else x_of(3, 1), past_key_values=cache, use_cache=True, **kw)
    layer(x_of(2, 1), past_key_values=cache, use_cache=True)  # the same batch goes on


# ---------------------------------------------------------------------------------------------
# RWKV7's v_first

@pytest.mark.parametrize("shape", [(1, 7, C), (2, 7, 16), (2, 1, C)], ids=["batch", "dim", "time"])
def test_rwkv7_v_first_shape(shape):
    """A [1, T, C] v_first used to broadcast one sequence's values into every row."""
    layer = make("rwkv7", layer_idx=1)
    with pytest.raises(ValueError, match=rf"RWKV7Attention layer 1 expects v_first \[2, 7, 32\] "
                                         rf"\(layer 0's values: .*got \[{shape[0]}, {shape[1]}, "
                                         rf"{shape[2]}\]"):
        layer(x_of(2, 7), v_first=torch.randn(*shape))
    with pytest.raises(TypeError, match=r"RWKV7Attention expects `v_first` to be a torch.Tensor"):
        layer(x_of(2, 7), v_first=[0.0])
    layer(x_of(2, 7), v_first=torch.randn(2, 7, C))


# ---------------------------------------------------------------------------------------------
# cu_seqlens and cu_seqlens_cpu

BAD_CU = [
    (torch.tensor([0, 4, 2, 6]), r": `cu_seqlens` must be non-decreasing, but cu_seqlens\[2\] = 2"),
    (torch.tensor([0, 2, 5]), r": `cu_seqlens\[-1\]` must equal the number of rows T = 6, got 5"),
    (torch.tensor([1, 2, 6]), r": `cu_seqlens\[0\]` must be 0, got 1"),
    (torch.tensor([0.0, 6.0]), r" expects cu_seqlens as a 1-D integer .*torch.float32"),
    (torch.tensor([[0, 6]]), r" expects cu_seqlens as a 1-D integer .*\[1, 2\]"),
    (torch.tensor([6]), r" expects cu_seqlens as a 1-D integer .*\[1\]"),
]
BAD_CU_IDS = ["decreasing", "short_of_T", "start", "float", "2d", "one_entry"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cu,msg", BAD_CU, ids=BAD_CU_IDS)
def test_malformed_cu_seqlens(kind, cu, msg):
    with pytest.raises(ValueError, match=NAME[kind] + msg):
        make(kind)(x_of(1, 6), cu_seqlens=cu)


@pytest.mark.parametrize("kind", KINDS)
def test_cu_seqlens_needs_batch_1(kind):
    with pytest.raises(ValueError, match=rf"{NAME[kind]} with cu_seqlens needs B = 1 .*got B = 2"):
        make(kind)(x_of(2, 6), cu_seqlens=torch.tensor([0, 6]))


@pytest.mark.parametrize("kind", KINDS)
def test_cu_seqlens_cpu_is_checked(kind):
    """fla's host copy is read instead of cu_seqlens (no device sync); it used to be ignored."""
    layer, x, cu = make(kind), x_of(1, 6), torch.tensor([0, 2, 6])
    with pytest.raises(ValueError, match=rf"{NAME[kind]}: `cu_seqlens_cpu\[-1\]` must equal "
                                         rf"the number of rows T = 6, got 5"):
        layer(x, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match=rf"{NAME[kind]}: `cu_seqlens_cpu` has shape \[4\] but "
                                         rf"`cu_seqlens` has \[3\]"):
        layer(x, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 2, 4, 6]))
    with pytest.raises(ValueError, match=rf"{NAME[kind]} was given `cu_seqlens_cpu` without "
                                         rf"`cu_seqlens`"):
        layer(x, cu_seqlens_cpu=cu)
    torch.testing.assert_close(layer(x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone())[0],
                               layer(x, cu_seqlens=cu)[0], rtol=0, atol=0)


def short_conv():
    torch.manual_seed(0)
    return ShortConvolution(8, 3)


@pytest.mark.parametrize("cu,msg", BAD_CU, ids=BAD_CU_IDS)
def test_short_conv_malformed_cu_seqlens(cu, msg):
    """ShortConvolution indexes with cu_seqlens: [0, 4, 2, 6] used to run silently."""
    with pytest.raises(ValueError, match="ShortConvolution" + msg):
        short_conv()(torch.randn(1, 6, 8), cu_seqlens=cu)


def test_short_conv_cu_seqlens_cpu_is_checked():
    c, x, cu = short_conv(), torch.randn(1, 6, 8), torch.tensor([0, 2, 6])
    with pytest.raises(ValueError, match=r"ShortConvolution: `cu_seqlens_cpu` must be "
                                         r"non-decreasing"):
        c(x, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 7, 6]))
    with pytest.raises(ValueError, match=r"ShortConvolution was given `cu_seqlens_cpu` without"):
        c(x, cu_seqlens_cpu=cu)
    torch.testing.assert_close(c(x, cu_seqlens=cu, cu_seqlens_cpu=cu)[0], c(x, cu_seqlens=cu)[0],
                               rtol=0, atol=0)


def test_short_conv_inputs():
    c = short_conv()
    with pytest.raises(TypeError, match=r"ShortConvolution expects `x` to be a torch.Tensor"):
        c([[0.0] * 8])
    with pytest.raises(ValueError, match=r"ShortConvolution expects a floating-point `x`, got "
                                         r"torch.int64"):
        c(torch.ones(1, 6, 8, dtype=torch.long))
    x = torch.randn(2, 6, 8)
    with pytest.raises(ValueError, match=r"ShortConvolution expects a bool or integer `mask`"):
        c(x, mask=torch.ones(2, 6))
    mask = left_mask([6, 3], 6)
    torch.testing.assert_close(c(x, mask=mask * 2)[0], c(x, mask=mask)[0], rtol=0, atol=0)
    torch.testing.assert_close(c(x, mask=mask.bool())[0], c(x, mask=mask)[0], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# CUDA: a device cu_seqlens or mask is read only through its host copy or with the checks on

cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_cu_seqlens_checked_through_host_copy_or_checks(kind, monkeypatch):
    layer, x = make(kind, device="cuda"), x_of(1, 6, "cuda")
    cu = torch.tensor([0, 4, 2, 6])
    with pytest.raises(ValueError, match=rf"{NAME[kind]}: `cu_seqlens_cpu` must be non-decreasing"):
        layer(x, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)
    monkeypatch.setenv("FLA_EXT_CHECKS", "1")
    with pytest.raises(ValueError, match=rf"{NAME[kind]}: `cu_seqlens` must be non-decreasing"):
        layer(x, cu_seqlens=cu.cuda())


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", RWKV)
def test_cuda_mask_left_padding_checked_with_checks_on(kind, monkeypatch):
    layer, x = make(kind, device="cuda"), x_of(2, 7, "cuda")
    mask = right_mask([7, 4], 7).cuda()
    monkeypatch.setenv("FLA_EXT_CHECKS", "0")
    layer(x, attention_mask=mask)  # a value check: off by default on the device
    monkeypatch.setenv("FLA_EXT_CHECKS", "1")
    with pytest.raises(ValueError, match=r"needs a left-padded attention_mask"):
        layer(x, attention_mask=mask)
    with pytest.raises(ValueError, match=r"attention_mask is on cpu but hidden_states on cuda"):
        layer(x, attention_mask=mask.cpu())


@pytest.mark.parametrize("kind", KINDS)
def test_cp_context_of_another_kind(kind):
    """A layer's cp_context comes from fla_ext.cp.build_cp_context: fla's own FLACPContext is
    another protocol (NotImplementedError), any other object a TypeError; both name the layer."""
    layer, x = make(kind), torch.randn(1, 7, C)
    FLACPContext = type("FLACPContext", (), {"__module__": "fla.ops.cp"})
    with pytest.raises(NotImplementedError, match=f"{NAME[kind]}: fla's context parallelism"):
        layer(x, cp_context=FLACPContext())
    with pytest.raises(TypeError, match=f"{NAME[kind]}: `cp_context` must come from"):
        layer(x, cp_context=object())
