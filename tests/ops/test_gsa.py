"""fla::chunk_gsa and fla::fused_recurrent_gsa (docs/algorithms.md §7): forward, both final states
and every gradient (q, k, v, s, g, hk0, hv0) vs the float64 oracle; grouped heads, both layouts,
varlen, fla's g=None gate, the §8.4 stress suite with GSA's strong slot gates, chunk ==
recurrent, on CPU and CUDA."""
import math

import pytest
import torch

import fla_ext
from conftest import DEVICES, TOL, assert_close
from families import leaves
from fla_ext import reference
from inputs import STRESS, layout, log_decay

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
DEVICE_DTYPES = [pytest.param(d.values[0], dt, id=f"{d.id}-{dt_id}", marks=d.marks)
                 for d in DEVICES for dt, dt_id in [(F32, "fp32"), (BF16, "bf16")]]
MODES = {"chunk": fla_ext.chunk_gsa, "fused": fla_ext.fused_recurrent_gsa}
NAMES = ("q", "k", "v", "s", "g")


def make(B, T, HQ, H, K, V, M, dtype, device, gen, *, head_first=False, noncontig=False,
         h0=True, g_kind="typical", qk_scale=1.0, N=None):
    def act(D, heads, x=None):
        x = torch.randn(B, T, heads, D, generator=gen) if x is None else x
        return layout(x, dtype, device, head_first=head_first, noncontig=noncontig)
    x = dict(q=act(K, HQ, qk_scale * torch.randn(B, T, HQ, K, generator=gen)),
             k=act(K, H, qk_scale * torch.randn(B, T, H, K, generator=gen)), v=act(V, H),
             s=act(M, H), g=None if g_kind is None else act(M, H, log_decay(g_kind, (B, T, H, M), gen)))
    N = B if N is None else N
    acc = F64 if dtype == F64 else F32
    x["hk0"] = torch.randn(N, H, K, M, generator=gen).to(device, acc) if h0 else None
    x["hv0"] = torch.randn(N, H, M, V, generator=gen).to(device, acc) if h0 else None
    return x


def call(mode, x, **kw):
    init = (x["hk0"], x["hv0"]) if x["hk0"] is not None else None
    o, (hk, hv) = MODES[mode](*(x[n] for n in NAMES), initial_state=init, **kw)
    return o, hk, hv


def fla_gate(s, cu, head_first):
    """fla's g=None gate in float64: z = logcumsumexp(s) per sequence, s' = exp(s - z),
    g_t = z_{t-1} - z_t (0 at each sequence start)."""
    td = 2 if head_first else 1
    T = s.shape[td]
    bounds = cu.tolist() if cu is not None else [0, T]
    sk, g = torch.empty_like(s), torch.empty_like(s)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        x = s.narrow(td, a, b - a)
        z = torch.logcumsumexp(x, td)
        prev = torch.cat([torch.full_like(z.narrow(td, 0, 1), -math.inf), z.narrow(td, 0, b - a - 1)], td)
        sk.narrow(td, a, b - a).copy_(torch.exp(x - z))
        g.narrow(td, a, b - a).copy_(torch.where(torch.isinf(prev), torch.zeros_like(z), prev - z))
    return sk, g


