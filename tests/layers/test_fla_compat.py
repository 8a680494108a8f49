"""Drop-in check against flash-linear-attention itself: fla's layer and ours, built with the same
arguments, fla's state dict loaded into ours with strict=True, give the same outputs and input
gradients, and (GLA, GSA) the same cached decoding.

Metric: relative L2 error ||ours - fla|| / ||fla|| (conftest.rel_err), of the outputs and of
dL/dx, bounded as docs/algorithms.md §8.3 bounds values and gradients. bf16: 1e-2 and 2e-2 (the two
sides round activations to bf16 at different points; measured <= 6.5e-3 and 1.02e-2). fp32 on
the CPU: 2e-5 (fla in the interpreter computes in true fp32; measured <= 4e-7 and 2.3e-6, the
RWKV6 input gradient). fp32 on CUDA: 5e-3 and 1e-2, because fla's chunk kernels multiply fp32 in
TF32 (10-bit mantissa, ~1e-3 relative); measured on an H100 for GLA (with and without the short
convolution): <= 4.1e-4 and 6.2e-4 at T = 160 (fla's chunk path), <= 1.2e-6 at T = 48.

Skipped when fla is not importable (CI). Without CUDA fla's Triton kernels run under
TRITON_INTERPRET=1 (set here, before fla defines its kernels), with two limits of the Triton 3.8
interpreter: it has no driver to benchmark autotune configs with (the first config is taken), and
its bfloat16 arithmetic is wrong (NaN from a plain bf16 subtraction), which hits fla's token-shift
kernel, so RWKV6/RWKV7 are compared in bf16 only on CUDA. fla's RWKV7 chunk kernel does not run in
the interpreter either (a loop index is a Python int there and `i_t.to(...)` fails), so on the CPU
RWKV7 is compared in eval mode without autograd (fla's fused recurrent kernel); with CUDA in
training mode with gradients too."""
import importlib.util
import os

import pytest
import torch

from conftest import HAS_CUDA, rel_err

if importlib.util.find_spec("fla") is None:
    pytest.skip("flash-linear-attention (fla) is not installed", allow_module_level=True)
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before fla defines its kernels
    import triton.runtime.autotuner as _autotuner
    _autotuner.Autotuner.prune_configs = lambda self, kwargs: self.configs[:1]

fla_layers = pytest.importorskip("fla.layers")

import fla_ext.layers as ours  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
pytestmark = [pytest.mark.cuda] if HAS_CUDA else []  # on a GPU these are its CUDA tests
TOL = {torch.float32: (5e-3, 1e-2) if HAS_CUDA else (2e-5, 2e-5),  # (outputs, gradients)
       torch.bfloat16: (1e-2, 2e-2)}
C = 64
# Tiny shapes keep the interpreter affordable; with CUDA the chunk kernels (T > 64) run as well.
LENGTHS = [48, 160] if HAS_CUDA else [48]

CASES = {
    "gla": ("GatedLinearAttention", dict(hidden_size=C, num_heads=2, layer_idx=0)),
    "gla_conv": ("GatedLinearAttention", dict(hidden_size=C, num_heads=2, num_kv_heads=1,
                                              use_short_conv=True, conv_bias=True, layer_idx=0)),
    "gsa": ("GatedSlotAttention", dict(hidden_size=C, num_heads=2, num_slots=16, layer_idx=0)),
    "gsa_conv": ("GatedSlotAttention", dict(hidden_size=C, num_heads=2, num_kv_heads=1,
                                            num_slots=16, use_short_conv=True, layer_idx=0)),
    "rwkv6": ("RWKV6Attention", dict(hidden_size=C, num_heads=2, proj_low_rank_dim=8,
                                     gate_low_rank_dim=16, layer_idx=1, num_hidden_layers=2)),
}


def skip_interpreted_bf16(dtype):
    if not HAS_CUDA and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter's bf16 arithmetic breaks fla's token shift")


