#!/usr/bin/env python3
"""Benchmark fla_ext ops (forward, forward+backward) against a bandwidth floor and against fla.

    python benchmarks/bench_ops.py                       # all ops, default shapes, on CUDA
    python benchmarks/bench_ops.py --quick --device cpu  # tiny smoke run of the script itself
    python benchmarks/bench_ops.py --list                # the registered ops and their cases

For every (op, case, mode) it prints a progress line and a correctness line, then a table last,
and writes ``<out>/bench_ops.json`` and ``<out>/bench_ops.png`` (the chart needs matplotlib).

Timing: median of many reps, CUDA events (``triton.testing.do_bench(return_mode='median')`` when
triton is importable, which also flushes L2 before each rep; else an own event loop doing the
same), ``time.perf_counter`` on the CPU. fwd+bwd reps run the forward and
``torch.autograd.backward`` with grads drawn once; input grads are set to None before each rep,
so every rep builds and frees its own graph.

Bytes floor: every input read once and every output written once (fwd); fwd+bwd adds every input
and every output grad read once and every input grad written once. ``floor_ms`` is those bytes
over the device-to-device copy bandwidth measured in the same run (bytes read + written / time).

Adding an op: write a function ``build(case, requires_grad, device) -> Built`` returning the
inputs and one forward callable per implementation, and register it with ``@register(name,
cases)`` where ``cases(quick) -> [Case]``. The harness derives the fwd+bwd callables, the bytes
floor, the peak memory and the correctness check from that alone.
"""
import argparse
import dataclasses
import datetime
import gc
import importlib
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

try:
    import fla_ext
    from fla_ext import reference as fla_ref
except ImportError as exc:  # pragma: no cover - the script is useless without the extension
    sys.exit(f"bench_ops: cannot import fla_ext ({exc}); build it first (`make build` or "
             f"`pip install --no-build-isolation -e .`)")

Tensor = torch.Tensor
Outputs = Sequence[Optional[Tensor]]
MODES = ("fwd", "fwdbwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp64": torch.float64}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


# ------------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    label: str                       # e.g. "decode", "full"
    dims: Dict[str, int]             # e.g. dict(B=8, T=4096, H=16, K=64, V=64)
    dtype: torch.dtype               # activation dtype
    modes: Tuple[str, ...]           # subset of MODES
    opts: Dict[str, Any] = dataclasses.field(default_factory=dict)  # op-specific switches

    @property
    def shape(self) -> str:
        return " ".join(f"{k}{v}" for k, v in self.dims.items())


@dataclasses.dataclass
class Built:
    """What an op's build function returns for one case."""
    inputs: Dict[str, Tensor]        # every tensor the op reads (the bytes floor counts them all);
                                     # with requires_grad, the floating ones are autograd leaves
    impls: Dict[str, Callable[[], Outputs]]  # impl name -> forward call; "fla_ext" first
    output_names: Sequence[str]      # names of the forward's outputs (None outputs are skipped)
    missing: Dict[str, str] = dataclasses.field(default_factory=dict)  # impl -> why it is absent
    # Optional float64 oracle: reference(grad_outputs or None) -> (outputs, {input name: grad}).
    reference: Optional[Callable[[Optional[Outputs]], Tuple[Outputs, Dict[str, Tensor]]]] = None


@dataclasses.dataclass
class OpSpec:
    name: str
    build: Callable[[Case, bool, torch.device], Built]
    cases: Callable[[bool], List[Case]]


OPS: Dict[str, OpSpec] = {}


def register(name: str, cases: Callable[[bool], List[Case]]):
    def deco(build):
        OPS[name] = OpSpec(name, build, cases)
        return build
    return deco


_OPTIONAL: Dict[Tuple[str, str], Tuple[Optional[Callable], str]] = {}
FLA_ENABLED = True