def oracle(x, do, dhk, dhv, *, scale=None, cu_seqlens=None, head_first=False, reverse=False):
    """The float64 oracle (reference.gsa / gsa_bwd) with grouped heads expanded, fla's gate for
    g=None, and the gradients folded back: (o, hk, hv), {name: grad}."""
    hd = 1 if head_first else 2
    HQ, H = x["q"].shape[hd], x["k"].shape[hd]
    G = HQ // H
    f64 = {n: None if t is None else t.detach().double().cpu() for n, t in x.items()}
    s64 = f64["s"].clone().requires_grad_(True)
    sk, g = fla_gate(s64, cu_seqlens, head_first) if f64["g"] is None else (s64, f64["g"])
    rep = lambda t, d: t if t is None or G == 1 else t.repeat_interleave(G, d)  # noqa: E731
    k, v, s_, g_ = (rep(t, hd) for t in (f64["k"], f64["v"], sk.detach(), g.detach()))
    init = None if f64["hk0"] is None else (rep(f64["hk0"], 1), rep(f64["hv0"], 1))
    kw = dict(scale=scale, cu_seqlens=None if cu_seqlens is None else cu_seqlens.cpu(),
              head_first=head_first, reverse=reverse)
    o, (hk, hv) = reference.gsa(f64["q"], k, v, s_, g_, initial_state=init, **kw)

    def spread(d):  # the returned state is group member 0's
        if d is None or G == 1:
            return None if d is None else d.double().cpu()
        out = torch.zeros(d.shape[0], d.shape[1] * G, *d.shape[2:], dtype=F64)
        out[:, ::G] = d.double().cpu()
        return out
    dht = None if dhk is None else (spread(dhk), spread(dhv))
    r = reference.gsa_bwd(f64["q"], k, v, s_, g_, do.double().cpu(), dht, initial_state=init, **kw)

    def fold(t, d):  # sum the gradients of a group's copies
        return t if G == 1 else t.unflatten(d, (t.shape[d] // G, G)).sum(d + 1)
    grads = dict(q=r["q"], k=fold(r["k"], hd), v=fold(r["v"], hd))
    if f64["g"] is None:
        torch.autograd.backward([sk, g], [fold(r["s"], hd), fold(r["g"], hd)])
        grads["s"] = s64.grad
    else:
        grads["s"], grads["g"] = fold(r["s"], hd), fold(r["g"], hd)
    if init is not None:
        grads["hk0"], grads["hv0"] = fold(r["hk0"], 1), fold(r["hv0"], 1)
    return (o, hk[:, ::G], hv[:, ::G]), grads


def run_and_check(mode, x, *, gen, dht_on=True, tol_scale=1.0, **kw):
    """Forward, both final states and every gradient vs the oracle at the §8.3 tolerances."""
    tol, tol_decay, atol = TOL[x["k"].dtype]
    tol, tol_decay = tol * tol_scale, tol_decay * tol_scale
    ins = leaves(x)
    o, hk, hv = call(mode, ins, output_final_state=True, **kw)
    assert o.dtype == x["v"].dtype and hk.dtype == hv.dtype == (F64 if o.dtype == F64 else F32)
    do = torch.randn(o.shape, generator=gen).to(o)
    dhk = torch.randn(hk.shape, generator=gen).to(hk) if dht_on else None
    dhv = torch.randn(hv.shape, generator=gen).to(hv) if dht_on else None
    refs, g_ref = oracle(x, do, dhk, dhv, **kw)
    for name, t, ref in zip(("o", "hk", "hv"), (o, hk, hv), refs):
        assert_close(name, t, ref, tol, atol)
    loss = (o * do).sum() + ((hk * dhk).sum() + (hv * dhv).sum() if dht_on else 0)
    loss.backward()
    for name, t in ins.items():
        if t is None:
            continue
        assert t.grad is not None, f"no gradient for {name}"
        assert_close(f"d{name}", t.grad, g_ref[name], tol_decay if name == "g" else tol, atol)
    return o, hk, hv, {n: t.grad for n, t in ins.items() if t is not None}


# (B, T, HQ, H, K, V, M): T = 1, partial / exact / over-the-chunk lengths, K != V both ways,
# M in {16, 64} and odd, grouped heads (HQ = 2H, 4H).
SHAPES = [(2, 1, 2, 2, 16, 32, 8), (1, 63, 2, 2, 64, 16, 64), (2, 65, 2, 1, 24, 40, 16),
          (1, 100, 4, 1, 32, 24, 20), (1, 130, 2, 2, 60, 100, 64)]
LAYOUTS = [(False, False), (True, False), (False, True), (True, True)]  # (head_first, noncontig)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("mode", ["chunk", "fused"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}HQ{}H{}K{}V{}M{}".format(*s))
@pytest.mark.parametrize("layout_", LAYOUTS, ids=lambda f: "hf{}nc{}".format(*map(int, f)))
def test_grid(device, dtype, mode, shape, layout_, gen):
    head_first, noncontig = layout_
    T = shape[1]
    x = make(*shape, dtype, device, gen, head_first=head_first, noncontig=noncontig,
             h0=(T + head_first) % 2 == 0)
    # A non-default scale (larger slot logits) on the strided inputs, every dtype.
    scale = 0.7 if noncontig else None
    run_and_check(mode, x, gen=gen, dht_on=(T + noncontig) % 2 == 1, head_first=head_first,
                  scale=scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", ["chunk", "fused"])
def test_low_precision_logits_unrounded(device, dtype, mode, gen):
    """bf16 / fp16 with large slot logits (scale 0.7 at K = 64, 5.6x the default): ok reaches the
    softmax and dp its backward in float32 (the GLA ops' wide q), so every tensor meets the GLA
    tolerance. With ok and dp rounded to bf16 (as fla does), dq, dk, ds and dg were 1.3-1.8e-2."""
    x = make(2, 128, 2, 2, 64, 32, 32, dtype, device, gen)
    run_and_check(mode, x, gen=gen, scale=0.7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["chunk", "fused"])
@pytest.mark.parametrize("g_kind", STRESS + ["u60_20", "gsa_hard"])
def test_stress(device, mode, g_kind, gen):
    """§8.4 gate regimes in fp32, every output and gradient, h0 on/off and dht on/off alternating."""
    i = (STRESS + ["u60_20", "gsa_hard"]).index(g_kind)
    x = make(2, 150, 2, 2, 32, 48, 16, F32, device, gen, g_kind=g_kind, h0=i % 2 == 0)
    run_and_check(mode, x, gen=gen, dht_on=i % 3 != 0)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("g_kind", ["typical", "gsa_hard", "u60_20"])
def test_strong_gates_bf16(device, dtype, g_kind, gen):
    """GSA's strong slot gates in the training dtype, at the shape GSA layers use (K = V = M = 64)."""
    x = make(1, 200, 2, 2, 64, 64, 64, dtype, device, gen, g_kind=g_kind)
    run_and_check("chunk", x, gen=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["chunk", "fused"])
@pytest.mark.parametrize("with_g", [True, False], ids=["g", "gNone"])
def test_varlen(device, mode, with_g, gen):
    """The §8.4 ragged lengths (1, 16, 64, 64, 255, 600) plus an empty sequence, with grouped
    heads; with g=None the gate's running sum restarts at each sequence."""
    cu = [0, 1, 17, 81, 81, 145, 400, 1000]
    x = make(1, 1000, 4, 2, 16, 24, 16, F32, device, gen, N=len(cu) - 1,
             g_kind="typical" if with_g else None)
    run_and_check(mode, x, gen=gen, cu_seqlens=torch.tensor(cu, device=device))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("mode", ["chunk", "fused"])
def test_g_none(device, dtype, mode, gen):
    """fla's g=None (ABC): the gate derived from s, every gradient through it, head_first."""
    x = make(2, 90, 2, 1, 32, 16, 32, dtype, device, gen, g_kind=None, head_first=True)
    run_and_check(mode, x, gen=gen, head_first=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["chunk", "fused"])
def test_saturated_softmax(device, mode, gen):
    """§8.4: q, k scaled x10, so the softmax over the slots saturates to one-hot rows. The
    gradients through it are differences dp - <p, dp> of nearly equal terms times p, of logits
    |ok| ~ 1e2 that fp32 holds to ~1e-5 absolute: measured dq 2.8e-5 in the fused mode, so 3x the fp32 tolerance, the one test where the §8.3 2x for GSA is exceeded."""
    x = make(1, 120, 2, 2, 32, 32, 16, F32, device, gen, qk_scale=10.0)
    run_and_check(mode, x, gen=gen, tol_scale=3.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_fused_reverse(device, reverse, gen):
    x = make(2, 40, 2, 2, 16, 8, 8, F32, device, gen)
    run_and_check("fused", x, gen=gen, reverse=reverse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("g_kind", ["typical", "u30", "mixedinf", "gsa_hard"])
def test_chunk_matches_recurrent(device, g_kind, gen):
    """The same inputs through both modes: outputs, states and every gradient agree to fp32
    accuracy (decay gradients to their own tolerance)."""
    cu = [0, 70, 70, 200]
    x = make(1, 200, 4, 2, 32, 24, 16, F32, device, gen, g_kind=g_kind, N=3)
    kw = dict(cu_seqlens=torch.tensor(cu, device=device), output_final_state=True)
    out = {}
    for mode in MODES:
        ins = leaves(x)
        o, hk, hv = call(mode, ins, **kw)
        if not out:
            do, dhk, dhv = (torch.randn(t.shape, generator=gen).to(t) for t in (o, hk, hv))
        ((o * do).sum() + (hk * dhk).sum() + (hv * dhv).sum()).backward()
        out[mode] = dict(o=o, hk=hk, hv=hv, **{f"d{n}": t.grad for n, t in ins.items()})
    for name, a in out["chunk"].items():
        tol = 5e-5 if name == "dg" else 1e-5
        assert_close(name, a, out["fused"][name], tol, 1e-6)


def test_grouped_states_are_per_key_head(gen):
    """Grouped heads: the states have the key heads' count, and a group's query heads read the
    same state (running each query head alone with its key head gives the same output)."""
    x = make(1, 30, 4, 2, 8, 8, 4, F64, "cpu", gen)
    o, hk, hv = call("chunk", x, output_final_state=True)
    assert hk.shape == (1, 2, 8, 4) and hv.shape == (1, 2, 4, 8)
    for hq in range(4):
        h = hq // 2
        one = dict(x, q=x["q"][:, :, hq:hq + 1], k=x["k"][:, :, h:h + 1], v=x["v"][:, :, h:h + 1],
                   s=x["s"][:, :, h:h + 1], g=x["g"][:, :, h:h + 1], hk0=x["hk0"][:, h:h + 1],
                   hv0=x["hv0"][:, h:h + 1])
        o1, hk1, hv1 = call("chunk", one, output_final_state=True)
        torch.testing.assert_close(o1[:, :, 0], o[:, :, hq], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(hk1[:, 0], hk[:, h], rtol=1e-12, atol=1e-12)


def test_inputs_not_modified(gen):
    x = make(1, 70, 2, 1, 16, 8, 8, F32, "cpu", gen, g_kind=None)
    before = {n: t.clone() for n, t in x.items() if t is not None}
    ins = leaves(x)
    o, hk, hv = call("chunk", ins, output_final_state=True)
    (o.sum() + hk.sum() + hv.sum()).backward()
    for n, t in before.items():
        assert torch.equal(ins[n].detach(), t), n


@pytest.mark.parametrize("mode", ["chunk", "fused"])
def test_no_final_state(mode, gen):
    x = make(1, 10, 2, 2, 8, 8, 4, F32, "cpu", gen)
    o, (hk, hv) = MODES[mode](x["q"], x["k"], x["v"], x["s"], x["g"])
    assert hk is None and hv is None and o.shape == x["v"].shape


BAD = [
    (dict(s=lambda x: x["s"][..., :-1]), "`g` must have the shape of `s`"),
    (dict(v=lambda x: x["v"][:, :-1]), "`v` must be"),
    (dict(k=lambda x: x["k"][..., :-1]), "`k` must be"),
    (dict(q=lambda x: torch.cat([x["q"], x["q"][:, :, :1]], 2)), "multiple of the heads of `k`"),
    (dict(g=lambda x: x["g"].double()), "`g`"),
    (dict(hk0=lambda x: x["hk0"][..., :-1]), "hk0"),
    (dict(hv0=lambda x: x["hv0"].double()), "hv0"),
]


@pytest.mark.parametrize("mode", ["chunk", "fused"])
@pytest.mark.parametrize("change,msg", BAD, ids=[m for _, m in BAD])
def test_errors_name_the_argument(mode, change, msg, gen):
    x = make(1, 10, 2, 2, 8, 8, 4, F32, "cpu", gen)
    for n, f in change.items():
        x[n] = f(x)
    with pytest.raises((ValueError, RuntimeError), match=msg.replace("(", r"\(").replace("`", "`")):
        call(mode, x)


def test_initial_state_must_be_a_pair(gen):
    x = make(1, 10, 2, 2, 8, 8, 4, F32, "cpu", gen)
    with pytest.raises(TypeError, match="pair"):
        fla_ext.chunk_gsa(x["q"], x["k"], x["v"], x["s"], x["g"], initial_state=x["hk0"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["chunk_gsa", "fused_recurrent_gsa"])
@pytest.mark.parametrize("with_g", [True, False], ids=["g", "gNone"])
def test_opcheck(device, op, with_g, gen):
    """Real dispatcher ops: schema, fake tensors, autograd registration, AOT dispatch."""
    x = make(1, 20, 4, 2, 16, 8, 8, F32, device, gen, g_kind="typical" if with_g else None)
    args = (x["q"], x["k"], x["v"], x["s"], x["g"], None, x["hk0"], x["hv0"], True)
    if op == "fused_recurrent_gsa":
        args += (False,)
    torch.library.opcheck(getattr(torch.ops.fla, op).default, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_core_ops(device, dtype, gen):
    """chunk_gsa_core's training forward and backward as dispatcher ops (opcheck), its float32
    softmax p, the workspaces (kept on CUDA only), and the backward reading them equal to the one
    rebuilding them."""
    x = make(1, 70, 2, 2, 16, 8, 8, dtype, device, gen)
    fargs = (x["q"], x["k"], x["v"], x["s"], x["g"], None, x["hk0"], x["hv0"], True, None, False)
    train = torch.ops.fla.chunk_gsa_core_train.default
    torch.library.opcheck(train, fargs)
    o, hk, hv, p, hst1, hst2, amat2 = train(*fargs)
    o_ref, hk_ref, hv_ref = torch.ops.fla.chunk_gsa_core(*fargs)
    for a, b in ((o, o_ref), (hk, hk_ref), (hv, hv_ref)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert p.dtype == F32 and p.shape == x["s"].shape
    torch.testing.assert_close(p.sum(-1), torch.ones_like(p[..., 0]))
    cuda = device == "cuda"
    assert (hst1.numel() > 0) == cuda and (hst2.numel() > 0) == cuda and (amat2.numel() > 0) == cuda
    do = torch.randn(o.shape, generator=gen).to(o)
    dhk, dhv = torch.randn(hk.shape, generator=gen).to(hk), torch.randn(hv.shape, generator=gen).to(hv)
    bargs = fargs[:5] + (p, do, dhk, dhv, None, x["hk0"], x["hv0"], None, False)
    bwd = torch.ops.fla.chunk_gsa_core_bwd.default
    torch.library.opcheck(bwd, bargs + (hst1, hst2, amat2))
    for a, b in zip(bwd(*bargs, hst1, hst2, amat2), bwd(*bargs, None, None, None)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("train", [True, False], ids=["train", "inference"])
def test_core_forward_peak_memory(train, monkeypatch, gen):
    """The forward's peak extra memory: the float32 logits of pass 1 (and, without a backward,
    the float32 p: pass 2 reads its bf16 copy) are released before pass 2, not held to the end
    (each the size of p, 8 MiB here; the slack is 1 MiB). Training: the peak is pass 2, holding
    what the op returns plus the bf16 p. Inference: pass 1, the logits with pass 1's states (or
    with p, the softmax). The state walks in one piece: in windows (on by default at these few
    long walks) pass 2 holds their hand-over states as well, and at M = 128 its chunk-start
    states (docs/design.md §5.2; the windows' memory has its own test in test_gla_rwkv6_chunk)."""
    monkeypatch.setenv("FLA_EXT_CHUNK_WINDOWS", "0")
    x = make(2, 4096, 2, 2, 64, 64, 128, BF16, "cuda", gen, h0=False)
    fargs = (x["q"], x["k"], x["v"], x["s"], x["g"], None, None, None, False, None, False)
    train_op = torch.ops.fla.chunk_gsa_core_train.default
    nbytes = lambda t: t.numel() * t.element_size()
    p_bytes, pq_bytes = x["s"].numel() * 4, nbytes(x["s"])
    hst1_bytes = nbytes(train_op(*fargs)[4])
    op = train_op if train else torch.ops.fla.chunk_gsa_core.default
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    outs = op(*fargs)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    if train:
        assert outs[3].numel() == x["s"].numel() and hst1_bytes > 0  # p and the states kept
        expected = sum(nbytes(t) for t in outs) + pq_bytes
    else:
        expected = p_bytes + max(hst1_bytes, p_bytes)
    assert extra <= expected + (1 << 20), (extra, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["chunk", "fused"])
def test_compile_fullgraph(device, mode, gen):
    """torch.compile(fullgraph=True) of the op, forward and backward, gives eager's values."""
    from conftest import assert_compiles_same
    x = make(1, 40, 2, 1, 16, 8, 8, F32, device, gen)
    ins = [t.detach().clone().requires_grad_(True) for t in (x["q"], x["k"], x["v"], x["s"], x["g"])]

    def f(q, k, v, s, g):
        o, (hk, hv) = MODES[mode](q, k, v, s, g, initial_state=(x["hk0"], x["hv0"]),
                                  output_final_state=True)
        return (o * o).sum() + hk.sum() + hv.square().sum()
    assert_compiles_same(f, ins, ins, device)
