#!/usr/bin/env python3
"""A/B of fla_ext settings in one process: each point and mode measured under every setting in
turn, for several rounds, so that the settings share the GPU, its clocks and the allocator's state.

    python benchmarks/env_ab.py chunk_rwkv7 --points 8,16,64,4096,bf16 1,32,64,32768,bf16 \
        --settings "" FLA_EXT_RWKV7_FUSED=1 --modes fwd fwdbwd

A setting is a comma-separated list of environment variables (NAME=value; "" is the defaults),
set only while its calls run: the ops read FLA_EXT_* at every call. Points are B,H,K,T,dtype.
Inputs, modes and timing are grid.py's (medians of many reps; peak extra MiB on CUDA); rows print
as JSON lines and go to --out. benchmarks/NOTES.md's A/B tables of settings (c36-c38: the
pipelined windows, the inference windows, the fused training forward) were measured this way,
with a local copy of this procedure.
"""
import argparse
import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ops  # noqa: E402
import grid  # noqa: E402


def parse_setting(text):
    """'A=1,B=2' -> {'A': '1', 'B': '2'}; '' -> {}."""
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"env_ab: a setting is NAME=value[,NAME=value], got {item!r}")
        out[name] = value
    return out


@contextlib.contextmanager
def environment(setting):
    saved = {k: os.environ.get(k) for k in setting}
    os.environ.update(setting)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("op", choices=sorted(grid.GRIDS))
    p.add_argument("--points", nargs="+", required=True, help="B,H,K,T,dtype each")
    p.add_argument("--settings", nargs="+", default=[""], help='NAME=value[,NAME=value] each; "" the defaults')
    p.add_argument("--modes", nargs="+", choices=grid.MODES, default=["fwd", "fwdbwd"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="few reps (a smoke run)")
    p.add_argument("--out", help="JSON file for the rows")
    args = p.parse_args(argv)
    args.no_fla, args.wind = True, None  # (grid's impl builders: fla_ext alone)
    settings = [parse_setting(s) for s in args.settings]
    device = torch.device(args.device)
    timer = bench_ops.Timer(device, 2 if args.quick else 25, 10 if args.quick else 300,
                            3 if args.quick else 20, 2000)
    rows = []
    for text in args.points:
        B, H, K, T, dt = text.split(",")
        B, H, K, T = int(B), int(H), int(K), int(T)
        dtype = grid.DTYPES[dt]
        for mode in args.modes:
            x, impls = grid.point_inputs(args.op, B, T, H, K, dtype, device, mode, args)
            fn = impls["fla_ext"]
            leaves = [t for t in x.values() if t.requires_grad]
            for rnd in range(args.rounds):
                for text_setting, setting in zip(args.settings, settings):
                    with environment(setting):
                        ms, peak = grid.measure(fn, mode, leaves, timer, device)
                    row = dict(op=args.op, B=B, H=H, K=K, T=T, dtype=dt, mode=mode, setting=text_setting,
                               round=rnd, ms=round(ms, 4), peak_mib=None if peak is None else round(peak, 1))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            del x, impls, fn, leaves
            bench_ops._free(device)
    if args.out:
        meta = dict(torch=torch.__version__, fla_ext=grid.fla_ext.__version__, timing=timer.method,
                    gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