def perturbed(layer: torch.nn.Module) -> torch.nn.Module:
    """fla's init leaves o_proj, LoRA inputs, bonus... at 0 (outputs would be 0 or trivially
    equal): add noise to every parameter."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def pair(cls_name, kwargs, dtype):
    torch.manual_seed(0)
    theirs = perturbed(getattr(fla_layers, cls_name)(**kwargs))
    mine = getattr(ours, cls_name)(**kwargs)
    mine.load_state_dict(theirs.state_dict(), strict=True)
    return theirs.to(DEVICE, dtype), mine.to(DEVICE, dtype)


def forward_and_grad(layer, x, **kw):
    x = x.detach().clone().requires_grad_()
    o = layer(x, **kw)[0]
    (o.float() * torch.linspace(-1, 1, o.shape[-1], device=o.device)).sum().backward()
    return o.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_fla(case, T, dtype):
    if case == "rwkv6":
        skip_interpreted_bf16(dtype)
    theirs, mine = pair(*CASES[case], dtype)
    x = torch.randn(2, T, C, device=DEVICE, dtype=dtype)
    o_ref, dx_ref = forward_and_grad(theirs, x)
    o, dx = forward_and_grad(mine, x)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    assert o_ref.float().norm() > 0 and torch.isfinite(o).all()
    assert rel_err(o, o_ref) <= TOL[dtype][0]
    assert rel_err(dx, dx_ref) <= TOL[dtype][1]


def rwkv7_pairs(dtype, fuse_norm):
    kw = dict(hidden_size=C, head_dim=16, num_hidden_layers=2, fuse_norm=fuse_norm)
    pairs = [pair("RWKV7Attention", dict(kw, layer_idx=i), dtype) for i in range(2)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def run_rwkv7(layers, x):
    """Layers 0 and 1: layer 0 makes v_first, layer 1 mixes it in."""
    v_first, h, outs = None, x, []
    for layer in layers:
        o, _, _, v_first = layer(h, v_first=v_first)
        outs.append(o)
        h = h + o
    return outs, v_first


TRAINING = [False, pytest.param(True, marks=[pytest.mark.cuda, pytest.mark.skipif(
    not HAS_CUDA, reason="fla's RWKV7 chunk kernel needs CUDA (fails in the interpreter)")])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fuse_norm", [False, True], ids=["nn_norm", "fused_norm"])
@pytest.mark.parametrize("training", TRAINING, ids=["eval", "train"])
def test_rwkv7_matches_fla(dtype, fuse_norm, training):
    skip_interpreted_bf16(dtype)
    theirs, mine = rwkv7_pairs(dtype, fuse_norm)
    for layer in theirs + mine:
        layer.train(training)
    x = torch.randn(2, 48, C, device=DEVICE, dtype=dtype, requires_grad=training)
    with torch.set_grad_enabled(training):
        ref, ref_v = run_rwkv7(theirs, x)
        got, got_v = run_rwkv7(mine, x)
    assert rel_err(got_v, ref_v) <= TOL[dtype][0]
    for o, o_ref in zip(got, ref):
        assert o_ref.float().norm() > 0 and rel_err(o, o_ref) <= TOL[dtype][0]
    if training:
        dx_ref, = torch.autograd.grad(sum(o.float().sum() for o in ref), x)
        dx, = torch.autograd.grad(sum(o.float().sum() for o in got), x)
        assert rel_err(dx, dx_ref) <= TOL[dtype][1]


@pytest.mark.parametrize("case", ["gla_conv", "gsa_conv", "gsa"])
def test_cached_decoding_matches_fla(case):
    """fla's layer with fla's Cache and ours with ours: a 20-token prompt, then 4 single tokens,
    then 3 at once (fp32). The short-conv caches are fla's layout and agree exactly up to
    rounding. The recurrent states agree up to layout, so they do not move between the two:
    fla 0.6.0 keeps GLA's value-first [N, H, V, K] (ours [N, H, K, V], docs/layers.md) and, with
    num_kv_heads < num_heads, GSA's per query head (ours per kv head)."""
    fla_cache = pytest.importorskip("fla.models.utils")  # needs transformers
    theirs, mine = pair(*CASES[case], torch.float32)
    x = torch.randn(2, 27, C, device=DEVICE)
    cache_ref, cache = fla_cache.Cache(), ours.Cache()
    with torch.no_grad():
        for a, b in [(0, 20), (20, 21), (21, 22), (22, 23), (23, 24), (24, 27)]:
            o_ref = theirs(x[:, a:b], past_key_values=cache_ref, use_cache=True)[0]
            o = mine(x[:, a:b], past_key_values=cache, use_cache=True)[0]
            assert rel_err(o, o_ref) <= TOL[torch.float32][0], (a, b)
    ref_state, state = cache_ref[0], cache[0]
    if "conv" in case:
        for c, c_ref in zip(state["conv_state"], ref_state["conv_state"]):
            assert c.shape == c_ref.shape and rel_err(c, c_ref) <= TOL[torch.float32][0]
    if case.startswith("gsa"):  # fla repeats kv heads before its op, we pass them grouped
        for s, s_ref in zip(state["recurrent_state"], ref_state["recurrent_state"]):
            s = s.repeat_interleave(mine.num_kv_groups, 1)
            assert s.shape == s_ref.shape and rel_err(s, s_ref) <= TOL[torch.float32][0]
    else:
        h, h_ref = state["recurrent_state"], ref_state["recurrent_state"]
        assert rel_err(h, h_ref.transpose(-1, -2)) <= TOL[torch.float32][0]
    assert cache.get_seq_length() == cache_ref.get_seq_length() == 27
