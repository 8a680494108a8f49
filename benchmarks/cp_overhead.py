#!/usr/bin/env python3
"""The cost of context parallelism's machinery on one device: each op fwd+bwd with
``cp_context`` at world size 1 (a one-rank gloo / NCCL group) against the plain op, and the bytes
one call all-gathers per rank at a given world size.

    python benchmarks/cp_overhead.py                      # CUDA (NCCL), B = 1, T = 32768, H = 16
    python benchmarks/cp_overhead.py --device cpu --quick  # smoke test

Writes ``<out>/<gpu>x1_cp_overhead.json`` rows {op, T, H, K, V, dtype, ms_plain, ms_cp,
gather_bytes_per_rank}. At world size 1 no sequence is cut, so the difference is the context's
bookkeeping, the all-gather and the all-reduce of the final states (the rerun of a cut sequence's
rows, and for RWKV7 the transition run, come on top with several ranks: benchmarks/NOTES.md).
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ops  # noqa: E402  (Timer)
import fla_ext  # noqa: E402


def inputs(op, T, H, K, V, dtype, device):
    g = lambda *s: torch.randn(*s, device=device).to(dtype).requires_grad_(True)  # noqa: E731
    logd = lambda *s: torch.nn.functional.logsigmoid(torch.randn(*s, device=device) + 2).to(dtype).requires_grad_(True)  # noqa: E731,E501
    if op == "chunk_gla":
        x = [g(1, T, H, K), g(1, T, H, K), g(1, T, H, V), logd(1, T, H, K)]
        return x, lambda **kw: fla_ext.chunk_gla(*x, output_final_state=True, **kw)
    kk = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=device), dim=-1)
    x = [g(1, T, H, K), (-0.6 * torch.sigmoid(torch.randn(1, T, H, K, device=device))).to(dtype).requires_grad_(True),
         g(1, T, H, K), g(1, T, H, V), (-kk).to(dtype).requires_grad_(True),
         (kk * 0.5).to(dtype).requires_grad_(True)]
    return x, lambda **kw: fla_ext.chunk_rwkv7(*x, output_final_state=True, **kw)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--world", type=int, default=8, help="world size for the gathered-bytes column")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    T, H, K = (256, 2, 16) if args.quick else (32768, 16, 64)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    timer = bench_ops.Timer(device, 2 if args.quick else 25, 10 if args.quick else 300, 3 if args.quick else 20, 2000)
    cu = torch.tensor([0, T], device=device)
    ctx = fla_ext.cp.build_cp_context(cu)
    rows = []
    for op in ("chunk_gla", "chunk_rwkv7"):
        x, call = inputs(op, T, H, K, K, dtype, device)

        def step(**kw):
            o, ht = call(**kw)
            (o.float().sum() + ht.sum()).backward()
        plain = timer(lambda: step(cu_seqlens=cu), grad_to_none=x)
        cp = timer(lambda: step(cp_context=ctx), grad_to_none=x)
        m = H * (K + K) if op == "chunk_gla" else H * K * K
        gather = args.world * (H * K * K + m) * 4
        rows.append(dict(op=op, T=T, H=H, K=K, V=K, dtype=str(dtype).split(".")[-1], ms_plain=plain,
                         ms_cp=cp, world_for_bytes=args.world, gather_bytes_per_rank=gather))
        print(f"{op}: plain {plain:.3f} ms, cp (world 1) {cp:.3f} ms ({cp / plain - 1:+.1%}); all-gather at "
              f"world {args.world}: {gather / 1024:.1f} KiB per call and rank", flush=True)
    dist.destroy_process_group()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tag = gpu.lower().replace("nvidia", "").strip().split()[0] if device.type == "cuda" else "cpu"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{tag}x1_cp_overhead.json")
    with open(path, "w") as f:
        json.dump(dict(gpu=gpu, torch=torch.__version__, timing=timer.method, rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
