"""Context parallelism (fla_ext/cp.py) in spawned process groups of world sizes 2, 3 and 4: on the
CPU with gloo (`make test`), or with ``FLA_EXT_DIST_BACKEND=nccl`` on one GPU per rank (launch.py): for every op of every family, each rank's slice of the output
and of every input gradient, the replicated final states, and the summed contributions to the
replicated inputs' gradients (initial states, RWKV6's u) equal the single-process op on the
whole batch (fp32, 1e-5). The batch has sequences cut at and between slice boundaries, an empty
sequence, and one sequence over several ranks; initial and final states on and off."""
import os
import sys
import zlib

import pytest
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "support"))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from launch import device, spawn  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

T = 48  # divisible by 2, 3 and 4
BATCHES = {  # global cu_seqlens
    # a sequence over every rank, cut at the boundaries
    "one": [0, T],
    # cut at and between boundaries, an empty sequence, a sequence spanning ranks
    "mixed": [0, 5, 12, 12, 29, 40, 48],
}


def _inputs(family, H, K, V, gen, h0_on):
    n = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).float()  # noqa: E731
    logd = lambda *s: torch.nn.functional.logsigmoid(n(*s) + 1.5)  # noqa: E731
    x = {}
    if family in ("gla", "rwkv6"):
        x = dict(q=n(1, T, H, K), k=n(1, T, H, K), v=n(1, T, H, V), g=logd(1, T, H, K))
        if family == "rwkv6":
            x["u"] = n(H, K)
        if h0_on:
            x["h0"] = n(0, H, K, V)  # sized later per batch
    elif family == "gla_gv":
        x = dict(q=n(1, T, H, K), k=n(1, T, H, K), v=n(1, T, H, V), gv=logd(1, T, H, V))
    elif family == "rwkv7":
        kk = torch.nn.functional.normalize(n(1, T, H, K), dim=-1)
        x = dict(r=n(1, T, H, K), w=-0.6 * torch.sigmoid(n(1, T, H, K)), k=n(1, T, H, K),
                 v=n(1, T, H, V), a=-kk, b=kk * torch.rand(1, T, H, K, generator=gen))
    elif family == "rwkv7_mul":  # fused_mul_recurrent_rwkv7's (kk, a = iclr) form
        x = dict(r=n(1, T, H, K), w=-0.6 * torch.sigmoid(n(1, T, H, K)), k=n(1, T, H, K),
                 v=n(1, T, H, V), kk=torch.nn.functional.normalize(n(1, T, H, K), dim=-1),
                 a=torch.rand(1, T, H, K, generator=gen))
    elif family == "gsa":
        x = dict(q=n(1, T, H, K), k=n(1, T, H, K), v=n(1, T, H, V), s=n(1, T, H, 6),
                 g=logd(1, T, H, 6))
    elif family == "gsa_abc":  # g = None, grouped query heads (2 per key head)
        x = dict(q=n(1, T, 2 * H, K), k=n(1, T, H, K), v=n(1, T, H, V), s=n(1, T, H, 6))
    return x


OPS = {  # name -> (family, call(fla_ext, x, h0, **kw) -> (o, final))
    "chunk_gla": ("gla", lambda F, x, h0, **kw: F.chunk_gla(x["q"], x["k"], x["v"], x["g"], initial_state=h0, **kw)),
    "chunk_gla_gv": ("gla_gv", lambda F, x, h0, **kw: F.chunk_gla(x["q"], x["k"], x["v"], gv=x["gv"], initial_state=h0, **kw)),
    "fused_recurrent_gla": ("gla", lambda F, x, h0, **kw: F.fused_recurrent_gla(x["q"], x["k"], x["v"], x["g"], initial_state=h0, **kw)),
    "chunk_gla_v_first": ("gla", lambda F, x, h0, **kw: F.chunk_gla(
        x["q"], x["k"], x["v"], x["g"], initial_state=None if h0 is None else h0.transpose(-1, -2),
        state_v_first=True, **kw)),
    "chunk_rwkv6": ("rwkv6", lambda F, x, h0, **kw: F.chunk_rwkv6(x["q"], x["k"], x["v"], x["g"], x["u"], initial_state=h0, **kw)),
    "fused_recurrent_rwkv6": ("rwkv6", lambda F, x, h0, **kw: F.fused_recurrent_rwkv6(x["q"], x["k"], x["v"], x["g"], x["u"], initial_state=h0, **kw)),
    "chunk_rwkv7": ("rwkv7", lambda F, x, h0, **kw: F.chunk_rwkv7(x["r"], x["w"], x["k"], x["v"], x["a"], x["b"], initial_state=h0, **kw)),
    "fused_recurrent_rwkv7": ("rwkv7", lambda F, x, h0, **kw: F.fused_recurrent_rwkv7(x["r"], x["w"], x["k"], x["v"], x["a"], x["b"], initial_state=h0, **kw)),
    "fused_mul_recurrent_rwkv7": ("rwkv7_mul", lambda F, x, h0, **kw: F.fused_mul_recurrent_rwkv7(x["r"], x["w"], x["k"], x["v"], x["kk"], x["a"], initial_state=h0, **kw)),
    "chunk_gsa": ("gsa", lambda F, x, h0, **kw: F.chunk_gsa(x["q"], x["k"], x["v"], x["s"], x["g"], initial_state=h0, **kw)),
    "fused_recurrent_gsa": ("gsa", lambda F, x, h0, **kw: F.fused_recurrent_gsa(x["q"], x["k"], x["v"], x["s"], x["g"], initial_state=h0, **kw)),
    "chunk_gsa_abc": ("gsa_abc", lambda F, x, h0, **kw: F.chunk_gsa(x["q"], x["k"], x["v"], x["s"], None, initial_state=h0, **kw)),
    "fused_recurrent_gsa_abc": ("gsa_abc", lambda F, x, h0, **kw: F.fused_recurrent_gsa(x["q"], x["k"], x["v"], x["s"], initial_state=h0, **kw)),
}
REPLICATED = ("u",)  # inputs every rank holds whole


