#!/usr/bin/env python3
"""One training step of an RWKV-7 language model, fla_ext's RWKV7ForCausalLM against fla's of the
same config in the same run: tokens per second and peak memory.

    python benchmarks/model_step.py                     # ~170M (hidden 768, 12 layers, vocab
                                                        # 50304), bf16, B = 2, T = 4096, CUDA
    python benchmarks/model_step.py --device cpu --quick

fla_ext runs twice: as is, and under ``fla_ext.keep_workspaces(False)`` (the chunk ops' backward
makes their workspaces again: less memory, slower). A step is forward with labels (the models'
own loss: cross-entropy with L2Wrap), backward and AdamW; parameters in bf16. Median of the
timed steps after warm-up steps (fla autotunes its kernels in the first ones). Writes ``<out>/<gpu>_rwkv7_lm_step.json``.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(impl, cfg):
    if impl == "fla_ext":
        from fla_ext.models import RWKV7Config, RWKV7ForCausalLM
    else:
        from fla.models import RWKV7Config, RWKV7ForCausalLM
    return RWKV7ForCausalLM(RWKV7Config(**cfg))


def measure(impl, cfg, args, device, dtype):
    if impl == "fla_ext (keep_workspaces=False)":
        import fla_ext
        with fla_ext.keep_workspaces(False):
            row = measure("fla_ext", cfg, args, device, dtype)
        return dict(row, impl=impl)
    torch.manual_seed(0)
    model = build(impl, cfg).to(device=device, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq), device=device)

    def step():
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses = []
    for i in range(args.warmup):  # fla autotunes here: say how long each step took
        t0 = time.perf_counter()
        losses.append(step().item())
        sync()
        print(f"{impl}: warm-up step {i + 1} of {args.warmup}: {time.perf_counter() - t0:.1f} s", flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        losses.append(step().item())
        sync()
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    model = opt = None  # free them before the next model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(impl=impl, params=params, B=args.batch, T=args.seq, dtype=str(dtype).split(".")[-1],
                ms_per_step=ms, tokens_per_s=args.batch * args.seq / ms * 1e3, peak_mib=peak,
                first_loss=losses[0], last_loss=losses[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="a tiny model (smoke test)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-fla", dest="fla", action="store_false")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.quick:
        cfg = dict(hidden_size=64, num_hidden_layers=2, head_dim=16, vocab_size=128, decay_low_rank_dim=8,
                   gate_low_rank_dim=8, a_low_rank_dim=8, v_low_rank_dim=8)
        args.batch, args.seq = args.batch or 2, args.seq or 64
        args.warmup, args.steps = 1, 2
    else:
        cfg = dict(hidden_size=768, num_hidden_layers=12, head_dim=64, vocab_size=50304)
        args.batch, args.seq = args.batch or 2, args.seq or 4096
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    impls = ["fla_ext", "fla_ext (keep_workspaces=False)"]
    if args.fla:
        try:
            import fla.models  # noqa: F401
            impls.append("fla")
        except Exception as e:  # noqa: BLE001
            print(f"fla not importable ({type(e).__name__}: {e}); fla_ext only")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tag = gpu.lower().replace("nvidia", "").strip().split()[0] if device.type == "cuda" else "cpu"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{tag}_rwkv7_lm_step.json")
    rows = []
    for impl in impls:  # the file is rewritten after each, so a cut-off run keeps what it has
        row = measure(impl, cfg, args, device, dtype)
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(path, "w") as f:
            json.dump(dict(gpu=gpu, torch=torch.__version__, config=cfg, rows=rows), f, indent=1)
    print(f"wrote {path}")

if __name__ == "__main__":
    main()
