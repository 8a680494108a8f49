#!/usr/bin/env python3
"""Per-kernel GPU time of one op call (forward, or forward + backward), from torch.profiler.

    python benchmarks/kernel_times.py chunk_rwkv6 --K 64 --dtype bf16 [--bwd] [--impl fla]

Prints each CUDA kernel's mean time per call (ms), largest first, and the total: where the time of
an op goes, as the "measure" step of benchmarks/NOTES.md; then the call's peak extra memory (MiB
allocated during one call beyond what was allocated before it, as grid.py's peak_mib). Shapes
default to the benchmark shape (B=8, T=4096, H=16). `--varlen` packs the B sequences into one row
with cu_seqlens (the variable-length path; equal lengths T). `--impl fla` profiles fla's op of the
same name on the same inputs (fla installed), to see where a peer spends its time.
"""
import argparse
import collections
import os
import sys

import torch
import torch.nn.functional as F

import fla_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ops  # noqa: E402  (_peak_mb: the same peak as grid.py's peak_mib)


def fla_op(op):
    import importlib
    if op == "chunk_gla_gv":
        raise SystemExit("kernel_times: fla's chunk_gla has no value-side decay")
    return getattr(importlib.import_module(f"fla.ops.{op.split('_', 1)[1]}"), op)


def inputs(op, B, T, H, K, V, dtype, kw):
    """The op's inputs and a call of it; kw: keyword arguments of every call (cu_seqlens)."""
    dev = "cuda"
    r = lambda *s: torch.randn(*s, device=dev, dtype=dtype)
    logd = lambda *s: F.logsigmoid(torch.randn(*s, device=dev) + 2).to(dtype)
    if op == "chunk_rwkv6":
        args = (r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), logd(B, T, H, K), r(H, K))
        return args, lambda *a: fla_ext.chunk_rwkv6(*a, **kw)[0]
    if op == "chunk_gla":
        args = (r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), logd(B, T, H, K))
        return args, lambda *a: fla_ext.chunk_gla(*a, **kw)[0]
    if op == "chunk_gla_gv":  # the value-side decay alone (GSA pass 1)
        args = (r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), logd(B, T, H, V))
        return args, lambda q, k, v, gv: fla_ext.chunk_gla(q, k, v, gv=gv, **kw)[0]
    if op == "chunk_gsa":  # M = V slots, the gate logsigmoid (bench_ops' chunk_gsa)
        g = F.logsigmoid(torch.randn(B, T, H, V, device=dev)).to(dtype)
        args = (r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, T, H, V), g)
        return args, lambda *a: fla_ext.chunk_gsa(*a, **kw)[0]
    if op == "chunk_rwkv7":  # the RWKV-7 layer's inputs: a = -kk, b = kk * iclr
        kk = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1)
        iclr = torch.sigmoid(torch.randn(B, T, H, K, device=dev))
        w = -0.6065306597126334 * torch.sigmoid(torch.randn(B, T, H, K, device=dev))
        args = (r(B, T, H, K), w.to(dtype), r(B, T, H, K), r(B, T, H, V), (-kk).to(dtype),
                (kk * iclr).to(dtype))
        return args, lambda *a: fla_ext.chunk_rwkv7(*a, **kw)[0]
    raise SystemExit(f"kernel_times: unknown op {op}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("op")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--V", type=int, default=None)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--train", action="store_true", help="forward only, inputs requiring grad")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--impl", default="fla_ext", choices=["fla_ext", "fla"])
    ap.add_argument("--varlen", action="store_true", help="the B sequences in one row, with cu_seqlens")
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    kw = {}
    if a.varlen:
        kw["cu_seqlens"] = torch.arange(0, a.B * a.T + 1, a.T, device="cuda")
    rows, T = (1, a.B * a.T) if a.varlen else (a.B, a.T)
    args, fn = inputs(a.op, rows, T, a.H, a.K, a.V or a.K, dtype, kw)
    if a.impl == "fla":
        peer = fla_op(a.op)
        fn = lambda *x: peer(*x, **kw)[0]
    args = [x.requires_grad_(a.bwd or a.train) for x in args]
    do = None

    def call():
        o = fn(*args)
        if a.bwd:
            nonlocal do
            do = torch.randn_like(o) if do is None else do
            torch.autograd.grad(o, args, do)  # no .grad accumulation kernels in the profile

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(a.reps):
            call()
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] += e.device_time / 1e3 / a.reps
    total = sum(times.values())
    print(f"{a.impl} {a.op} B{a.B} T{a.T}{' varlen' if a.varlen else ''} H{a.H} K{a.K} V{a.V or a.K} {a.dtype} {'fwd+bwd' if a.bwd else 'training fwd' if a.train else 'fwd'}:"
          f" {total:.3f} ms of kernels per call")
    for name, t in sorted(times.items(), key=lambda x: -x[1]):
        print(f"  {t:8.3f}  {name[:110]}")
    _, extra = bench_ops._peak_mb(call, torch.device("cuda"))
    print(f"peak extra memory of one call: {extra:.1f} MiB")


if __name__ == "__main__":
    main()
