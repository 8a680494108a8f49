"""Every op forward and backward on the GPU, for compute-sanitizer (`make sanitize`).

Run under memcheck with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that every tensor is its own
allocation and a kernel access outside one is reported, not hidden inside the caching
allocator's blocks. The cases cover dense and varlen batches (empty sequences, lengths that are
no multiple of any chunk), both layouts, bf16 and fp32, head dims that take the generic and the
constant-K kernels, initial and final states with their gradients, T = 0, and, with the value
checks off, malformed cu_seqlens that only the kernels' clamping keeps inside the tensors.

    python tests/sanitize.py [--set full|small|valid|malformed] [--ops name,name] [--device cpu]

Exits non-zero if any case fails in an unexpected way; the sanitizer's own exit code (with
--error-exitcode) reports memory errors.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "support"), os.path.dirname(HERE)]  # safety_cases; fla_ext
os.environ.pop("FLA_EXT_CHECKS", None)  # malformed cu_seqlens must reach the kernels

import torch  # noqa: E402

from safety_cases import OPS, final_states, initial_state  # noqa: E402

# cu_seqlens over T = 37 rows that only the kernels' clamping keeps in bounds (checks off).
MALFORMED = [[0, 4, 100], [0, 2 ** 40, 37], [-7, 5, 37], [0, 30, 3, 37], [5, 2, 37],
             [0, -(2 ** 40), 37], [37, 0, 0, 37]]
VALID = [[0, 5, 5, 37], [0, 37], [0, 16, 32, 37]]


def cases(which):
    if which == "valid":  # initcheck: malformed boundaries leave rows of o unwritten by design
        yield from (c for c in cases("full") if c["cu"] not in MALFORMED)
        return
    if which == "malformed":  # the clamping alone (reverting it must make memcheck report)
        for K, V in [(8, 6), (64, 64)]:
            for cu in MALFORMED:
                yield dict(K=K, V=V, dtype=torch.bfloat16, B=1, T=37, cu=cu, head_first=False)
        return
    dims = [(8, 6), (64, 64)] if which == "small" else [(8, 6), (64, 64), (128, 128), (72, 40)]
    dtypes = [torch.bfloat16] if which == "small" else [torch.bfloat16, torch.float32]
    for K, V in dims:
        for dtype in dtypes:
            yield dict(K=K, V=V, dtype=dtype, B=2, T=37, cu=None, head_first=False)
            for cu in VALID[:1] if which == "small" else VALID:
                yield dict(K=K, V=V, dtype=dtype, B=1, T=37, cu=cu, head_first=False)
            if which == "full":
                yield dict(K=K, V=V, dtype=dtype, B=2, T=37, cu=None, head_first=True)
                yield dict(K=K, V=V, dtype=dtype, B=2, T=0, cu=None, head_first=False)
                yield dict(K=K, V=V, dtype=dtype, B=2, T=1, cu=None, head_first=False)
        if which == "full":
            for cu in MALFORMED:
                yield dict(K=K, V=V, dtype=torch.bfloat16, B=1, T=37, cu=cu, head_first=False)


def run_case(op, c, gen, device):
    B, T, H = c["B"], c["T"], 2
    x = op.make(B, T, H, device, gen, c["dtype"], K=c["K"], V=c["V"])
    N = B if c["cu"] is None else len(c["cu"]) - 1
    h0 = initial_state(op, N, H, device, gen, K=c["K"], V=c["V"])
    h0s = h0 if isinstance(h0, tuple) else (h0,)
    if c["head_first"]:
        x = {n: (t.transpose(1, 2) if t.dim() == 4 else t) for n, t in x.items()}
    leaves = list(x.values()) + list(h0s)
    for t in leaves:
        t.requires_grad_(True)
    kw = dict(initial_state=h0, output_final_state=True, head_first=c["head_first"])
    if c["cu"] is not None:
        kw["cu_seqlens"] = torch.tensor(c["cu"], device=device)
    try:
        o, ht = op.call(x, **kw)
    except ValueError as e:  # on the CPU (or GSA's host-side g=None gate) it is checked
        if c["cu"] in MALFORMED and "cu_seqlens" in str(e):
            return "rejected"
        raise
    hts = final_states(op, (o, ht))
    loss = o.float().square().sum() + sum(h.square().sum() for h in hts)
    torch.autograd.grad(loss, leaves, allow_unused=True)
    # inference forward (no workspaces kept) as well
    with torch.no_grad():
        op.call(x, **kw)
    if device == "cuda":
        torch.cuda.synchronize()
    return "ok"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", choices=["full", "small", "valid", "malformed"], default="full")
    ap.add_argument("--ops", default="")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script itself")
    args = ap.parse_args()
    wanted = set(filter(None, args.ops.split(",")))
    gen = torch.Generator().manual_seed(0)
    n = bad = 0
    t0 = time.time()
    for op in OPS:
        if wanted and op.name not in wanted:
            continue
        counts = {}
        for c in cases(args.set):
            n += 1
            try:
                r = run_case(op, c, gen, args.device)
            except Exception as e:  # noqa: BLE001 -- reported, counted, and the run goes on
                bad += 1
                r = "FAILED"
                print(f"FAILED {op.name} {c}: {type(e).__name__}: {str(e).splitlines()[0]}",
                      flush=True)
            counts[r] = counts.get(r, 0) + 1
        print(f"{op.name}: {counts} ({time.time() - t0:.0f} s)", flush=True)
    print(f"sanitize.py: {n} cases, {bad} failed", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