def optional_fn(module: str, attr: str, device: torch.device) -> Tuple[Optional[Callable], str]:
    """``module.attr`` if importable and usable on ``device``, else (None, reason)."""
    if not FLA_ENABLED and module.split(".")[0] == "fla":
        return None, "disabled by --no-fla"
    if module.split(".")[0] == "fla" and device.type != "cuda":
        return None, "fla's Triton kernels need a CUDA device"
    key = (module, attr)
    if key not in _OPTIONAL:
        try:
            _OPTIONAL[key] = (getattr(importlib.import_module(module), attr), "")
        except Exception as exc:  # ImportError, or any error raised while importing
            _OPTIONAL[key] = (None, f"cannot import {module}.{attr}: {type(exc).__name__}: {exc}")
    return _OPTIONAL[key]


def _randn(shape, dtype, device, scale=1.0) -> Tensor:
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype)


def _leaves(inputs: Dict[str, Optional[Tensor]], requires_grad: bool) -> Dict[str, Tensor]:
    out = {}
    for name, x in inputs.items():
        if x is None:
            continue
        if requires_grad and x.is_floating_point():
            x.requires_grad_(True)
        out[name] = x
    return out


# ------------------------------------------------------------------------------------------------
# Ops
# ------------------------------------------------------------------------------------------------

def _rwkv6_cases(quick: bool) -> List[Case]:
    state = dict(initial_state=True, output_final_state=True)
    if quick:
        dec, full = dict(B=3, T=1, H=2, K=16, V=16), dict(B=2, T=33, H=2, K=16, V=32)
    else:
        dec, full = dict(B=64, T=1, H=32, K=64, V=64), dict(B=8, T=4096, H=16, K=64, V=64)
    # fwd+bwd cases carry no state: fla's fused_recurrent_rwkv6 backward ignores d(final state).
    return [
        Case("decode", dec, torch.bfloat16, ("fwd",), state),
        Case("full", full, torch.bfloat16, ("fwd", "fwdbwd")),
        Case("full", full, torch.float32, ("fwd", "fwdbwd")),
    ]


def _chunk_cases(quick: bool) -> List[Case]:
    if quick:
        return [Case("full", dict(B=2, T=130, H=2, K=16, V=32), torch.bfloat16, MODES)]
    full = dict(B=8, T=4096, H=16, K=64, V=64)
    return [
        Case("full", full, torch.bfloat16, MODES),
        Case("full", dict(full, K=128, V=128), torch.bfloat16, MODES),
        Case("full", full, torch.float32, MODES),
    ]


def _rwkv7_op(name: str):
    """RWKV-7's inputs: w in its own range [-e^-0.5, 0], a = -kk, b = kk * iclr, scale 1, for
    fla_ext's and fla's op `name` (fla's fused_recurrent_rwkv7 is inference only: its backward
    raises)."""
    def build(case: Case, requires_grad: bool, device: torch.device) -> Built:
        return _rwkv7(name, case, requires_grad, device)
    return build


def _rwkv7(name: str, case: Case, requires_grad: bool, device: torch.device) -> Built:
    B, T, H, K, V = (case.dims[d] for d in "BTHKV")
    dt = case.dtype
    h0 = (torch.randn(B, H, K, V, device=device, dtype=torch.float32)
          if case.opts.get("initial_state") else None)
    ofs = bool(case.opts.get("output_final_state"))
    kk = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device), dim=-1)
    iclr = torch.rand(B, T, H, K, device=device)
    inputs = _leaves(dict(
        r=_randn((B, T, H, K), dt, device),
        w=(-0.6065 * torch.sigmoid(torch.randn(B, T, H, K, device=device))).to(dt),
        k=_randn((B, T, H, K), dt, device), v=_randn((B, T, H, V), dt, device),
        a=(-kk).to(dt), b=(kk * iclr).to(dt), h0=h0), requires_grad)
    r, w, k, v, a, b = (inputs[n] for n in "rwkvab")
    h0 = inputs.get("h0")
    kw = dict(scale=1.0, initial_state=h0, output_final_state=ofs)

    ours = getattr(fla_ext, name)
    impls = {"fla_ext": lambda: ours(r, w, k, v, a, b, **kw)}
    fla_fn, why = optional_fn("fla.ops.rwkv7", name, device)
    if fla_fn is not None:
        impls["fla"] = lambda: fla_fn(r, w, k, v, a, b, **kw)

    def reference(grad_outputs):
        o, ht = fla_ref.rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=h0)
        grads = {}
        if grad_outputs is not None:
            g = fla_ref.rwkv7_bwd(r, w, k, v, a, b, grad_outputs[0],
                                  dht=grad_outputs[1] if ofs else None, scale=1.0,
                                  initial_state=h0)
            grads = {n: g[n] for n, x in inputs.items() if x.requires_grad}
        return [o, ht if ofs else None], grads

    return Built(inputs, impls, ("o", "ht"), {"fla": why} if why else {}, reference)


