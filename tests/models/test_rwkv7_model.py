"""fla_ext.models' RWKV7ForCausalLM through transformers (CPU): the loss from labels and its
backward, cached greedy generate() equal to greedy over full forwards, save_pretrained /
AutoModelForCausalLM.from_pretrained with identical logits, gradient checkpointing, left padding,
the chunked cross-entropy, bf16."""
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from fla_ext import models  # noqa: E402


def tiny(**kw):
    cfg = dict(hidden_size=64, num_hidden_layers=2, head_dim=16, vocab_size=97, decay_low_rank_dim=8,
               gate_low_rank_dim=8, a_low_rank_dim=8, v_low_rank_dim=8, attn_mode="chunk")
    cfg.update(kw)
    torch.manual_seed(0)
    model = models.RWKV7ForCausalLM(models.RWKV7Config(**cfg))
    with torch.no_grad():  # the channel mix's value and the heads start at 0 / tiny: give them weight
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.eval()


def test_loss_and_backward():
    m = tiny(use_l2warp=False)
    x = torch.randint(0, 97, (2, 40))
    out = m(x, labels=x)
    want = F.cross_entropy(out.logits[:, :-1].reshape(-1, 97).float(), x[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, want)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_chunked_cross_entropy_and_l2wrap():
    m = tiny()
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


def test_cached_generate_equals_greedy_full_forwards():
    m = tiny()
    x = torch.randint(0, 97, (2, 11))
    m.generation_config.eos_token_id = None  # no early stop: compare all 8 tokens
    got = m.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0)
    seq = x
    with torch.no_grad():
        for _ in range(8):
            nxt = m(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(got, seq)


def test_save_and_auto_load(tmp_path):
    m = tiny()
    m.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is models.RWKV7ForCausalLM
    x = torch.randint(0, 97, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, m(x).logits, rtol=0, atol=0)
    assert type(transformers.AutoConfig.from_pretrained(tmp_path)) is models.RWKV7Config


def test_gradient_checkpointing_same_gradients():
    m = tiny().train()
    x = torch.randint(0, 97, (1, 24))
    m(x, labels=x).loss.backward()
    g = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    m.gradient_checkpointing_enable()
    m(x, labels=x).loss.backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, g[n], rtol=1e-5, atol=1e-7, msg=n)


def test_left_padding():
    m = tiny()
    a, b = torch.randint(1, 97, (1, 12)), torch.randint(1, 97, (1, 7))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)])
    mask = torch.cat([torch.ones(1, 12), torch.cat([torch.zeros(1, 5), torch.ones(1, 7)], 1)]).long()
    with torch.no_grad():
        padded = m(batch, attention_mask=mask).logits
        alone = m(b).logits
    torch.testing.assert_close(padded[1, 5:], alone[0], rtol=1e-4, atol=1e-5)


def test_bf16_finite():
    m = tiny().to(torch.bfloat16)
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
def test_fla_checkpoint_loads_with_the_same_logits(tmp_path):
    """A checkpoint saved by fla's RWKV7ForCausalLM (where fla imports: the GPU machine) loads
    with no missing or unexpected key and gives fla's logits."""
    fla_models = pytest.importorskip("fla.models")
    if not torch.cuda.is_available():
        pytest.skip("fla's kernels need CUDA")
    cfg = dict(hidden_size=64, num_hidden_layers=2, head_dim=16, vocab_size=97, decay_low_rank_dim=8,
               gate_low_rank_dim=8, a_low_rank_dim=8, v_low_rank_dim=8, fuse_norm=False)
    torch.manual_seed(0)
    theirs = fla_models.RWKV7ForCausalLM(fla_models.RWKV7Config(**cfg)).cuda().eval()
    theirs.save_pretrained(tmp_path)
    ours, info = models.RWKV7ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    x = torch.randint(0, 97, (2, 40), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(ours.cuda().eval()(x).logits.float(), theirs(x).logits.float(),
                                   rtol=1e-3, atol=1e-3)
