#!/usr/bin/env python3
"""Time an op over the grid of model shapes of its issue, with its peers in the same run.

    python benchmarks/grid.py chunk_rwkv7 --wind /path/to/wind_rwkv   # fla_ext, fla, wind_rwkv
    python benchmarks/grid.py chunk_rwkv7 --k 128 --no-fla            # a part of the grid
    python benchmarks/grid.py chunk_rwkv7 --quick --device cpu         # smoke test of the script
    python benchmarks/grid.py chunk_gla                                 # also chunk_rwkv6, chunk_gsa

Writes rows ``{op, impl, gpu, B, T, H, K, V, dtype, mode, ms, peak_mib, run}`` into
``<out>/<gpu>_<op>_grid.json`` (row by row, replacing rows of another run with the same key, so parts
of the grid can run as separate processes: wind_rwkv compiles one head size per process, for
over two minutes) and a plot
next to it. ``run`` names the process that measured the row (its UTC start, the checkout's commit
where git can tell, ``-dirty`` when the tracked files differ from it, and ``src:`` the digest of
the sources built, which ``--source-digest`` prints for a checkout): compare rows only within one
run. ``--resume`` skips the points and
modes whose every impl already has a row, so that a grid cut short by a time limit (fla autotunes
for minutes per new shape) goes on where it stopped; each point and mode still measures all of its
impls in one run. Modes: ``fwd`` (a training forward: inputs require grad), ``fwdbwd`` (forward and
backward, every input gradient), ``fwd_nograd`` (inference, under ``torch.no_grad``).
``peak_mib``: the most memory allocated during one call beyond what was allocated before it
(inputs and incoming gradients are not counted). Timing: bench_ops.Timer (median of many reps,
L2 flushed before each). Every op runs with an initial state in and the final state out (and
their gradients). RWKV7: w = -e^-0.5 sigmoid(x) (RWKV-7's range), a = -kk, b = kk * iclr. GLA,
RWKV6: log decays logsigmoid(x) over K; RWKV6's u [H, K]. GSA: M = 64 slots, g = logsigmoid(x).

``--autotune-cache DIR`` keeps fla's Triton autotuning results (its ``*.autotune.json`` files, a
few KB each; nothing else is kept) between runs, all in one file ``DIR/<gpu>.autotune.json``
(their paths in Triton's cache and their contents): carried to a fresh GPU machine and back (one
small flat file, where a folder of Triton's hashed subfolders may not travel), a later run of the
same shapes skips fla's minutes of autotuning and times the configuration that autotuning picked
on that GPU model (fla caches its results the same way on a user's machine). The run's Triton
cache is a temporary folder, filled from that file first and emptied into it at the end (also
when a time limit's SIGTERM ends the run).

Peers: fla (``fla.ops.<family>.chunk_<family>``, when importable) and, for RWKV7, wind_rwkv's
chunked CUDA kernel (``--wind``: the root of a wind_rwkv checkout, compiled here for the points'
head size; bf16, K = V, T a multiple of 16; its log decay is log(-w), its states bf16).
"""
import argparse
import gc
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ops  # noqa: E402  (Timer, _peak_mb, _free, _version)
import fla_ext  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("fwd", "fwdbwd", "fwd_nograd")

# (B, H, K, T, dtype) of each issue's grid; K = V.
GRIDS = {
    "chunk_rwkv7": [(8, 16, 64, 4096, "bf16"), (8, 32, 64, 4096, "bf16"), (8, 64, 64, 4096, "bf16"),
                    (16, 64, 64, 4096, "bf16"), (1, 32, 64, 32768, "bf16"),
                    (8, 8, 128, 4096, "bf16"), (8, 16, 128, 4096, "bf16"), (8, 32, 128, 4096, "bf16"),
                    (8, 16, 64, 4096, "fp32")],
}
for _op in ("chunk_gla", "chunk_rwkv6", "chunk_gsa"):  # the diagonal family's issue
    GRIDS[_op] = [(8, 16, 64, 4096, "bf16"), (8, 32, 64, 4096, "bf16"), (8, 64, 64, 4096, "bf16"),
                  (8, 8, 128, 4096, "bf16"), (8, 16, 128, 4096, "bf16"), (4, 8, 256, 4096, "bf16"),
                  (1, 32, 64, 32768, "bf16")]
