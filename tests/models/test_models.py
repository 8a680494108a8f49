"""fla_ext.models' four causal LMs (RWKV-7, RWKV-6, GSA, GLA) through transformers (CPU): the
loss from labels and its backward, cached greedy generate() equal to greedy over full forwards,
save_pretrained / AutoModelForCausalLM.from_pretrained with identical logits, gradient
checkpointing, left padding, the chunked cross-entropy, bf16; fla's checkpoints where fla
imports (the GPU machine)."""
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from fla_ext import models  # noqa: E402


CONFIGS = {  # tiny models of each family, fla's config fields
    "rwkv7": dict(hidden_size=64, num_hidden_layers=2, head_dim=16, vocab_size=97, decay_low_rank_dim=8,
                  gate_low_rank_dim=8, a_low_rank_dim=8, v_low_rank_dim=8),
    "rwkv6": dict(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=97, proj_low_rank_dim=8,
                  gate_low_rank_dim=16),
    "gsa": dict(hidden_size=64, num_hidden_layers=2, num_heads=4, num_slots=8, vocab_size=97),
    "gla": dict(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=97),
}
family = pytest.mark.parametrize("family", list(CONFIGS))


def tiny(family, **kw):
    config, _, lm = models.FAMILIES[family]
    torch.manual_seed(0)
    model = lm(config(**{**CONFIGS[family], "fuse_norm": False, **kw}))
    with torch.no_grad():  # zero-initialised weights (RWKV-7's channel-mix value): give them weight
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.eval()


@family
def test_loss_and_backward(family):
    m = tiny(family, use_l2warp=False)
    x = torch.randint(0, 97, (2, 40))
    out = m(x, labels=x)
    want = F.cross_entropy(out.logits[:, :-1].reshape(-1, 97).float(), x[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, want)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


@family
@pytest.mark.parametrize("fused", [False, True])
def test_num_items_in_batch_and_shift_labels(family, fused):
    """fla's conventions, which transformers' Trainer relies on under gradient accumulation: with
    num_items_in_batch the loss is the sum over the targets divided by it (it was the mean,
    silently: the accumulated gradient then came out that many micro-batches too small), and
    shift_labels are the targets as given."""
    m = tiny(family, use_l2warp=False, fuse_linear_cross_entropy=fused)
    x = torch.randint(0, 97, (2, 40))
    logits = tiny(family, use_l2warp=False)(x).logits.float()
    total = F.cross_entropy(logits[:, :-1].reshape(-1, 97), x[:, 1:].reshape(-1), reduction="sum")
    torch.testing.assert_close(m(x, labels=x, num_items_in_batch=200).loss, total / 200)
    torch.testing.assert_close(m(x, labels=x, num_items_in_batch=torch.tensor(200)).loss, total / 200)
    shifted = torch.randint(0, 97, (2, 40))
    shifted[:, -3:] = -100
    want = F.cross_entropy(logits.reshape(-1, 97), shifted.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(m(x, shift_labels=shifted).loss, want)


@family
def test_chunked_cross_entropy_and_l2wrap(family):
    m = tiny(family, use_l2warp=True)
    x = torch.randint(0, 97, (2, 40))
    plain = m(x, labels=x)
    plain.loss.backward()
    g = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    m.config.fuse_linear_cross_entropy = True
    fused = m(x, labels=x)
    assert fused.logits is None
    torch.testing.assert_close(fused.loss, plain.loss)
    fused.loss.backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, g[n], rtol=1e-4, atol=1e-6, msg=n)


@family
def test_cached_generate_equals_greedy_full_forwards(family):
    m = tiny(family)
    x = torch.randint(0, 97, (2, 11))
    m.generation_config.eos_token_id = None  # no early stop: compare all 8 tokens
    got = m.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0)
    seq = x
    with torch.no_grad():
        for _ in range(8):
            nxt = m(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(got, seq)


@family
def test_save_and_auto_load(family, tmp_path):
    m = tiny(family)
    m.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(m)
    x = torch.randint(0, 97, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, m(x).logits, rtol=0, atol=0)
    assert type(transformers.AutoConfig.from_pretrained(tmp_path)) is type(m.config)
    assert type(transformers.AutoModel.from_pretrained(tmp_path)) is models.FAMILIES[family][1]


@family
def test_gradient_checkpointing_same_gradients(family):
    m = tiny(family).train()
    x = torch.randint(0, 97, (1, 24))
    m(x, labels=x).loss.backward()
    g = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    m.gradient_checkpointing_enable()
    m(x, labels=x).loss.backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, g[n], rtol=1e-5, atol=1e-7, msg=n)


@family
def test_left_padding(family):
    m = tiny(family)
    a, b = torch.randint(1, 97, (1, 12)), torch.randint(1, 97, (1, 7))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)])
    mask = torch.cat([torch.ones(1, 12), torch.cat([torch.zeros(1, 5), torch.ones(1, 7)], 1)]).long()
    with torch.no_grad():
        padded = m(batch, attention_mask=mask).logits
        alone = m(b).logits
    torch.testing.assert_close(padded[1, 5:], alone[0], rtol=1e-4, atol=1e-5)


