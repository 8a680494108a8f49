"""`make demo`: run fla_ext's ops forward and backward and show what they did.

The real demo (training small language models on associative recall) arrives with the layers;
this one exercises fused_recurrent_rwkv6 end to end on the best device present and checks it
against the float64 oracle, including a hard reset (w = -inf) and a variable-length batch; then
the chunked training path (chunk_rwkv6, chunk_gla) against the recurrence on the same inputs, and
fused_recurrent_rwkv7 against its oracle.
"""
import argparse
import time

import torch
import torch.nn.functional as F

import fla_ext
from fla_ext import reference


def rel(a, b):
    return ((a.double().cpu() - b).norm() / b.norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("-B", type=int, default=2)
    ap.add_argument("-T", type=int, default=256)
    ap.add_argument("-H", type=int, default=4)
    ap.add_argument("-K", type=int, default=64)
    ap.add_argument("-V", type=int, default=32)
    args = ap.parse_args()
    dev, dt = torch.device(args.device), getattr(torch, args.dtype)
    B, T, H, K, V = args.B, args.T, args.H, args.K, args.V
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).to(dev, dt)  # noqa: E731
    r, k, v = mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, V)
    w = F.logsigmoid(torch.randn(B, T, H, K, generator=g))
    w[:, T // 2, :, : K // 4] = -float("inf")  # a hard reset on a quarter of the channels
    w = w.to(dev, dt)
    u = mk(H, K)
    h0 = torch.randn(B, H, K, V, generator=g).to(dev)
    leaves = [t.requires_grad_(True) for t in (r, k, v, w, u, h0)]
    print(f"fla_ext {fla_ext.__version__} on {dev} ({args.dtype}); r,k,w [B,T,H,K]=[{B},{T},{H},{K}], "
          f"v [B,T,H,V]=[{B},{T},{H},{V}] (K != V), initial state fp32 [{B},{H},{K},{V}]")

    t0 = time.perf_counter()
    o, ht = fla_ext.fused_recurrent_rwkv6(r, k, v, w, u, initial_state=h0, output_final_state=True)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    ((o * do).sum() + (ht * dht).sum()).backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    print(f"forward + backward: {ms:.1f} ms (first call, includes warm-up)")

    o_ref, ht_ref = reference.rwkv6(r, k, v, w, u, initial_state=h0)
    g_ref = reference.rwkv6_bwd(r, k, v, w, u, do, dht, initial_state=h0)
    print("relative L2 error vs the float64 oracle:")
    print(f"  o {rel(o, o_ref):.2e}   final_state {rel(ht, ht_ref):.2e}")
    print("  " + "   ".join(f"d{n} {rel(x.grad, g_ref[n]):.2e}" for n, x in zip(
        ["r", "k", "v", "w", "u", "h0"], leaves)))
    finite = all(torch.isfinite(x.grad).all() for x in leaves) and torch.isfinite(o).all()
    print(f"  all outputs and gradients finite (with w = -inf entries): {bool(finite)}")

    # Variable length: three sequences packed into one row, each with its own state.
    cu = torch.tensor([0, 17, 17, 100], device=dev)
    x = [t.detach()[:1, :100] for t in (r, k, v, w)]
    o_v, ht_v = fla_ext.fused_recurrent_rwkv6(*x, u.detach(), initial_state=h0.detach()[:1].repeat(3, 1, 1, 1),
                                              output_final_state=True, cu_seqlens=cu)
    alone, _ = fla_ext.fused_recurrent_rwkv6(*(t[:, 17:100] for t in x), u.detach(),
                                             initial_state=h0.detach()[:1])
    print(f"varlen (lengths 17, 0, 83): last sequence equals running it alone: "
          f"{torch.equal(o_v[:, 17:], alone)}; empty sequence keeps its state: "
          f"{torch.equal(ht_v[1], h0.detach()[0])}")

    # The chunked (training) path computes the same map chunk by chunk: outputs and gradients.
    xs = [t.detach().clone().requires_grad_(True) for t in (r, k, v, w, u, h0)]
    o_c, ht_c = fla_ext.chunk_rwkv6(*xs[:5], initial_state=xs[5], output_final_state=True)
    ((o_c * do).sum() + (ht_c * dht).sum()).backward()
    worst = max(rel(a, b.double().cpu()) for a, b in [(o_c, o), (ht_c, ht)] +
                [(x.grad, y.grad) for x, y in zip(xs, leaves)])
    print(f"chunk_rwkv6 vs fused_recurrent_rwkv6 (o, final state, all 6 gradients): worst rel err {worst:.2e}")
    q, kk, vv, gg = (t.detach() for t in (r, k, v, w))
    o_g, _ = fla_ext.chunk_gla(q, kk, vv, gg, initial_state=h0.detach())
    o_gr, _ = reference.gla(q, kk, vv, gg, initial_state=h0.detach())
    print(f"chunk_gla vs the float64 oracle: o rel err {rel(o_g, o_gr):.2e}")

    # RWKV7 (diagonal plus low rank): a = -kk, b = kk * iclr as RWKV-7 layers form them.
    kn = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    a7, b7 = (-kn).to(dev, dt), (kn * torch.rand(B, T, H, K, generator=g)).to(dev, dt)
    w7 = (-0.6 * torch.sigmoid(torch.randn(B, T, H, K, generator=g))).to(dev, dt)
    v7 = mk(B, T, H, K)
    o7, ht7 = fla_ext.fused_recurrent_rwkv7(q, w7, kk, v7, a7, b7, scale=1.0)
    o7r, ht7r = reference.rwkv7(q, w7, kk, v7, a7, b7, scale=1.0)
    print(f"fused_recurrent_rwkv7 vs the float64 oracle: o {rel(o7, o7r):.2e}   final_state {rel(ht7, ht7r):.2e}")


if __name__ == "__main__":
    main()