GSA_SLOTS = 64
QUICK = [(1, 2, 16, 64, "fp32")]


def rwkv7_inputs(B, T, H, K, dtype, device, requires_grad):
    g = lambda *s: torch.randn(*s, device=device)
    kk = torch.nn.functional.normalize(g(B, T, H, K), dim=-1)
    x = dict(r=g(B, T, H, K).to(dtype), w=(-0.6065 * torch.sigmoid(g(B, T, H, K))).to(dtype),
             k=g(B, T, H, K).to(dtype), v=g(B, T, H, K).to(dtype), a=(-kk).to(dtype),
             b=(kk * torch.rand(B, T, H, K, device=device)).to(dtype), h0=g(B, H, K, K))
    for t in x.values():
        t.requires_grad_(requires_grad)
    return x


def diag_inputs(op, B, T, H, K, dtype, device, requires_grad):
    """chunk_gla / chunk_rwkv6 / chunk_gsa inputs with K = V (GSA: M = GSA_SLOTS)."""
    g = lambda *s: torch.randn(*s, device=device)  # noqa: E731
    logd = lambda *s: torch.nn.functional.logsigmoid(g(*s))  # noqa: E731
    if op == "chunk_gsa":
        M = GSA_SLOTS
        x = dict(q=g(B, T, H, K).to(dtype), k=g(B, T, H, K).to(dtype), v=g(B, T, H, K).to(dtype),
                 s=g(B, T, H, M).to(dtype), g=logd(B, T, H, M).to(dtype), hk0=g(B, H, K, M),
                 hv0=g(B, H, M, K))
    else:
        x = dict(q=g(B, T, H, K).to(dtype), k=g(B, T, H, K).to(dtype), v=g(B, T, H, K).to(dtype),
                 g=logd(B, T, H, K).to(dtype), h0=g(B, H, K, K))
        if op == "chunk_rwkv6":
            x["u"] = g(H, K).to(dtype)
    for t in x.values():
        t.requires_grad_(requires_grad)
    return x


def diag_impls(op, x, args) -> Dict[str, object]:
    """impl -> forward call returning (o, final states...), or a reason string when absent."""
    def call(f):
        if op == "chunk_gsa":
            return lambda: (lambda o, st: (o, *st))(*f(x["q"], x["k"], x["v"], x["s"], x["g"],
                                                        initial_state=(x["hk0"], x["hv0"]),
                                                        output_final_state=True))
        if op == "chunk_rwkv6":
            return lambda: f(x["q"], x["k"], x["v"], x["g"], x["u"], initial_state=x["h0"],
                             output_final_state=True)
        return lambda: f(x["q"], x["k"], x["v"], x["g"], initial_state=x["h0"], output_final_state=True)
    impls: Dict[str, object] = {"fla_ext": call(getattr(fla_ext, op))}
    if not args.no_fla:
        try:
            import importlib
            impls["fla"] = call(getattr(importlib.import_module(f"fla.ops.{op[len('chunk_'):]}"), op))
        except Exception as exc:
            impls["fla"] = f"not importable: {type(exc).__name__}"
    return impls


def wind_module(root: str, head_size: int):
    """wind_rwkv's chunked CUDA op, compiled for `head_size` (one per process)."""
    if root not in sys.path:  # called per point and mode
        sys.path.insert(0, root)
    from wind_rwkv.rwkv7.chunked_cuda import chunked_cuda as wc
    wc.load_chunked_cuda(head_size)
    return wc


