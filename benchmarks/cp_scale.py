#!/usr/bin/env python3
"""Context parallelism across GPUs: one long sequence (B = 1) fwd+bwd on 1 GPU (the plain op) and
split over W GPUs with NCCL (``cp_context``), for chunk_rwkv7 and chunk_gla.

    python benchmarks/cp_scale.py                         # T = 131072, H = 16, K = V = 64, bf16;
                                                          # worlds 1, 2, 4, 8 up to the GPUs present
    python benchmarks/cp_scale.py --device cpu --quick    # smoke test (gloo)

Each world runs in its own spawned process group, one process per GPU. Per row: the median over
reps of the slowest rank's fwd+bwd (every rep starts at a barrier), the peak memory of the most
loaded GPU (inputs, outputs and gradients included), the largest relative error of any rank's
output, final state or input gradient against the one-GPU op on the whole sequence, the bytes each rank all-gathers and
all-reduces per fwd+bwd, and the longest T that fits: the peak measured at T and T / 2 fitted
by a line in T, solved for the GPU's memory, and the longest of that length and 90%, 80%, ...
of it (rounded down to 4096 W) that runs.
Writes ``<out>/<gpu>x<W>_cp.json`` for the largest W, rows for every W.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fla_ext  # noqa: E402

OPS = ("chunk_rwkv7", "chunk_gla")


def draw(op, rows, H, K, dtype, device, seed):
    """The op's inputs over `rows` rows of one sequence, [1, rows, H, K] in dtype."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n = lambda: torch.randn(1, rows, H, K, device=device, generator=gen)  # noqa: E731
    if op == "chunk_gla":
        xs = [n(), n(), n(), torch.nn.functional.logsigmoid(n() + 3)]
    else:
        kk = torch.nn.functional.normalize(n(), dim=-1)
        xs = [n(), -0.6 * torch.sigmoid(n()), n(), n(), -kk, kk * 0.5]
    return [x.to(dtype) for x in xs]