register("fused_recurrent_rwkv7", _rwkv6_cases)(_rwkv7_op("fused_recurrent_rwkv7"))
register("chunk_rwkv7", _chunk_cases)(_rwkv7_op("chunk_rwkv7"))


def _diag_op(family: str, mode: str):
    """Build function for {fused_recurrent, chunk}_{rwkv6, gla}: same inputs, same oracle."""
    rwkv = family == "rwkv6"
    reader = "r" if rwkv else "q"

    def build(case: Case, requires_grad: bool, device: torch.device) -> Built:
        B, T, H, K, V = (case.dims[d] for d in "BTHKV")
        dt = case.dtype
        h0 = (torch.randn(B, H, K, V, device=device, dtype=torch.float32)
              if case.opts.get("initial_state") else None)
        ofs = bool(case.opts.get("output_final_state"))
        gate = "w" if rwkv else "g"
        raw = {reader: _randn((B, T, H, K), dt, device), "k": _randn((B, T, H, K), dt, device),
               "v": _randn((B, T, H, V), dt, device),
               gate: torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=device)).to(dt)}
        if rwkv:
            raw["u"] = _randn((H, K), dt, device, 0.5)
        raw["h0"] = h0
        inputs = _leaves(raw, requires_grad)
        args = [inputs[n] for n in (reader, "k", "v")]
        kw = dict(initial_state=inputs.get("h0"), output_final_state=ofs)
        if rwkv:
            args += [inputs["w"], inputs["u"]]
        elif mode == "chunk":
            args.append(inputs["g"])
        else:
            kw["gk"] = inputs["g"]
        name = f"{mode}_{family}"
        ours = getattr(fla_ext, name)
        impls = {"fla_ext": lambda: ours(*args, **kw)}
        fla_fn, why = optional_fn(f"fla.ops.{family}", name, device)
        if fla_fn is not None:
            impls["fla"] = lambda: fla_fn(*args, **kw)

        def reference(grad_outputs):
            ins = [inputs[n] for n in (reader, "k", "v", gate)] + ([inputs["u"]] if rwkv else [])
            fwd, bwd = (fla_ref.rwkv6, fla_ref.rwkv6_bwd) if rwkv else (fla_ref.gla, fla_ref.gla_bwd)
            o, ht = fwd(*ins, initial_state=h0)
            grads = {}
            if grad_outputs is not None:
                gr = bwd(*ins, grad_outputs[0], dht=grad_outputs[1] if ofs else None,
                         initial_state=h0)
                grads = {n: gr[n] for n, x in inputs.items() if x.requires_grad}
            return [o, ht if ofs else None], grads

        return Built(inputs, impls, ("o", "ht"), {"fla": why} if why else {}, reference)

    return build


register("fused_recurrent_rwkv6", _rwkv6_cases)(_diag_op("rwkv6", "fused_recurrent"))
register("fused_recurrent_gla", _rwkv6_cases)(_diag_op("gla", "fused_recurrent"))
register("chunk_rwkv6", _chunk_cases)(_diag_op("rwkv6", "chunk"))
register("chunk_gla", _chunk_cases)(_diag_op("gla", "chunk"))


