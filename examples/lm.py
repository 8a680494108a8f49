"""Language models from fla_ext.

* ``TinyLM``: a small model built from fla_ext's layers (embedding, pre-norm blocks of a token
  mixer + SwiGLU MLP, norm, tied head), used by demo.py (MQAR training) and generate.py.
* Run as a script: trains a small ``fla_ext.models.RWKV7ForCausalLM`` (``--family``: or RWKV6,
  GSA, GLA; transformers' conventions,
  fla's config and parameter names; ``pip install fla_ext[models]``) for a few steps on a
  synthetic task (arithmetic sequences), prints the loss, generates with the cache and saves / reloads it through
  ``AutoModelForCausalLM``::

      python examples/lm.py [--steps 60] [--device cuda]
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from fla_ext.layers import (Cache, GatedLinearAttention, GatedSlotAttention, RWKV6Attention,
                            RWKV7Attention)

LAYER_TYPES = ("rwkv7", "rwkv6", "gsa", "gla")


def make_mixer(kind: str, d: int, heads: int, idx: int, n_layers: int) -> nn.Module:
    if kind == "rwkv7":
        return RWKV7Attention(hidden_size=d, head_dim=d // heads, layer_idx=idx,
                              num_hidden_layers=n_layers)
    if kind == "rwkv6":
        return RWKV6Attention(hidden_size=d, num_heads=heads, proj_low_rank_dim=16,
                              gate_low_rank_dim=32, layer_idx=idx, num_hidden_layers=n_layers)
    if kind == "gsa":
        return GatedSlotAttention(hidden_size=d, num_heads=heads, num_slots=32, layer_idx=idx)
    if kind == "gla":
        return GatedLinearAttention(hidden_size=d, num_heads=heads, layer_idx=idx)
    raise ValueError(f"unknown layer type {kind!r} (one of {LAYER_TYPES})")


class Block(nn.Module):
    def __init__(self, kind: str, d: int, heads: int, idx: int, n_layers: int) -> None:
        super().__init__()
        self.kind = kind
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.mixer = make_mixer(kind, d, heads, idx, n_layers)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x, cache=None, v_first=None):
        kw = dict(past_key_values=cache, use_cache=cache is not None)
        if self.kind == "rwkv7":
            o, _, _, v_first = self.mixer(self.norm1(x), v_first=v_first, **kw)
        else:
            o, _, _ = self.mixer(self.norm1(x), **kw)
        x = x + o
        a, b = self.up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(a) * b), v_first


class TinyLM(nn.Module):
    def __init__(self, kind: str, vocab: int, d: int = 64, n_layers: int = 2, heads: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(kind, d, heads, i, n_layers) for i in range(n_layers))
        self.norm = nn.RMSNorm(d)

    def forward(self, tokens: torch.Tensor, cache: Cache = None) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab]; with a cache, continues from its states."""
        x, v_first = self.embed(tokens), None
        for block in self.blocks:
            x, v_first = block(x, cache, v_first)
        return self.norm(x) @ self.embed.weight.T


SMALL = {  # a small model of each family, fla's config fields
    "rwkv7": dict(hidden_size=128, num_hidden_layers=2, head_dim=32, decay_low_rank_dim=16,
                  gate_low_rank_dim=32, a_low_rank_dim=16, v_low_rank_dim=16),
    "rwkv6": dict(hidden_size=128, num_hidden_layers=2, num_heads=4, proj_low_rank_dim=16,
                  gate_low_rank_dim=32),
    "gsa": dict(hidden_size=128, num_hidden_layers=2, num_heads=4, num_slots=16),
    "gla": dict(hidden_size=128, num_hidden_layers=2, num_heads=4),
}


def train_lm(family: str, steps: int, device, report=None) -> dict:
    """Trains a small ``fla_ext.models`` causal LM of ``family`` (rwkv7, rwkv6, gsa, gla;
    transformers' conventions) on arithmetic sequences mod the vocabulary (each token follows
    from the two before it), then continues held-out sequences with cached greedy
    ``generate()`` and checks the save_pretrained / AutoModelForCausalLM round trip.
    report(step, loss) after each step."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from fla_ext.models import FAMILIES

    torch.manual_seed(0)
    vocab, half = 64, 24
    config_class, _, lm_class = FAMILIES[family]
    config = config_class(**SMALL[family], vocab_size=vocab, bos_token_id=0, eos_token_id=None)
    model = lm_class(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def batch(n=16):
        start = torch.randint(0, vocab, (n, 1), device=device)
        step = torch.randint(1, 8, (n, 1), device=device)
        return (start + step * torch.arange(2 * half, device=device)) % vocab
    losses = []
    for step in range(steps):
        x = batch()
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if report:
            report(step, losses[-1])
    model.eval()
    full = batch(4)
    prompt = full[:, :half]  # every token real: with no mask, generate() would take token 0 for padding
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=half, do_sample=False,
                         pad_token_id=0)
    correct = (out[:, half:] == full[:, half:]).float().mean().item()
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        again = AutoModelForCausalLM.from_pretrained(d).to(device).eval()
        with torch.no_grad():
            same = torch.equal(again(full).logits, model(full).logits)
    return dict(losses=losses, correct=correct, same=same, name=type(model).__name__,
                params=sum(p.numel() for p in model.parameters()))


def main() -> None:
    import argparse
    p = argparse.ArgumentParser(description="train a small fla_ext.models causal LM, then generate")
    p.add_argument("--family", default="rwkv7", choices=sorted(SMALL))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    def report(step, loss):
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss:.3f}", flush=True)
    r = train_lm(args.family, args.steps, args.device, report)
    print(f"{r['name']}, {r['params']} parameters")
    print(f"greedy continuation (cached generate) correct: {r['correct']:.2f}")
    print(f"save_pretrained / AutoModelForCausalLM.from_pretrained round trip identical: {r['same']}")


if __name__ == "__main__":
    main()