@family
def test_bf16_finite(family):
    m = tiny(family).to(torch.bfloat16)
    x = torch.randint(0, 97, (2, 70))
    out = m(x, labels=x)
    assert torch.isfinite(out.loss) and torch.isfinite(out.logits.float()).all()


def test_example_trains_and_generates():
    """examples/lm.py as a user runs it: the loss falls, cached generate continues the pattern,
    the save / Auto load round trip is exact."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(root, "examples", "lm.py"), "--steps", "60",
                          "--device", "cpu"], check=True, capture_output=True, text=True, env=env,
                         timeout=600).stdout
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step")]
    assert losses[-1] < 0.5 * losses[0], out
    assert "correct: 1.00" in out or "correct: 0.9" in out, out
    assert "round trip identical: True" in out, out


@pytest.mark.cuda
@family
def test_fla_checkpoint_loads_with_the_same_logits(family, tmp_path):
    """A checkpoint saved by fla's model of the same family (where fla imports: the GPU machine)
    loads with no missing or unexpected key and gives fla's logits."""
    fla_models = pytest.importorskip("fla.models")
    models.register_auto()  # fla's import took the Auto names: later tests load through them
    if not torch.cuda.is_available():
        pytest.skip("fla's kernels need CUDA")
    name = {"rwkv7": "RWKV7", "rwkv6": "RWKV6", "gsa": "GSA", "gla": "GLA"}[family]
    cfg = dict(CONFIGS[family], fuse_norm=False)
    torch.manual_seed(0)
    theirs = getattr(fla_models, f"{name}ForCausalLM")(getattr(fla_models, f"{name}Config")(**cfg)).cuda().eval()
    with torch.no_grad():  # weight in every parameter, so that each one matters to the logits
        for p in theirs.parameters():
            p.add_(0.02 * torch.randn_like(p))
    theirs.save_pretrained(tmp_path)
    ours, info = models.FAMILIES[family][2].from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    x = torch.randint(0, 97, (2, 40), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(ours.cuda().eval()(x).logits.float(), theirs(x).logits.float(),
                                   rtol=1e-3, atol=1e-3)


@family
def test_parameter_names_and_shapes_are_fla_s(family):
    """Every parameter and buffer fla 0.6.0's model of the same config has, under the same name
    and shape, and no other (the table was written from fla's classes: fla_state_dicts.json), so
    its checkpoints load with no missing or unexpected key."""
    import json
    import os
    with open(os.path.join(os.path.dirname(__file__), "fla_state_dicts.json")) as f:
        want = json.load(f)["families"][family]
    got = {k: list(v.shape) for k, v in tiny(family).state_dict().items()}
    assert sorted(set(want) - set(got)) == [], "missing"
    assert sorted(set(got) - set(want)) == [], "unexpected"
    assert {k: got[k] for k in want} == want


def test_example_prompt_with_token_zero():
    """examples/lm.py's held-out prompts hold token 0, generate()'s pad_token_id: without an
    explicit mask transformers took those tokens for padding in the middle of a row, which the
    layers refuse (this run's prompts have them: it raised before the mask was passed)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "examples"))
    from lm import train_lm
    r = train_lm("rwkv7", 15, "cpu")
    assert r["same"] and len(r["losses"]) == 15


def test_register_auto_takes_the_auto_names_back(tmp_path):
    """Importing fla.models registers fla's classes under the same model types, and the Auto
    classes then build fla's models (a later Auto load in the process got fla's RWKV-7);
    register_auto() makes them build fla_ext's again. fla's registration is stood in for here."""
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

    class TheirConfig(PretrainedConfig):
        model_type = "rwkv7"

    class TheirLM(PreTrainedModel):
        config_class = TheirConfig

    tiny("rwkv7").save_pretrained(tmp_path)
    try:
        AutoConfig.register("rwkv7", TheirConfig, exist_ok=True)
        AutoModelForCausalLM.register(TheirConfig, TheirLM, exist_ok=True)
        assert type(AutoConfig.from_pretrained(tmp_path)) is TheirConfig
    finally:
        models.register_auto()
    assert type(AutoConfig.from_pretrained(tmp_path)) is models.RWKV7Config
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is models.RWKV7ForCausalLM


@pytest.mark.parametrize("family", ["rwkv7", "rwkv6", "gsa", "gla"])
def test_unbuilt_layer_kinds_are_refused(family):
    """fla's fields for hybrid attention layers and (GLA, GSA) attention-residual blocks must be
    None: a config asking for them raises, naming the field."""
    config = models.FAMILIES[family][0]
    with pytest.raises(NotImplementedError, match=r"attn=\.\.\."):
        config(**CONFIGS[family], attn={"layers": [0]})
    if family in ("gsa", "gla"):
        with pytest.raises(NotImplementedError, match="attnres_block_size"):
            config(**CONFIGS[family], attnres_block_size=4)