def _gsa_cases(quick: bool) -> List[Case]:
    if quick:
        return [Case("full", dict(B=2, T=130, H=2, K=16, V=32, M=16), torch.bfloat16, MODES)]
    full = dict(B=8, T=4096, H=16, K=64, V=64, M=64)
    return [Case("full", full, torch.bfloat16, MODES), Case("full", full, torch.float32, MODES)]


@register("chunk_gsa", _gsa_cases)
def _gsa(case: Case, requires_grad: bool, device: torch.device) -> Built:
    """Gated Slot Attention (docs/benchmarking.md §1: M = 64 slots, no initial state), gate logsigmoid."""
    B, T, H, K, V, M = (case.dims[d] for d in "BTHKVM")
    dt = case.dtype
    raw = {"q": _randn((B, T, H, K), dt, device), "k": _randn((B, T, H, K), dt, device),
           "v": _randn((B, T, H, V), dt, device), "s": _randn((B, T, H, M), dt, device),
           "g": torch.nn.functional.logsigmoid(torch.randn(B, T, H, M, device=device)).to(dt)}
    inputs = _leaves(raw, requires_grad)
    args = [inputs[n] for n in "qkvsg"]
    impls = {"fla_ext": lambda: (fla_ext.chunk_gsa(*args)[0],)}
    fla_fn, why = optional_fn("fla.ops.gsa", "chunk_gsa", device)
    if fla_fn is not None:
        impls["fla"] = lambda: (fla_fn(*args)[0],)

    def reference(grad_outputs):
        o, _ = fla_ref.gsa(*args)
        grads = {}
        if grad_outputs is not None:
            grads = {n: x for n, x in fla_ref.gsa_bwd(*args, grad_outputs[0]).items()
                     if n in inputs and inputs[n].requires_grad}
        return [o], grads

    return Built(inputs, impls, ("o",), {"fla": why} if why else {}, reference)


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------

class Timer:
    """Median milliseconds of ``fn`` over many reps (see the module docstring)."""

    def __init__(self, device: torch.device, warmup_ms: float, rep_ms: float, min_reps: int,
                 max_reps: int):
        self.device, self.warmup_ms, self.rep_ms = device, warmup_ms, rep_ms
        self.min_reps, self.max_reps = min_reps, max_reps
        self.do_bench = None
        if device.type == "cuda":
            try:
                from triton.testing import do_bench
                self.do_bench = do_bench
            except Exception:
                pass
        self.method = ("triton.testing.do_bench(median)" if self.do_bench else
                       "cuda events (own loop, median)" if device.type == "cuda" else
                       "time.perf_counter (median)")

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _once_ms(self, fn) -> float:
        if self.device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def __call__(self, fn: Callable[[], Any], grad_to_none: Sequence[Tensor] = ()) -> float:
        fn()
        self._sync()
        est = max(self._once_ms(fn), 1e-3)
        if self.do_bench is not None:
            rep = min(max(self.rep_ms, self.min_reps * est), self.max_reps * est)
            return float(self.do_bench(fn, warmup=max(self.warmup_ms, est), rep=rep,
                                       grad_to_none=list(grad_to_none) or None,
                                       return_mode="median"))
        for _ in range(max(1, int(self.warmup_ms / est))):
            for x in grad_to_none:
                x.grad = None
            fn()
        n = int(min(max(self.min_reps, self.rep_ms / est), self.max_reps))
        times = []
        if self.device.type == "cuda":
            # Like triton: overwrite 256 MiB before each rep so L2 starts cold. Freed on return,
            # so it never shows in a later peak-memory reading.
            flush = torch.empty(64 << 20, dtype=torch.int32, device=self.device)
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n)]
            for s, e in ev:
                for x in grad_to_none:
                    x.grad = None
                flush.zero_()
                s.record()
                fn()
                e.record()
            self._sync()
            times = [s.elapsed_time(e) for s, e in ev]
            del flush
        else:
            for _ in range(n):
                for x in grad_to_none:
                    x.grad = None
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def copy_bandwidth(timer: Timer, device: torch.device, mib: int) -> Tuple[float, float]:
    """(GB/s, ms) of a device-to-device copy of ``mib`` MiB, counting bytes read + written."""
    n = mib << 20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    src = dst = None  # freed before the next case; the lambda is done with them
    _free(device)
    return 2 * n / (ms * 1e-3) / 1e9, ms