def rwkv7_impls(x, args, K, dtype) -> Dict[str, Optional[Callable]]:
    """impl -> forward call returning (o, final state), or a reason string when absent."""
    r, w, k, v, a, b, h0 = (x[n] for n in ("r", "w", "k", "v", "a", "b", "h0"))
    impls: Dict[str, object] = {
        "fla_ext": lambda: fla_ext.chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=h0,
                                               output_final_state=True)}
    if not args.no_fla:
        try:
            from fla.ops.rwkv7 import chunk_rwkv7 as fla_op
            impls["fla"] = lambda: fla_op(r, w, k, v, a, b, scale=1.0, initial_state=h0,
                                          output_final_state=True)
        except Exception as exc:
            impls["fla"] = f"not importable: {type(exc).__name__}"
    if args.wind:
        if dtype != torch.bfloat16 or r.shape[1] % 16 or args.device != "cuda":
            impls["wind_rwkv"] = "bf16, T % 16 == 0, CUDA only"
        else:
            wc = wind_module(args.wind, K)
            # wind's decay is exp(-exp(w')): w' = log(-w); its state is bf16 and the op's input
            ww = torch.log(-w.detach().float()).to(dtype).requires_grad_(w.requires_grad)
            s0 = h0.detach().to(dtype).requires_grad_(h0.requires_grad)
            x["w_wind"], x["s0_wind"] = ww, s0
            impls["wind_rwkv"] = lambda: wc.attn_chunked_cuda(r, ww, k, v, a, b, s0)
    return impls


def measure(fn, mode, leaves, timer, device):
    """(ms, peak_mib) of one mode of a forward call `fn` returning (o, final states...)."""
    if mode == "fwd_nograd":
        def call():
            with torch.no_grad():
                fn()
    elif mode == "fwd":
        call = fn
    else:
        with torch.no_grad():
            seeds = [torch.randn_like(t) for t in fn()]

        def call():
            torch.autograd.backward(list(fn()), seeds)
    ms = timer(call, grad_to_none=leaves if mode == "fwdbwd" else ())
    for t in leaves:
        t.grad = None
    _, extra = bench_ops._peak_mb(call, device)
    for t in leaves:
        t.grad = None
    return ms, extra


# A row's identity in a results file: a run replaces the rows of the same key (merge).
KEY = ("op", "impl", "gpu", "B", "T", "H", "K", "V", "dtype", "mode")


def impl_names(op, args):
    """The impls a point of this run measures (a row each, whether timed or reported missing)."""
    return ["fla_ext"] + ([] if args.no_fla else ["fla"]) + (["wind_rwkv"] if op == "chunk_rwkv7" and args.wind else [])


def measured(rows, op, gpu, point, mode, impls) -> bool:
    """Whether `rows` hold every impl's row of this point and mode (timed, or missing by reason),
    by the rows' KEY as merge matches them."""
    B, H, K, T, dt = point
    have = {tuple(r[k] for k in KEY) for r in rows if r.get("ms") is not None or r.get("missing")}
    return all((op, impl, gpu, B, T, H, K, K, dt, mode) in have for impl in impls)


def point_inputs(op, B, T, H, K, dtype, device, mode, args):
    """(inputs by name, impls by name) of one point and mode (fresh inputs, seeded)."""
    torch.manual_seed(0)
    if op == "chunk_rwkv7":
        x = rwkv7_inputs(B, T, H, K, dtype, device, mode != "fwd_nograd")
        return x, rwkv7_impls(x, args, K, dtype)
    x = diag_inputs(op, B, T, H, K, dtype, device, mode != "fwd_nograd")
    return x, diag_impls(op, x, args)


def run_point(op, point, args, timer, device, gpu, emit, done=lambda mode: False) -> None:
    B, H, K, T, dt = point
    dtype = DTYPES[dt]
    for mode in args.modes:
        if done(mode):
            print(f"{op} B{B} T{T} H{H} K{K} {dt} {mode:10s} measured already (--resume)", flush=True)
            continue
        x, impls = point_inputs(op, B, T, H, K, dtype, device, mode, args)
        for impl, fn in impls.items():
            row = dict(op=op, impl=impl, gpu=gpu, B=B, T=T, H=H, K=K, V=K, dtype=dt, mode=mode,
                       ms=None, peak_mib=None, run=args.run)
            if op == "chunk_gsa":
                row["M"] = GSA_SLOTS
            if isinstance(fn, str):
                row["missing"] = fn
            else:
                leaves = [t for n, t in x.items() if t.requires_grad and
                          (n not in ("w", "h0") or impl != "wind_rwkv") and
                          (not n.endswith("_wind") or impl == "wind_rwkv")]
                try:
                    row["ms"], row["peak_mib"] = measure(fn, mode, leaves, timer, device)
                except Exception as exc:  # e.g. out of memory: reported, the run goes on
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            peak = "" if row["peak_mib"] is None else f"  {row['peak_mib']:9.1f} MiB"
            print(f"{op} B{B} T{T} H{H} K{K} {dt} {mode:10s} {impl:9s} "
                  + (f"{row['ms']:9.3f} ms{peak}" if row["ms"] is not None
                     else row.get("missing") or row.get("error")), flush=True)
            emit(row)
        del x, impls
        gc.collect()
        bench_ops._free(device)


