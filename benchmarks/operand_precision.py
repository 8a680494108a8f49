#!/usr/bin/env python3
"""How precise chunk_rwkv7's tile products must be: a design study on the CPU, no kernel.

    python benchmarks/operand_precision.py [--T 256] [--H 4] [--K 64] [--out FILE]

The chunked RWKV7 algebra of docs/algorithms.md §6 (16-row chunks: exact decays from additive
segment sums, exact pair matrices, X by a float64 triangular solve) runs in float64, except that
every tile product (W = X Â, U = X A_ak V + W S, O = ρ (R̂ S + A_rk V + A_rb U),
S⁺ = γ S + K̂ᵀ V + B̂ᵀ U) rounds its two operands to a format first: `exact` (none), `tf32`
(what the kernels' TF32 products do for bf16 / fp16 inputs), `bf16` (bf16 tensor-core operands,
with fp32 states and accumulators), `fp16s` (fp16 operands scaled by powers of two, one per row
of the left operand and one per column of the right: fp16 has TF32's 10-bit significand and
bf16's tensor-core rate, and the scales, along the dimensions a product does not sum over, come
out of the fp32 result exactly), `fp16t` (the same with one power of two per operand tile: a
chunk's 16 x K rows, a state), or a split (FORMATS): `bf16_state` for bf16 in the products
with the state and TF32 in the chunk-local ones, `bf16_local` the other way round. The backward is autograd of that forward, each
gradient product rounding its operands the same way (a kernel's backward products), so the
difference between formats is what operand rounding alone costs. Inputs are bf16 values (the
oracle gets the same values); o, the final state and every gradient are compared with the float64
recurrent oracle (fla_ext.reference) by docs/algorithms.md §8.2's metric, after rounding the
outputs to bf16 as the op returns them (the final state stays fp32). `exact` checks the chunked
algebra itself (~1e-15). Prints a table and writes the rows as JSON.
"""
import argparse
import json
import os
import sys

import torch

from fla_ext import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "support")]
from inputs import log_decay  # noqa: E402  (the stress regimes of the tests)
from rwkv7_cases import low_rank  # noqa: E402

C = 16
# A format per product: one format for all, or a split: the products with the state (R̂ S, W S,
# K̂ᵀ V, B̂ᵀ U: the state-sized ones, and the backward's through dS) in one and the chunk-local ones
# (X Â, A_ak V, X (A_ak V), A_rk V, A_rb U) in another.
FORMATS = {"exact": ("exact", "exact"), "tf32": ("tf32", "tf32"), "bf16": ("bf16", "bf16"),
           "bf16_state": ("bf16", "tf32"), "bf16_local": ("tf32", "bf16"), "fp16s": ("fp16s", "fp16s"),
           "fp16t": ("fp16t", "fp16t")}
OUTPUTS = ["o", "ht", "dr", "dw", "dk", "dv", "da", "db", "dh0"]


def rounded(x, fmt):
    """x (float64) with the precision of a `fmt` tensor-core operand, as a float64 tensor."""
    if fmt == "exact":
        return x
    if fmt == "bf16":
        return x.to(torch.bfloat16).double()
    # TF32: fp32, then round to nearest on the 10-bit mantissa (ties away; inf / nan unchanged).
    bits = x.float().view(torch.int32)
    finite = torch.isfinite(x.float())
    r = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
    return torch.where(finite, r, x.float()).double()


def fp16_scaled(x, dim):
    """x as fp16 after dividing each slice along `dim` (the summed dimension; both matrix
    dimensions: one scale per tile) by the power of two at or above its largest magnitude, and
    multiplied back (exact): [0.5, 1]-scaled fp16 keeps 10 significand bits down to 2^-14 of the
    slice's largest entry, gradually fewer below."""
    amax = x.abs().amax(dim=dim, keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax))), torch.ones_like(amax))
    return (x / scale).to(torch.float16).double() * scale


def product(a, b, fmt):
    """a @ b on operands of format `fmt`: fp16s scales a's rows and b's columns, fp16t each whole."""
    if fmt == "fp16s":
        return fp16_scaled(a, -1) @ fp16_scaled(b, -2)
    if fmt == "fp16t":
        return fp16_scaled(a, (-2, -1)) @ fp16_scaled(b, (-2, -1))
    return rounded(a, fmt) @ rounded(b, fmt)