# ------------------------------------------------------------------------------------------------
# Harness
# ------------------------------------------------------------------------------------------------

def _free(device: torch.device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, Tensor))


def _as_list(outs) -> List[Optional[Tensor]]:
    if isinstance(outs, Tensor):
        return [outs]
    return [o if isinstance(o, Tensor) else None for o in outs]


def _clear_grads(leaves: Sequence[Tensor]):
    for x in leaves:
        x.grad = None


def _runner(fwd: Callable[[], Outputs], grad_outputs: Optional[List[Optional[Tensor]]]):
    """The timed callable: forward only (no graph), or forward + backward."""
    if grad_outputs is None:
        def run():
            with torch.no_grad():
                fwd()
        return run

    def run():
        outs = _as_list(fwd())
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return run


def _peak_mb(fn, device: torch.device) -> Tuple[Optional[float], Optional[float]]:
    """(peak allocated MB, peak minus allocated-before MB) over one call of ``fn``."""
    if device.type != "cuda":
        return None, None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return peak / 2**20, (peak - base) / 2**20


def _rel_l2(x: Tensor, ref: Tensor) -> float:
    dev = "cpu" if "cpu" in (x.device.type, ref.device.type) else x.device
    x, ref = x.detach().to(dev, torch.float64), ref.detach().to(dev, torch.float64)
    if x.shape != ref.shape:
        return float("nan")
    den = torch.linalg.vector_norm(ref).item()
    num = torch.linalg.vector_norm(x - ref).item()
    return num / den if den > 0 else num


def _capture(built: Built, impl: str, grad_outputs, leaves) -> Dict[str, Tensor]:
    """Outputs (and input grads with grad_outputs) of one call, by name."""
    _clear_grads(leaves)
    with torch.set_grad_enabled(grad_outputs is not None):
        outs = _as_list(built.impls[impl]())
    got = {n: o.detach() for n, o in zip(built.output_names, outs) if o is not None}
    if grad_outputs is not None:
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        for n, x in built.inputs.items():
            if x.requires_grad and x.grad is not None:
                got["d" + n] = x.grad
        _clear_grads(leaves)
    return got