def slice_inputs(op, T, world, rank, H, K, dtype, device):
    """This rank's slice [1, T / world, H, *] of one sequence's inputs, leaves with gradients."""
    return [x.requires_grad_(True) for x in draw(op, T // world, H, K, dtype, device, 1000 + rank)]


def check(op, T, world, rank, H, K, dtype, device):
    """The largest relative L2 error of this rank's output slice, the final state and its input
    gradients' slices against the one-GPU op on the whole sequence (every rank computes it)."""
    xs = draw(op, T, H, K, dtype, device, 7)
    f = getattr(fla_ext, op)
    full = [x.clone().requires_grad_(True) for x in xs]
    o, ht = f(*full, output_final_state=True, cu_seqlens=torch.tensor([0, T], device=device))
    (o.float().sum() + ht.sum()).backward()
    a, b = rank * T // world, (rank + 1) * T // world
    part = [x[:, a:b].clone().requires_grad_(True) for x in xs]
    ctx = fla_ext.cp.build_cp_context(torch.tensor([0, T], device=device))
    oc, htc = f(*part, output_final_state=True, cp_context=ctx)
    (oc.float().sum() + htc.sum() / world).backward()  # the replicated final state: once in all
    rel = lambda x, y: ((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()  # noqa: E731
    errs = [rel(oc, o[:, a:b]), rel(htc, ht)] + [rel(p.grad, x.grad[:, a:b]) for p, x in zip(part, full)]
    return max(errs)


def step_fn(op, x, ctx, cu):
    f = getattr(fla_ext, op)
    kw = dict(cp_context=ctx) if ctx is not None else dict(cu_seqlens=cu)

    def step():
        o, ht = f(*x, output_final_state=True, **kw)
        (o.float().sum() + ht.sum()).backward()
        for t in x:
            t.grad = None
    return step


class Collectives:
    """Counts the bytes this rank hands to all_gather and all_reduce (fla_ext.cp's collectives)."""
    def __init__(self):
        self.gather = self.reduce = 0
        self._ag, self._ar = dist.all_gather, dist.all_reduce

    def __enter__(self):
        def ag(out, x, *a, **k):
            self.gather += x.numel() * x.element_size()
            return self._ag(out, x, *a, **k)

        def ar(x, *a, **k):
            self.reduce += x.numel() * x.element_size()
            return self._ar(x, *a, **k)
        dist.all_gather, dist.all_reduce = ag, ar
        return self

    def __exit__(self, *exc):
        dist.all_gather, dist.all_reduce = self._ag, self._ar


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, device, world, warmup, reps):
    """Median over reps of the slowest rank's milliseconds."""
    import time
    for _ in range(warmup):
        step()
    sync(device)
    times = []
    for _ in range(reps):
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def peak_of(op, T, world, rank, H, K, dtype, device, cu_make):
    """Peak bytes on this device of one fwd+bwd at total length T (inputs included), or None if it
    ran out of memory on any rank."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    ok = torch.ones(1, device=device)
    try:
        x = slice_inputs(op, T, world, rank, H, K, dtype, device)
        cu = cu_make(T)
        ctx = fla_ext.cp.build_cp_context(cu) if world > 1 else None
        step_fn(op, x, ctx, cu)()
        sync(device)
    except torch.OutOfMemoryError:
        ok.zero_()
    x = None
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        return None
    return (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else 0


def worker(rank, world, port, args, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                                world_size=world, timeout=timedelta(seconds=180),
                                device_id=device if device.type == "cuda" else None)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        H, K, T = args.heads, args.head_dim, args.T
        cu_make = lambda t: torch.tensor([0, t], device=device)  # noqa: E731
        def most(value):  # the largest of the ranks' values
            got = [None] * world
            dist.all_gather_object(got, value)
            return max(got)

        fits = {}
        for op in args.ops:  # timings first: the memory search below may end the group
            x = slice_inputs(op, T, world, rank, H, K, dtype, device)
            cu = cu_make(T)
            ctx = fla_ext.cp.build_cp_context(cu) if world > 1 else None
            step = step_fn(op, x, ctx, cu)
            with Collectives() as c:
                step()
            ms = timed(step, device, world, args.warmup, args.reps)
            x = step = None
            peak = peak_of(op, T, world, rank, H, K, dtype, device, cu_make)
            half = peak_of(op, T // 2, world, rank, H, K, dtype, device, cu_make)
            fits[op] = (peak, half)
            row = dict(op=op, world=world, B=1, T=T, H=H, K=K, V=K, dtype=str(dtype).split(".")[-1],
                       ms=ms, peak_mib=most(peak) / 2**20, gather_bytes_per_rank=c.gather,
                       allreduce_bytes_per_rank=c.reduce)
            if world > 1:
                row["max_rel_err_vs_one_gpu"] = most(check(op, T, world, rank, H, K, dtype, device))
                if row["max_rel_err_vs_one_gpu"] > (1e-2 if dtype != torch.float32 else 1e-5):
                    raise AssertionError(f"{op} at world {world} differs from one GPU: {row}")
            if rank == 0:
                queue.put(row)
                print(json.dumps(row), flush=True)
        for op in args.ops if device.type == "cuda" and args.max_t else ():
            # peak(T) = a T + b from the two readings; the length that fills the GPU (less 1 GiB
            # for the allocator's slack) on every rank, then down from it until one runs
            peak, half = fits[op]
            cap = torch.cuda.get_device_properties(device).total_memory - (1 << 30)
            a = (peak - half) / (T - T // 2)
            unit = 4096 * world
            t_pred = -most(-(int((cap - (peak - a * T)) / a) // unit * unit))
            for frac in (0.95, 0.9, 0.8, 0.7, 0.6, 0.5):
                t_try = int(t_pred * frac) // unit * unit
                got = peak_of(op, t_try, world, rank, H, K, dtype, device, cu_make)
                if got is not None:
                    break
            fit = dict(op=op, world=world, max_T_predicted=t_pred,
                       max_T=t_try if got is not None else None,
                       max_T_peak_mib=None if got is None else most(got) / 2**20)
            if rank == 0:
                queue.put(fit)
                print(json.dumps(fit), flush=True)
        dist.destroy_process_group()
    except Exception:
        queue.put(dict(error=f"world {world} rank {rank}: {traceback.format_exc()}"))
        raise


def plot(doc, path):
    """ms, peak memory per GPU and the longest T against the number of GPUs, one line per op."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for op in sorted({r["op"] for r in doc["rows"]}):
        rows = sorted((r for r in doc["rows"] if r["op"] == op), key=lambda r: r["world"])
        ws = [r["world"] for r in rows]
        axes[0].plot(ws, [r["ms"] for r in rows], "o-", label=op)
        axes[1].plot(ws, [r["peak_mib"] / 1024 for r in rows], "o-", label=op)
        if all(r.get("max_T") for r in rows):
            axes[2].plot(ws, [r["max_T"] / 2**20 for r in rows], "o-", label=op)
    t = doc["rows"][0]
    for ax, title in zip(axes, [f"fwd+bwd ms, T = {t['T']}", "peak GiB per GPU", "longest T (Mi tokens)"]):
        ax.set_title(title)
        ax.set_xlabel("GPUs")
        ax.set_xticks(sorted({r["world"] for r in doc["rows"]}))
        ax.legend()
    fig.suptitle(f"context parallelism, {doc['gpu']}, B = 1, H = {t['H']}, K = V = {t['K']}, {t['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world, args):
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    out = []
    while not queue.empty():
        out.append(queue.get())
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few reps (smoke test)")
    p.add_argument("--worlds", default=None, help="comma-separated world sizes (default 1, 2, 4, 8 "
                   "up to the GPUs present; 1 and 2 on the CPU)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--T", type=int, default=None)
    p.add_argument("--no-max-t", dest="max_t", action="store_false")
    p.add_argument("--replot", metavar="JSON", help="only redraw the plot of a results file")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            print(plot(json.load(f), args.replot[:-len(".json")] + ".png"))
        return 0
    args.ops = args.ops.split(",")
    args.heads, args.head_dim = (2, 16) if args.quick else (16, 64)
    args.T = args.T or (1024 if args.quick else 131072)
    args.warmup, args.reps = (1, 3) if args.quick else (5, 20)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    worlds = ([int(w) for w in args.worlds.split(",")] if args.worlds
              else [w for w in (1, 2, 4, 8) if w <= gpus])
    rows, errors = [], []
    for w in worlds:
        for r in run_world(w, args):
            if "error" in r:
                errors.append(r)
            elif "ms" in r:
                rows.append(r)
            else:  # the longest T of a row above
                next(x for x in rows if (x["op"], x["world"]) == (r["op"], r["world"])).update(r)
    for e in errors:
        print(e["error"], file=sys.stderr)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    tag = gpu.lower().replace("nvidia", "").strip().split()[0] if args.device == "cuda" else "cpu"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{tag}x{max(worlds)}_cp.json")
    doc = dict(gpu=gpu, gpus=max(worlds), torch=torch.__version__,
               timing="median over reps of the slowest rank, wall clock between barriers", rows=rows)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}", plot(doc, path[:-len(".json")] + ".png") if rows else "")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