class RoundedMatmul(torch.autograd.Function):
    """a @ b with both operands rounded; its backward's two products round theirs too."""

    @staticmethod
    def forward(ctx, a, b, fmt):
        ctx.save_for_backward(a, b)
        ctx.fmt = fmt
        return product(a, b, fmt)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        f = ctx.fmt
        return product(g, b.transpose(-1, -2), f), product(a.transpose(-1, -2), g, f), None


def segment_sums(w, lo, hi):
    """[N, C, C, K]: Σ_{lo(i, j) <= s <= hi(i, j)} w_s for pair (i, j), by masked sums (never a
    difference of prefix sums, so -inf stays exact); 0 for an empty segment."""
    s = torch.arange(C)
    i, j = s[:, None, None], s[None, :, None]
    mask = (s[None, None, :] >= lo(i, j)) & (s[None, None, :] <= hi(i, j))  # [C(i), C(j), C(s)]
    wm = torch.where(mask[None, :, :, :, None], w[:, None, None, :, :], torch.zeros((), dtype=w.dtype))
    return wm.sum(3)


def chunked_rwkv7(r, w, k, v, a, b, h0, scale, fmt):
    """o [N, T, V], final state [N, K, V] of the chunked algebra (inputs [N, T, K|V], T % C == 0)."""
    state_fmt, local_fmt = FORMATS[fmt]
    mm = lambda x, y: RoundedMatmul.apply(x, y, local_fmt)  # noqa: E731
    sm = lambda x, y: RoundedMatmul.apply(x, y, state_fmt)  # noqa: E731
    N, T, K = r.shape
    S = h0
    outs = []
    low = torch.tril(torch.ones(C, C, dtype=torch.bool))
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool), -1)
    for t0 in range(0, T, C):
        rc, wc, kc, vc, ac, bc = (x[:, t0:t0 + C] for x in (r, w, k, v, a, b))
        G = torch.cumsum(wc, 1)                                         # Σ_{s <= i}
        E = torch.cat([torch.zeros_like(wc[:, :1]), G[:, :-1]], 1)      # Σ_{s < i}
        later = torch.cat([wc[:, 1:], torch.zeros_like(wc[:, :1])], 1)
        Om = torch.flip(torch.cumsum(torch.flip(later, [1]), 1), [1])   # Σ_{s > i}
        gam = torch.exp(G[:, -1])                                       # [N, K]
        eG = segment_sums(wc, lambda i, j: j + 1, lambda i, j: i)       # G_i - G_j, j <= i
        eE = segment_sums(wc, lambda i, j: j + 1, lambda i, j: i - 1)   # E_i - G_j, j < i
        fG = torch.where(low[None, :, :, None], torch.exp(eG), torch.zeros((), dtype=r.dtype))
        fE = torch.where(strict[None, :, :, None], torch.exp(eE), torch.zeros((), dtype=r.dtype))
        A_rk = torch.einsum("nic,njc,nijc->nij", rc, kc, fG)
        A_rb = torch.einsum("nic,njc,nijc->nij", rc, bc, fG)
        A_ak = torch.einsum("nic,njc,nijc->nij", ac, kc, fE)
        A_ab = torch.einsum("nic,njc,nijc->nij", ac, bc, fE)
        Rh, Ah = rc * torch.exp(G), ac * torch.exp(E)
        Kh, Bh = kc * torch.exp(Om), bc * torch.exp(Om)
        eye = torch.eye(C, dtype=r.dtype).expand(N, C, C)
        X = torch.linalg.solve_triangular(eye - A_ab, eye, upper=False)
        W = mm(X, Ah)
        U = mm(X, mm(A_ak, vc)) + sm(W, S)
        outs.append(scale * (sm(Rh, S) + mm(A_rk, vc) + mm(A_rb, U)))
        S = gam[:, :, None] * S + sm(Kh.transpose(1, 2), vc) + sm(Bh.transpose(1, 2), U)
    return torch.cat(outs, 1), S


def rel(x, ref, atol=1e-4):
    """§8.2: relative L2 error, and whether the atol escape holds."""
    d = (x - ref).norm() / ref.norm().clamp_min(1e-300)
    return float(d), bool((x - ref).abs().max() <= atol)


def bf(x):
    """x's bf16 value, as float64."""
    return x.to(torch.bfloat16).double()


def case(T, H, K, w_kind, lr, seed):
    """bf16-valued inputs (the tests' regimes: log_decay, low_rank), h0, dO and dHT."""
    g = torch.Generator().manual_seed(seed)
    r, k, v = (bf(torch.randn(H, T, K, generator=g)) for _ in range(3))
    w = bf(log_decay(w_kind, (H, T, K), g))
    a, b = (bf(x) for x in low_rank(lr, torch.randn(H, T, K, generator=g), g))
    h0 = torch.randn(H, K, K, generator=g).double()
    do = bf(torch.randn(H, T, K, generator=g))
    dht = torch.randn(H, K, K, generator=g).double()
    return (r, w, k, v, a, b, h0), do, dht