def run_case(op: OpSpec, case: Case, mode: str, timer: Timer, device: torch.device,
             bw_gbps: Optional[float], check_ref: bool) -> Dict[str, Any]:
    torch.manual_seed(0)
    grad = mode == "fwdbwd"
    built = op.build(case, grad, device)
    leaves = [x for x in built.inputs.values() if x.requires_grad]
    row: Dict[str, Any] = dict(op=op.name, case=case.label, shape=case.shape, dims=case.dims,
                               dtype=DTYPE_NAMES.get(case.dtype, str(case.dtype)), mode=mode,
                               opts=case.opts, impls={}, missing=dict(built.missing), check={})

    # Output structure and the fixed random output grads, from one call of the first impl.
    first = next(iter(built.impls))
    with torch.set_grad_enabled(grad):
        outs = _as_list(built.impls[first]())
    grad_outputs = None
    if grad:
        grad_outputs = [torch.randn_like(o) if o is not None and o.requires_grad else None
                        for o in outs]
    nbytes = _nbytes(built.inputs.values()) + _nbytes(outs)
    if grad:
        nbytes += _nbytes(built.inputs.values()) + _nbytes(grad_outputs) + _nbytes(leaves)
    del outs
    _clear_grads(leaves)
    row["bytes"] = nbytes
    row["floor_ms"] = nbytes / (bw_gbps * 1e9) * 1e3 if bw_gbps else None

    for impl, fwd in built.impls.items():
        res: Dict[str, Any] = {}
        try:
            fn = _runner(fwd, grad_outputs)
            fn()  # compile / autotune outside the measurements
            _clear_grads(leaves)
            res["peak_mb"], res["peak_extra_mb"] = _peak_mb(fn, device)
            _clear_grads(leaves)
            res["ms"] = timer(fn, leaves)
            res["gbps"] = nbytes / (res["ms"] * 1e-3) / 1e9
            if row["floor_ms"]:
                res["x_floor"] = res["ms"] / row["floor_ms"]
        except Exception as exc:  # keep going: report the failure in the row
            res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        _clear_grads(leaves)
        _free(device)
        row["impls"][impl] = res

    ext, fla = row["impls"].get("fla_ext", {}), row["impls"].get("fla", {})
    if ext.get("ms") and fla.get("ms"):
        row["speedup"] = fla["ms"] / ext["ms"]

    # Correctness: fla_ext against fla (and against the float64 oracle with --check-ref).
    if "ms" in ext:
        mine = _capture(built, "fla_ext", grad_outputs, leaves)
        refs = {}
        if "ms" in fla:
            try:
                refs["fla"] = _capture(built, "fla", grad_outputs, leaves)
            except Exception as exc:
                row["check"]["fla"] = {"error": f"{type(exc).__name__}: {exc}"}
        if check_ref and built.reference is not None:
            try:
                r_outs, r_grads = built.reference(grad_outputs)
                d = {n: o for n, o in zip(built.output_names, r_outs) if o is not None}
                d.update({"d" + n: g for n, g in r_grads.items()})
                refs["ref"] = d
            except Exception as exc:
                row["check"]["ref"] = {"error": f"{type(exc).__name__}: {exc}"}
        for name, ref in refs.items():
            row["check"][name] = {n: _rel_l2(x, ref[n]) for n, x in mine.items() if n in ref}
        del mine, refs
    del built, leaves, grad_outputs
    _free(device)
    return row


# ------------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------------

def _f(x, spec):
    return "-" if x is None else format(x, spec)


def print_row_progress(row):
    ext, fla = row["impls"].get("fla_ext", {}), row["impls"].get("fla", {})
    parts = [f"[{row['op']}] {row['case']} {row['shape']} {row['dtype']} {row['mode']}:",
             f"fla_ext {_f(ext.get('ms'), '.4f')} ms"]
    if "fla" in row["impls"]:
        parts.append(f"fla {_f(fla.get('ms'), '.4f')} ms")
    if row.get("speedup"):
        parts.append(f"speedup {row['speedup']:.2f}x")
    if ext.get("x_floor"):
        parts.append(f"{ext['x_floor']:.2f}x floor")
    if ext.get("peak_mb") is not None:  # here too: a run cut by its time limit writes no table
        parts.append(f"peak MB {ext['peak_mb']:.0f}" +
                     (f" (fla {fla['peak_mb']:.0f})" if fla.get("peak_mb") is not None else ""))
    print("  ".join(parts), flush=True)
    for impl, res in row["impls"].items():
        if "error" in res:
            print(f"    {impl} FAILED: {res['error']}", flush=True)
    for impl, why in row["missing"].items():
        print(f"    {impl} skipped: {why}", flush=True)
    for name, diffs in row["check"].items():
        if "error" in diffs:
            print(f"    check fla_ext vs {name}: FAILED {diffs['error']}", flush=True)
        else:
            body = ", ".join(f"{n} {v:.2e}" for n, v in diffs.items())
            print(f"    check fla_ext vs {name} (rel L2): {body}", flush=True)