def load_rows(path):
    if not os.path.exists(path):
        return {}, []
    with open(path) as f:
        data = json.load(f)
    return data.get("meta", {}), data.get("rows", [])


def merge(path, rows, meta):
    """rows into the file at path, replacing its rows of the same key; the file's meta keys that
    this run does not set (a note on its runs) are kept."""
    old_meta, old = load_rows(path)
    keys = {tuple(r[k] for k in KEY) for r in rows}
    merged = [r for r in old if tuple(r[k] for k in KEY) not in keys] + rows
    with open(path, "w") as f:
        json.dump(dict(meta={**old_meta, **meta}, rows=merged), f, indent=1)
    return merged


# What decides the code a run measures: the extension's sources, the Python package, the build
# script (not what a build writes: the machine's torch and CUDA versions are in the row's meta).
SOURCE_ROOTS = ("csrc", "fla_ext")
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp", ".py")
BUILD_OUTPUTS = ("fla_ext/_build_info.py",)


def source_digest(root: str = ROOT) -> str:
    """A digest of the sources that make the measured code (SOURCE_ROOTS' files with
    SOURCE_SUFFIXES, and setup.py), by relative path and content. A GPU machine may run a working
    tree whose git metadata lags it (HEAD then names an older commit): the digest names the code
    itself, and `grid.py --source-digest` on a checkout says whether it is the one measured."""
    files = [os.path.join(root, "setup.py")]
    for top in SOURCE_ROOTS:
        for d, subdirs, names in os.walk(os.path.join(root, top)):
            subdirs[:] = sorted(x for x in subdirs if x != "__pycache__")
            files += [os.path.join(d, n) for n in names if n.endswith(SOURCE_SUFFIXES)]
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: os.path.relpath(f, root)):
        rel = os.path.relpath(f, root).replace(os.sep, "/")
        if os.path.isfile(f) and rel not in BUILD_OUTPUTS:
            h.update(rel.encode() + b"\0")
            with open(f, "rb") as fh:
                h.update(fh.read() + b"\0")
    return h.hexdigest()[:12]


