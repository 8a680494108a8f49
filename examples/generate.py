"""Build a small model from fla_ext's layers, then generate: one forward over the prompt that
fills the state cache, then one token at a time from the cache (greedy). Checks that the cached
decoding gives the logits a full forward over prompt + generated tokens gives.

    python examples/generate.py --layer rwkv7 --new-tokens 32
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lm import LAYER_TYPES, TinyLM  # noqa: E402

from fla_ext.layers import Cache  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layer", default="rwkv7", choices=LAYER_TYPES)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = TinyLM(args.layer, args.vocab, d=64, n_layers=2).to(device).eval()
    with torch.no_grad():  # a random model: draw the output projections that init leaves at 0
        for p in model.parameters():
            if p.dim() == 2 and p.abs().max() == 0:
                p.normal_(0, 0.05)
    prompt = torch.randint(0, args.vocab, (1, args.prompt_len), device=device)
    cache = Cache()
    with torch.no_grad():
        logits = model(prompt, cache=cache)
        tokens, steps = prompt, []
        for _ in range(args.new_tokens):
            nxt = logits[:, -1:].argmax(-1)
            tokens = torch.cat([tokens, nxt], 1)
            logits = model(nxt, cache=cache)
            steps.append(logits)
        full = model(tokens)[:, args.prompt_len:]
    err = (torch.cat(steps, 1) - full).abs().max().item()
    print(f"{args.layer}: prompt of {args.prompt_len} tokens, generated "
          f"{tokens[0, args.prompt_len:].tolist()}")
    print(f"cached decoding vs full forward over the same tokens: max |logit difference| {err:.2e}")
    if err > 1e-3:
        sys.exit("cached decoding disagrees with the full forward")


if __name__ == "__main__":
    main()