def table(rows) -> str:
    head = ["op", "case", "shape", "dtype", "mode", "fla_ext ms", "fla ms", "speedup",
            "floor ms", "x floor", "GB/s", "peak MB", "fla peak MB"]
    body = []
    for r in rows:
        ext, fla = r["impls"].get("fla_ext", {}), r["impls"].get("fla", {})
        body.append([r["op"], r["case"], r["shape"], r["dtype"], r["mode"],
                     _f(ext.get("ms"), ".4f") if "error" not in ext else "ERR",
                     _f(fla.get("ms"), ".4f") if "error" not in fla else "ERR",
                     _f(r.get("speedup"), ".2f"), _f(r.get("floor_ms"), ".4f"),
                     _f(ext.get("x_floor"), ".2f"), _f(ext.get("gbps"), ".1f"),
                     _f(ext.get("peak_mb"), ".0f"), _f(fla.get("peak_mb"), ".0f")])
    w = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "  ".join(  # noqa: E731
        str(c).ljust(n) if i < 5 else str(c).rjust(n) for i, (c, n) in enumerate(zip(cells, w)))
    return "\n".join([fmt(head), "  ".join("-" * n for n in w)] + [fmt(b) for b in body])


def plot(rows, path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"chart skipped: matplotlib not importable ({type(exc).__name__})"
    rows = [r for r in rows if r["impls"].get("fla_ext", {}).get("ms")]
    if not rows:
        return "chart skipped: no timings"
    labels = [f"{r['op']}\n{r['case']} {r['dtype']} {r['mode']}" for r in rows]
    series = [("fla_ext", [r["impls"]["fla_ext"].get("ms") for r in rows]),
              ("fla", [r["impls"].get("fla", {}).get("ms") for r in rows]),
              ("bytes floor", [r.get("floor_ms") for r in rows])]
    series = [(n, v) for n, v in series if any(x for x in v)]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(6, 1.6 * len(rows) + 2), 8))
    width = 0.8 / len(series)
    for i, (name, vals) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [v or 0 for v in vals], width, label=name)
    ax.set_yscale("log")
    ax.set_ylabel("ms (median, log)")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.legend()
    ax.set_title("time per call")
    ratio = [r["impls"]["fla_ext"].get("x_floor") or 0 for r in rows]
    speed = [r.get("speedup") or 0 for r in rows]
    ax2.bar([j - 0.2 for j in range(len(rows))], speed, 0.4, label="speedup vs fla (fla/fla_ext)")
    ax2.bar([j + 0.2 for j in range(len(rows))], ratio, 0.4, label="fla_ext time / bytes floor")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_yscale("log")
    ax2.set_xticks(range(len(rows)))
    ax2.set_xticklabels(labels, fontsize=7)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _version(mod: str) -> Optional[str]:
    try:
        return getattr(importlib.import_module(mod), "__version__", "?")
    except Exception:
        return None


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (default when available) or cpu")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes and few reps: a smoke test of the script (works on CPU)")
    p.add_argument("--ops", nargs="+", metavar="OP", help="ops to run (default: all registered)")
    p.add_argument("--cases", nargs="+", metavar="LABEL", help="case labels, e.g. decode full")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="activation dtypes")
    p.add_argument("--modes", nargs="+", choices=MODES, help="fwd and/or fwdbwd")
    p.add_argument("--no-fla", action="store_true", help="do not import or time fla")
    p.add_argument("--check-ref", action="store_true",
                   help="also compare with the float64 oracle in fla_ext.reference (slow for "
                        "big shapes; on by default with --quick)")
    p.add_argument("--warmup-ms", type=float, default=None, help="warmup budget (default 25)")
    p.add_argument("--rep-ms", type=float, default=None, help="timed budget per case (default 200)")
    p.add_argument("--min-reps", type=int, default=None,
                   help="at least this many reps (default 25)")
    p.add_argument("--max-reps", type=int, default=20000, help="at most this many reps")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="size of the bandwidth-probe copy (default 1024 MiB; 64 with --quick)")
    p.add_argument("--out", default="bench_out", help="output dir for bench_ops.json/.png")
    p.add_argument("--list", action="store_true", help="list ops and cases, then exit")
    a = p.parse_args(argv)
    q = a.quick
    a.warmup_ms = a.warmup_ms if a.warmup_ms is not None else (2 if q else 25)
    a.rep_ms = a.rep_ms if a.rep_ms is not None else (10 if q else 200)
    a.min_reps = a.min_reps if a.min_reps is not None else (3 if q else 25)
    a.copy_mib = a.copy_mib if a.copy_mib is not None else (64 if q else 1024)
    a.check_ref = a.check_ref or q
    return a