def run(T, H, K, w_kind, lr, seed=0):
    (r, w, k, v, a, b, h0), do, dht = case(T, H, K, w_kind, lr, seed)
    one = lambda x: x.transpose(0, 1)[None]  # noqa: E731  [H, T, D] -> the oracle's [1, T, H, D]
    o_ref, ht_ref = reference.rwkv7(*(one(x) for x in (r, w, k, v, a, b)), scale=1.0, initial_state=h0[None])
    g_ref = reference.rwkv7_bwd(*(one(x) for x in (r, w, k, v, a, b)), one(do), dht[None], scale=1.0,
                                initial_state=h0[None])
    refs = dict(o=o_ref[0].transpose(0, 1), ht=ht_ref[0], dh0=g_ref["h0"][0],
                **{f"d{n}": g_ref[n][0].transpose(0, 1) for n in "rwkvab"})
    rows = []
    for fmt in FORMATS:
        ins = [x.clone().requires_grad_(True) for x in (r, w, k, v, a, b, h0)]
        o, ht = chunked_rwkv7(*ins[:6], ins[6], 1.0, fmt)
        grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), ins)
        got = dict(o=bf(o.detach()), ht=ht.detach().float().double(), dh0=grads[6].float().double(),
                   **{f"d{n}": bf(x) for n, x in zip("rwkvab", grads[:6])})  # as the op returns them
        for name in OUTPUTS:
            e, escape = rel(got[name], refs[name])
            rows.append(dict(T=T, H=H, K=K, w=w_kind, lr=lr, fmt=fmt, out=name, rel=e, atol_ok=escape))
    return rows


def plot(rows, path):
    """Per output, the largest error over the regimes for each format (log scale), with the bf16
    tolerance (docs/algorithms.md §8.3)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"plot skipped ({type(exc).__name__})"
    fig, ax = plt.subplots(figsize=(11.5, 4))
    width = 0.8 / len(FORMATS)
    for i, fmt in enumerate(FORMATS):
        worst = [max(r["rel"] for r in rows if r["fmt"] == fmt and r["out"] == n) for n in OUTPUTS]
        ax.bar([j + (i - (len(FORMATS) - 1) / 2) * width for j in range(len(OUTPUTS))], worst, width, label=fmt)
    ax.axhline(1e-2, color="k", lw=0.8, ls="--", label="bf16 tolerance (dw: 2e-2)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(OUTPUTS)))
    ax.set_xticklabels(OUTPUTS)
    ax.set_ylabel("largest rel. error over the regimes")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(f"chunk_rwkv7's algebra, tile-product operands rounded (T = {rows[0]['T']}, K = {rows[0]['K']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--H", type=int, default=2)
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--w", nargs="+", default=["rwkv7", "u5", "u30", "mixedinf", "zero"])
    ap.add_argument("--lr", nargs="+", default=["rwkv", "iclr1", "repeated", "generic"])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu_rwkv7_operand_precision.json"))
    args = ap.parse_args()
    assert args.T % C == 0, "T must be a multiple of 16"
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows = []
    print(f"{'w':9s} {'a, b':9s} {'fmt':6s} " + " ".join(f"{n:>8s}" for n in OUTPUTS))
    for w_kind in args.w:
        for lr in args.lr:
            got = run(args.T, args.H, args.K, w_kind, lr)
            rows += got
            for fmt in FORMATS:
                e = {x["out"]: x for x in got if x["fmt"] == fmt}
                cells = [f"{e[n]['rel']:8.1e}" + ("*" if e[n]["atol_ok"] and e[n]["rel"] > 1e-2 else "")
                         for n in OUTPUTS]
                print(f"{w_kind:9s} {lr:9s} {fmt:6s} " + " ".join(cells), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        head = dict(what="chunk_rwkv7's algebra with tile-product operands rounded (CPU, float64)",
                    T=args.T, H=args.H, K=args.K)
        f.write(json.dumps(head)[:-1] + ', "rows": [\n' + ",\n".join(json.dumps(r) for r in rows) + "\n]}\n")
    print(f"{len(rows)} rows -> {args.out}; {plot(rows, os.path.splitext(args.out)[0] + '.png')}")


if __name__ == "__main__":
    main()
