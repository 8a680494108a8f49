"""`make demo`: train small language models built from fla_ext's layers on multi-query
associative recall (MQAR) and report what they learned.

Each sequence lists `num_kv` key-value pairs, then asks for the values of keys drawn from them:
the model must store the pairs in its recurrent state and read them back. Chance accuracy is
1 / (number of values). For every layer type the demo prints the parameter count, training
tokens/s, the final loss, the recall accuracy on fresh sequences, and whether decoding token by
token with the state cache reproduces the full-sequence predictions; it writes a PNG of the loss
curves. Then it trains small RWKV7ForCausalLM and GLAForCausalLM models through fla_ext.models
(transformers' model classes: loss from labels, cached generate(), save / AutoModelForCausalLM
load) and plots their losses. Runs on the best device present (a few minutes on a laptop CPU with the defaults).

    python examples/demo.py                      # all four layer types, defaults
    python examples/demo.py --layers rwkv7 --steps 600 --seq-len 128 --num-kv 16 --n-keys 64
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lm import LAYER_TYPES, TinyLM  # noqa: E402

from fla_ext.layers import Cache  # noqa: E402


def mqar_batch(batch: int, seq_len: int, num_kv: int, n_keys: int, n_values: int,
               gen: torch.Generator):
    """Tokens [B, T] and targets [B, T] (-100 where nothing is asked). Keys are tokens
    0..n_keys-1, values n_keys..n_keys+n_values-1; after the 2*num_kv pair tokens come the
    queries, each a key of the context whose value is the target at that position."""
    if 2 * num_kv + num_kv > seq_len:
        raise ValueError("seq_len must hold the pairs and one query per pair")
    keys = torch.stack([torch.randperm(n_keys, generator=gen)[:num_kv] for _ in range(batch)])
    vals = torch.randint(n_keys, n_keys + n_values, (batch, num_kv), generator=gen)
    ctx = torch.stack([keys, vals], -1).flatten(1)                       # k0 v0 k1 v1 ...
    n_q = seq_len - 2 * num_kv
    pick = torch.randint(0, num_kv, (batch, n_q), generator=gen)
    q_keys, q_vals = keys.gather(1, pick), vals.gather(1, pick)
    tokens = torch.cat([ctx, q_keys], 1)
    targets = torch.full_like(tokens, -100)
    targets[:, 2 * num_kv:] = q_vals
    return tokens, targets


def accuracy(logits, targets):
    m = targets != -100
    return (logits.argmax(-1)[m] == targets[m]).float().mean().item()


def train_one(kind, args, device, bar):
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = args.n_keys + args.n_values
    model = TinyLM(kind, vocab, args.d_model, args.n_layers, args.heads).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    losses, tokens_seen, t_train = [], 0, 0.0
    for step in range(args.steps):
        tokens, targets = (t.to(device) for t in mqar_batch(args.batch, args.seq_len, args.num_kv,
                                                            args.n_keys, args.n_values, gen))
        t0 = time.perf_counter()
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_train += time.perf_counter() - t0
        tokens_seen += tokens.numel()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"{kind}: non-finite loss at step {step}")
        bar(kind, step, losses[-1])

    model.eval()
    with torch.no_grad():
        tokens, targets = (t.to(device) for t in mqar_batch(256, args.seq_len, args.num_kv,
                                                            args.n_keys, args.n_values, gen))
        acc = accuracy(model(tokens), targets)
        # Decoding with the state cache: a prompt of the pairs, then one token at a time.
        few = tokens[:8]
        full = model(few)
        cache, split = Cache(), 2 * args.num_kv
        pieces = [model(few[:, :split], cache=cache)]
        for t in range(split, args.seq_len):
            pieces.append(model(few[:, t:t + 1], cache=cache))
        step_logits = torch.cat(pieces, 1)
        same = (step_logits.argmax(-1) == full.argmax(-1)).float().mean().item()
        diff = (step_logits - full).abs().max().item()
    return dict(kind=kind, params=n_params, tok_s=tokens_seen / t_train, loss=losses[-1],
                acc=acc, chance=1 / args.n_values, same=same, diff=diff, losses=losses)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", nargs="+", default=list(LAYER_TYPES), choices=LAYER_TYPES)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--num-kv", type=int, default=4)
    ap.add_argument("--n-keys", type=int, default=16)
    ap.add_argument("--n-values", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="demo_out", help="folder for the loss-curve PNGs")
    ap.add_argument("--lm-steps", type=int, default=60,
                    help="steps of each language-model phase (0: skip them)")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"MQAR: {args.num_kv} key-value pairs, sequences of {args.seq_len} tokens, "
          f"{args.n_keys} keys, {args.n_values} values (chance {1 / args.n_values:.1%}); "
          f"{args.n_layers} layers of width {args.d_model}, {args.steps} steps of {args.batch} "
          f"on {device}")
    try:
        from tqdm import tqdm
        pbar = tqdm(total=args.steps * len(args.layers), ncols=90)

        def bar(kind, step, loss):
            pbar.set_description(f"{kind:6s} loss {loss:.3f}")
            pbar.update(1)
    except ImportError:
        pbar = None

        def bar(kind, step, loss):
            if step % 50 == 0 or step == args.steps - 1:
                print(f"  {kind:6s} step {step:5d}  loss {loss:.3f}", flush=True)
    results = [train_one(kind, args, device, bar) for kind in args.layers]
    if pbar is not None:
        pbar.close()

    print(f"\n{'layer':7s} {'params':>8s} {'tokens/s':>10s} {'loss':>7s} {'recall':>7s} "
          f"{'decode==full':>13s} {'max |dlogit|':>12s}")
    for r in results:
        print(f"{r['kind']:7s} {r['params']:8d} {r['tok_s']:10.0f} {r['loss']:7.3f} "
              f"{r['acc']:7.1%} {r['same']:13.1%} {r['diff']:12.2e}")
    print(f"(chance recall {1 / args.n_values:.1%}; decode==full: share of positions where "
          f"token-by-token decoding with the cache predicts what the full forward does)")
    plot_losses({f"{r['kind']} (recall {r['acc']:.0%})": r["losses"] for r in results},
                "MQAR training loss", os.path.join(args.out, "mqar_loss.png"))
    bad = [r["kind"] for r in results if r["same"] < 1.0 or r["diff"] > 1e-3]
    if bad:
        sys.exit(f"decoding with the cache disagrees with the full forward for {bad}")
    if args.lm_steps:
        language_model(args, device)


def language_model(args, device):
    """Small causal LMs of two families (fla_ext.models, transformers' conventions) trained through
    the model classes: loss, cached generate(), the save / Auto load round trip, a loss plot."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("\n(transformers not installed: `pip install fla_ext[models]` for the model classes)")
        return
    from lm import train_lm
    curves = {}
    for family in ("rwkv7", "gla"):
        print(f"\nLanguage model ({family}), {args.lm_steps} steps on arithmetic sequences")
        try:
            from tqdm import tqdm
            pbar = tqdm(total=args.lm_steps, ncols=90)

            def report(step, loss):
                pbar.set_description(f"{family} LM loss {loss:.3f}")
                pbar.update(1)
        except ImportError:
            pbar = None

            def report(step, loss):
                if step % 20 == 0 or step == args.lm_steps - 1:
                    print(f"  step {step:4d}  loss {loss:.3f}", flush=True)
        r = train_lm(family, args.lm_steps, device, report)
        if pbar is not None:
            pbar.close()
        curves[r["name"]] = r["losses"]
        print(f"{r['name']} ({r['params']} parameters): loss {r['losses'][0]:.3f} -> "
              f"{r['losses'][-1]:.3f}; cached greedy generate continues {r['correct']:.0%} of held-out "
              f"tokens correctly; save_pretrained / AutoModelForCausalLM round trip identical: {r['same']}")
    plot_losses(curves, "training loss through fla_ext.models", os.path.join(args.out, "lm_loss.png"))


def plot_losses(curves, title, path):
    """One loss curve per label (log scale) to ``path``, where matplotlib is installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no loss plot)")
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        ax.plot(losses, label=label)
    ax.set_xlabel("step"), ax.set_ylabel("loss"), ax.set_yscale("log"), ax.legend()
    ax.set_title(title)
    fig.tight_layout(), fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