def selected(args) -> List[Tuple[OpSpec, Case, str]]:
    names = args.ops or list(OPS)
    unknown = [n for n in names if n not in OPS]
    if unknown:
        sys.exit(f"bench_ops: unknown op(s) {unknown}; registered: {list(OPS)}")
    todo = []
    for n in names:
        for case in OPS[n].cases(args.quick):
            if args.cases and case.label not in args.cases:
                continue
            if args.dtypes and case.dtype not in [DTYPES[d] for d in args.dtypes]:
                continue
            for mode in case.modes:
                if not args.modes or mode in args.modes:
                    todo.append((OPS[n], case, mode))
    return todo


def main(argv=None) -> int:
    global FLA_ENABLED
    args = parse_args(argv)
    FLA_ENABLED = not args.no_fla
    todo = selected(args)
    if args.list:
        for op, case, mode in todo:
            print(f"{op.name}  {case.label}  {case.shape}  {DTYPE_NAMES[case.dtype]}  {mode}  "
                  f"{case.opts or ''}")
        return 0
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench_ops: no CUDA device; use --device cpu (with --quick)")
        torch.cuda.set_device(torch.device(device).index or 0)
    for var in ("FLA_EXT_POISON", "FLA_EXT_CHECKS"):
        if os.environ.get(var, "0") not in ("", "0"):
            print(f"warning: {var}={os.environ[var]} is set; timings include its extra work")

    timer = Timer(device, args.warmup_ms, args.rep_ms, args.min_reps, args.max_reps)
    dev_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else platform.processor() or "cpu")
    print(f"device: {dev_name}   torch {torch.__version__}   fla_ext {fla_ext.__version__}   "
          f"timing: {timer.method}")
    bw, bw_ms = copy_bandwidth(timer, device, args.copy_mib)
    print(f"copy bandwidth: {bw:.1f} GB/s ({args.copy_mib} MiB copy, {bw_ms:.3f} ms, "
          f"read + write)")

    rows = []
    for op, case, mode in todo:
        try:
            row = run_case(op, case, mode, timer, device, bw, args.check_ref)
        except Exception as exc:  # e.g. building the inputs failed: report it, go on
            row = dict(op=op.name, case=case.label, shape=case.shape, dims=case.dims,
                       dtype=DTYPE_NAMES.get(case.dtype, str(case.dtype)), mode=mode,
                       opts=case.opts, missing={}, check={},
                       impls={"fla_ext": {"error": f"{type(exc).__name__}: {exc}"}})
            _free(device)
        print_row_progress(row)
        rows.append(row)

    fla_version = None
    if FLA_ENABLED and device.type == "cuda" and any("fla" in r["impls"] for r in rows):
        fla_version = _version("fla")
    meta = dict(
        time=datetime.datetime.now().isoformat(timespec="seconds"), device=dev_name,
        device_type=device.type, python=platform.python_version(), torch=torch.__version__,
        cuda=torch.version.cuda, triton=_version("triton"), fla=fla_version,
        fla_ext=fla_ext.__version__, timing=timer.method, copy_gbps=bw, copy_mib=args.copy_mib,
        args={k: v for k, v in vars(args).items()},
        env={v: os.environ.get(v) for v in ("FLA_EXT_POISON", "FLA_EXT_CHECKS")})
    os.makedirs(args.out, exist_ok=True)
    jpath = os.path.join(args.out, "bench_ops.json")
    with open(jpath, "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=1, default=str)
    ppath = os.path.join(args.out, "bench_ops.png")
    msg = plot(rows, ppath)
    print(f"wrote {jpath}" + (f"; {msg}" if msg else f" and {ppath}"))
    print()
    print(table(rows))
    # Exit 1 only when fla_ext itself failed somewhere; fla failures are reported, not fatal.
    return 1 if any("error" in r["impls"].get("fla_ext", {}) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