def _states(family, N, H, K, V, gen):
    n = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).float()  # noqa: E731
    if family.startswith("gsa"):
        return (n(N, H, K, 6), n(N, H, 6, V))
    return n(N, H, K, V)


def _flat(final):
    if final is None:
        return []
    return [f for f in final if f is not None] if isinstance(final, (tuple, list)) else [final]


def _case(F, op, batch, h0_on, fin_on, rank, world):
    family, call = OPS[op]
    H, K, V = 2, 8, 4 if not family.startswith("rwkv7") else 6
    gen = torch.Generator().manual_seed(zlib.crc32(repr((op, batch, h0_on, fin_on)).encode()))  # same on every rank
    cu = BATCHES[batch]
    N = len(cu) - 1
    dev = device(rank)
    x = {k: v.to(dev) for k, v in _inputs(family, H, K, V, gen, False).items()}
    h0 = _states(family, N, H, K, V, gen) if h0_on else None
    h0 = tuple(t.to(dev) for t in h0) if isinstance(h0, tuple) else (h0.to(dev) if h0 is not None else None)
    # reference: one process, the whole batch
    xr = {k: t.clone().requires_grad_(True) for k, t in x.items()}
    h0r = tuple(t.clone().requires_grad_(True) for t in h0) if isinstance(h0, tuple) else \
        (h0.clone().requires_grad_(True) if h0 is not None else None)
    cu_t = torch.tensor(cu, device=dev)
    o, fin = call(F, xr, h0r, output_final_state=fin_on, cu_seqlens=cu_t)
    o_w = torch.randn(o.shape, generator=gen).to(dev)
    fin_w = [torch.randn(f.shape, generator=gen).to(dev) for f in _flat(fin)] if fin_on else []
    loss = (o * o_w).sum() + sum((f * w).sum() for f, w in zip(_flat(fin), fin_w))
    loss.backward()

    # context parallel: this rank's slice
    ctx = F.cp.build_cp_context(cu_t)
    a, b = ctx.here.start, ctx.here.end
    xc = {k: (t.clone() if k in REPLICATED else t[:, a:b].clone()).requires_grad_(True) for k, t in x.items()}
    h0c = tuple(t.clone().requires_grad_(True) for t in h0) if isinstance(h0, tuple) else \
        (h0.clone().requires_grad_(True) if h0 is not None else None)
    oc, finc = call(F, xc, h0c, output_final_state=fin_on, cp_context=ctx)
    lossc = (oc * o_w[:, a:b]).sum()
    if rank == 0:  # the replicated final states enter the global loss once
        lossc = lossc + sum((f * w).sum() for f, w in zip(_flat(finc), fin_w))
    lossc.backward()

    def close(name, got, want):
        err = (got.double() - want.double()).norm() / max(want.double().norm(), 1e-30)
        assert err <= 1e-5 or (got - want).abs().max() <= 1e-6, f"{op} {batch} {name}: rel err {err:.2e}"
    close("o", oc, o[:, a:b].detach())
    for i, (fc, f) in enumerate(zip(_flat(finc), _flat(fin))):
        close(f"final[{i}]", fc, f.detach())
    for k in x:
        g = xc[k].grad
        if k in REPLICATED:
            g = g.clone()
            dist.all_reduce(g)
            close(f"d{k} (summed)", g, xr[k].grad)
        else:
            close(f"d{k}", g, xr[k].grad[:, a:b])
    for i, (hc, hr) in enumerate(zip(_flat(h0c), _flat(h0r))):
        g = hc.grad.clone() if hc.grad is not None else torch.zeros_like(hc)
        dist.all_reduce(g)
        close(f"dh0[{i}] (summed)", g, hr.grad)