def run_id() -> str:
    """This process's run: its UTC start, the checkout's commit where git can tell (-dirty when
    the tracked files differ from it) and the sources' digest (source_digest)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                                text=True, cwd=ROOT, timeout=10).stdout.strip()
    except Exception:
        commit = ""
    return " ".join(x for x in (stamp, commit, f"src:{source_digest()}") if x)


def plot(rows, path) -> Optional[str]:
    """Per mode, time per grid point for each impl (log scale)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"plot skipped ({type(exc).__name__})"
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    impls = sorted({r["impl"] for r in rows}, key=lambda s: (s != "fla_ext", s))
    fig, axes = plt.subplots(len(modes), 1, figsize=(12, 3.6 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        pts = sorted({(r["B"], r["T"], r["H"], r["K"], r["dtype"]) for r in rows if r["mode"] == mode},
                     key=lambda p: (p[4], p[3], p[0] * p[2] * p[1]))
        width = 0.8 / max(1, len(impls))
        for i, impl in enumerate(impls):
            ms = {(r["B"], r["T"], r["H"], r["K"], r["dtype"]): r["ms"] for r in rows
                  if r["mode"] == mode and r["impl"] == impl}
            ax.bar([j + (i - (len(impls) - 1) / 2) * width for j in range(len(pts))],
                   [ms.get(p) or 0 for p in pts], width, label=impl)
        ax.set_yscale("log")
        ax.set_ylabel(f"{mode}: ms")
        ax.set_xticks(range(len(pts)))
        ax.set_xticklabels([f"B{b} H{h} K{k}\nT{t} {d}" for b, t, h, k, d in pts], fontsize=7)
        ax.legend(fontsize=8)
    fig.suptitle(f"{rows[0]['op']} on {rows[0]['gpu']} (median ms, lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def load_autotune_results(path: str) -> Dict[str, str]:
    """The autotuning results kept in ``path`` ({path in Triton's cache: contents}), or none."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def restore_autotune_results(results: Dict[str, str], root: str) -> None:
    """Write ``results`` into the Triton cache folder ``root``."""
    for rel, text in results.items():
        dst = os.path.join(root, rel)
        if os.path.commonpath([os.path.abspath(dst), os.path.abspath(root)]) != os.path.abspath(root):
            continue  # (a path out of the cache: not ours)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "w") as f:
            f.write(text)


def save_autotune_results(root: str, path: str, results: Dict[str, str]) -> int:
    """Add Triton's autotuning results (``*.autotune.json``) below ``root`` to ``results`` and
    write them all to ``path``; returns how many it holds."""
    for here, _, files in os.walk(root):
        for name in files:
            if name.endswith(".autotune.json"):
                with open(os.path.join(here, name)) as f:
                    results[os.path.relpath(os.path.join(here, name), root)] = f.read()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    return len(results)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("op", nargs="?", choices=sorted(GRIDS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--k", type=int, nargs="+", help="only the points with these head sizes")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="only the points of these dtypes")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--wind", help="root of a wind_rwkv checkout (its chunked CUDA kernel)")
    p.add_argument("--quick", action="store_true", help="one tiny point, few reps")
    p.add_argument("--replot", metavar="JSON", help="only redraw the plot of a results file")
    p.add_argument("--autotune-cache", metavar="DIR",
                   help="keep fla's Triton autotuning results in DIR/<gpu>.autotune.json between runs (see above)")
    p.add_argument("--resume", action="store_true",
                   help="skip the points and modes whose every impl has a row in the results file")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--source-digest", action="store_true",
                   help="print this checkout's source digest (the `src:` of a row's run) and stop")
    args = p.parse_args(argv)
    if args.source_digest:
        print(source_digest())
        return
    if args.replot:
        with open(args.replot) as f:
            print(plot(json.load(f)["rows"], args.replot[:-5] + ".png") or "plotted")
        return
    if not args.op:
        p.error("the op is required")
    device = torch.device(args.device)
    points = QUICK if args.quick else [pt for pt in GRIDS[args.op] if (not args.k or pt[2] in args.k)
                                       and (not args.dtypes or pt[4] in args.dtypes)]
    timer = bench_ops.Timer(device, 2 if args.quick else 25, 10 if args.quick else 300,
                            3 if args.quick else 20, 2000)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tag = gpu.lower().replace("nvidia", "").strip().split()[0] if device.type == "cuda" else "cpu"
    if args.autotune_cache:  # before fla is imported: Triton reads the variable when it compiles
        tuned_path = os.path.join(args.autotune_cache, f"{tag}.autotune.json")
        tuned = load_autotune_results(tuned_path)
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="grid_triton_")
        restore_autotune_results(tuned, os.environ["TRITON_CACHE_DIR"])
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: the results still kept
    meta = dict(torch=torch.__version__, fla=bench_ops._version("fla"), fla_ext=fla_ext.__version__,
                timing=timer.method, gpu=gpu)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{tag}_{args.op}_grid.json")
    args.run = run_id()
    def emit(row):  # merged row by row: a run cut short keeps what it measured
        merge(path, [row], meta)
    try:
        for pt in points:
            done = (lambda mode, pt=pt: measured(load_rows(path)[1], args.op, gpu, pt, mode,
                                                 impl_names(args.op, args)) if args.resume else False)
            run_point(args.op, pt, args, timer, device, gpu, emit, done)
    finally:  # also when a time limit ends the run (SIGTERM, above)
        if args.autotune_cache:
            cache = os.environ["TRITON_CACHE_DIR"]
            print(f"kept {save_autotune_results(cache, tuned_path, tuned)} autotuning results in {tuned_path}",
                  flush=True)
            shutil.rmtree(cache, ignore_errors=True)
    with open(path) as f:
        msg = plot(json.load(f)["rows"], path[:-5] + ".png")
    print(f"wrote {path}" + (f" ({msg})" if msg else " and its plot"))


if __name__ == "__main__":
    main()