def _op_cases(op, rank, world):
    import fla_ext as F
    for batch in BATCHES:
        for h0_on, fin_on in [(True, True), (False, False), (False, True)]:
            _case(F, op, batch, h0_on, fin_on, rank, world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cp_equals_one_process(world):
    spawn(world, _op_cases, list(OPS))


# ------------------------------------------------------------------------------------------------
# Layers: a 2-layer stack of each type (token shift, short convolutions and RWKV-7's v_first read
# across the slice boundaries) trained one step: outputs, input gradients and the summed
# parameter gradients equal one process.

def _stack(kind):
    from fla_ext.layers import GatedLinearAttention, GatedSlotAttention, RWKV6Attention, RWKV7Attention
    torch.manual_seed(7)
    C = 32
    make = {
        "gla": lambda i: GatedLinearAttention(hidden_size=C, num_heads=2, use_short_conv=True,
                                              conv_size=4, layer_idx=i),
        "gsa": lambda i: GatedSlotAttention(hidden_size=C, num_heads=2, num_slots=8,
                                            use_short_conv=True, conv_size=4, layer_idx=i),
        "rwkv6": lambda i: RWKV6Attention(hidden_size=C, num_heads=2, proj_low_rank_dim=8,
                                          gate_low_rank_dim=16, layer_idx=i),
        "rwkv7": lambda i: RWKV7Attention(hidden_size=C, head_dim=16, layer_idx=i, num_hidden_layers=2,
                                          decay_low_rank_dim=8, gate_low_rank_dim=8,
                                          a_low_rank_dim=8, v_low_rank_dim=8),
    }[kind]
    return torch.nn.ModuleList([make(0), make(1)]), C


def _run_stack(layers, x, **kw):
    v_first = None
    for layer in layers:
        if isinstance(layer, __import__("fla_ext").layers.RWKV7Attention):
            o, _, _, v_first = layer(x, v_first=v_first, **kw)
        else:
            o = layer(x, **kw)[0]
        x = x + o
    return x


def _layer_case(kind, batch, rank, world):
    import fla_ext as F
    dev = device(rank)
    layers, C = _stack(kind)
    layers.to(dev)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, batch)).encode()))
    x = torch.randn(1, T, C, generator=gen).to(dev)
    w = torch.randn(1, T, C, generator=gen).to(dev)
    cu = torch.tensor(BATCHES[batch], device=dev)
    xr = x.clone().requires_grad_(True)
    (_run_stack(layers, xr, cu_seqlens=cu) * w).sum().backward()
    ref_out = _run_stack(layers, x, cu_seqlens=cu).detach()
    ref_grads = {n: p.grad.clone() for n, p in layers.named_parameters() if p.grad is not None}
    layers.zero_grad(set_to_none=True)

    ctx = F.cp.build_cp_context(cu)
    a, b = ctx.here.start, ctx.here.end
    xc = x[:, a:b].clone().requires_grad_(True)
    out = _run_stack(layers, xc, cp_context=ctx)
    (out * w[:, a:b]).sum().backward()

    def close(name, got, want):
        err = (got.double() - want.double()).norm() / max(want.double().norm(), 1e-30)
        assert err <= 1e-5 or (got - want).abs().max() <= 1e-6, f"{kind} {batch} {name}: rel err {err:.2e}"
    close("out", out, ref_out[:, a:b])
    close("dx", xc.grad, xr.grad[:, a:b])
    for n, p in layers.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        close(f"d{n} (summed)", g, ref_grads.get(n, torch.zeros_like(p)))


def _layer_cases(kind, rank, world):
    for batch in BATCHES:
        _layer_case(kind, batch, rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_cp_layers_equal_one_process(world):
    spawn(world, _layer_cases, ["gla", "gsa", "rwkv6", "rwkv7"])


# ------------------------------------------------------------------------------------------------
# Data-parallel wrappers over context-parallel layers: DistributedDataParallel and FSDP2
# (fully_shard) around a 2-layer RWKV-7 stack, one step on gloo; their averaged gradients times
# the world size equal one process's.

class _Stack(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, x, **kw):
        return _run_stack(self.layers, x, **kw)


def _wrapped_case(wrapper, rank, world):
    import fla_ext as F
    dev = device(rank)
    layers, C = _stack("rwkv7")
    layers.to(dev)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, T, C, generator=gen).to(dev)
    w = torch.randn(1, T, C, generator=gen).to(dev)
    cu = torch.tensor(BATCHES["mixed"], device=dev)
    (_run_stack(layers, x, cu_seqlens=cu) * w).sum().backward()
    ref = {"layers." + n: p.grad.clone() for n, p in layers.named_parameters()}
    layers.zero_grad(set_to_none=True)
    model = _Stack(layers)
    if wrapper == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rank] if dev.type == "cuda" else None)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
    ctx = F.cp.build_cp_context(cu)
    a, b = ctx.here.start, ctx.here.end
    (model(x[:, a:b], cp_context=ctx) * w[:, a:b]).sum().backward()
    params = model.module.named_parameters() if wrapper == "ddp" else model.named_parameters()
    for n, p in params:
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        want = ref[n]
        err = (g.double() * world - want.double()).norm() / max(want.double().norm(), 1e-30)
        assert err <= 1e-5, f"{wrapper} d{n}: rel err {err:.2e}"


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_cp_under_data_parallel_wrappers(wrapper):
    spawn(2, _wrapped_case, [wrapper])
