"""fla::chunk_gla and fla::chunk_rwkv6 (the chunked algorithm, 64-row chunks: docs/algorithms.md
§4-§5, and chunk_gla's value-side decay gv of §7.1, alone and with g): forward and every
gradient vs the float64 oracle, vs the fused recurrent mode, the §8.4 stress suite and varlen,
GSA's two passes, on CPU and CUDA."""
import math

import pytest
import torch

import fla_ext
from conftest import DEVICES, TOL, assert_close
from families import (CHUNK_FAMILIES, FUSED_FAMILIES, GLA_GV, GLA_KV, RWKV6, leaves,
                      on_devices, run_and_check)
from fla_ext import reference
from inputs import STRESS, layout, log_decay

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
DTYPES = [pytest.param(F32, id="fp32"), pytest.param(BF16, id="bf16")]

# T: a single partial chunk, one row short of a chunk, exactly one, one over, two plus a bit.
# K != V both ways; K, V over the CUDA tile of 64 (several tiles, partial tiles); K = 256 (max).
SHAPES = [(2, 1, 2, 16, 32), (1, 63, 2, 128, 32), (2, 64, 1, 24, 100), (2, 65, 2, 32, 48),
          (1, 130, 2, 60, 20), (1, 80, 1, 256, 8)]
LAYOUTS = [(False, False), (True, False), (False, True), (True, True)]  # (head_first, noncontig)


@pytest.mark.parametrize("device,fam", on_devices(DEVICES, CHUNK_FAMILIES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}V{}".format(*s))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda f: "hf{}nc{}".format(*map(int, f)))
def test_grid(device, dtype, fam, shape, layout, gen):
    head_first, noncontig = layout
    T = shape[1]
    # every (h0, dht) pair occurs for every T; a non-default scale on the strided inputs
    x = fam.make(*shape, dtype, device, gen, head_first=head_first, noncontig=noncontig,
                 h0=(T + head_first) % 2 == 0)
    run_and_check(fam, "chunk", x, dht_on=(T + noncontig) % 2 == 1, head_first=head_first,
                  scale=0.7 if noncontig else None, gen=gen)


@pytest.mark.parametrize("device,fam", on_devices(DEVICES, FUSED_FAMILIES))
@pytest.mark.parametrize("w_kind,cu", [("typical", None), ("u30", None), ("mixedinf", None),
                                       ("spike15", None), ("typical", [0, 70, 70, 135, 200])],
                         ids=["typical", "u30", "mixedinf", "spike15", "varlen"])
def test_matches_fused(device, fam, w_kind, cu, gen):
    """Same inputs (initial state and final-state gradient included): chunk == fused_recurrent
    to fp32 accuracy, forward and backward (the decay gradient, a cumsum of cancelling terms,
    to its own §8.3 tolerance: the recurrent mode is ~1e-5 there on u30)."""
    N = len(cu) - 1 if cu else 2
    x = fam.make(1 if cu else 2, cu[-1] if cu else 100, 2, 32, 24, F32, device, gen,
                 w_kind=w_kind, N=N)
    kw = dict(cu_seqlens=torch.tensor(cu, device=device) if cu else None, output_final_state=True)
    do = torch.randn(x["v"].shape, generator=gen).to(device)
    dht = torch.randn(x["h0"].shape, generator=gen).to(device)
    out = {}
    for mode in ("chunk", "fused"):
        ins = leaves(x)
        o, ht = fam.call(mode, ins, **kw)
        ((o * do).sum() + (ht * dht).sum()).backward()
        out[mode] = dict(o=o, ht=ht, **{f"d{n}": t.grad for n, t in ins.items()})
    tol, tol_decay, atol = TOL[F32]
    for name, ref in out["fused"].items():
        decay = name[1:] in fam.decays
        assert_close(name, out["chunk"][name], ref, tol_decay if decay else tol, atol)


# ---------------------------------------------------------------------------------------------
# Stress suite (docs/algorithms.md §8.4)

# float64 runs on the CPU only (the CUDA kernels take fp32/bf16/fp16), so it is not generated
# for CUDA rather than skipped there.
DEVICE_DTYPES = [pytest.param("cpu", F64, id="cpu-fp64")] + [
    pytest.param(d.values[0], t, id=f"{d.id}-{tid}", marks=d.marks)
    for d in DEVICES for t, tid in [(F32, "fp32"), (BF16, "bf16")]]


@pytest.mark.parametrize("device,dtype,fam", on_devices(DEVICE_DTYPES, CHUNK_FAMILIES))
@pytest.mark.parametrize("w_kind", STRESS)
def test_stress_gates(device, dtype, fam, w_kind, gen):
    x = fam.make(2, 70, 2, 64, 32, dtype, device, gen, w_kind=w_kind)
    run_and_check(fam, "chunk", x, gen=gen)


@pytest.mark.slow
@pytest.mark.parametrize("device,fam", on_devices(DEVICES, CHUNK_FAMILIES))
@pytest.mark.parametrize("T,w_kind", [(4096, "typical"), (8192, "typical"), (4096, "zero")])
def test_stress_long(device, fam, T, w_kind, gen):
    x = fam.make(1, T, 1, 64, 64, F32, device, gen, w_kind=w_kind)
    run_and_check(fam, "chunk", x, gen=gen)


@pytest.mark.parametrize("device,fam", on_devices(DEVICES[1:], CHUNK_FAMILIES))
@pytest.mark.parametrize("H,K,cu", [(2, 64, None), (2, 128, None), (48, 64, None),
                                    (2, 64, [0, 0, 1500, 1501, 3100])],
                         ids=["H2K64", "H2K128", "H48K64", "varlen"])
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "remade"])
def test_state_windows(device, fam, H, K, cu, keep, monkeypatch, gen):
    """The state kernel's walks in windows of the chunk index (on by default; kernels/chunk.h
    chunk_window_chunks: walks of 32 chunks in windows of 8), forward and backward: o, the final
    state and every gradient against the float64 oracle, with the states kept by the training
    forward or made again by the backward (the forward then the inference one). K = 64: o formed
    in the windowed walk; K = 128: o split off into the out kernel where the states are kept, else
    formed over both K tiles in the walk. Weak decays (near0), so that the state handed from window
    to window matters. With cu_seqlens: windows sized for the mean length (775 rows: 13 chunks,
    windows of 8), an empty sequence and one of a single row among them."""
    monkeypatch.delenv("FLA_EXT_CHUNK_WINDOWS", raising=False)  # on by default
    T = cu[-1] if cu else 2048
    x = fam.make(1, T, H, K, K, F32, device, gen, w_kind="near0", N=len(cu) - 1 if cu else 1)
    kw = dict(cu_seqlens=torch.tensor(cu, device=device)) if cu else {}
    with fla_ext.keep_workspaces(keep):
        run_and_check(fam, "chunk", x, gen=gen, **kw)


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("K", [64, 128])
def test_windowed_inference_forward_memory(device, K):
    """A forward that keeps nothing, its walks in windows (T = 8192, 2 heads: 2 walks of 128
    chunks at K = 64 in windows of 8, 4 at K = 128 in windows of 8, o formed over both K tiles in
    the walk): the windows hand their states on through a state a window and the chunk-start
    states are not allocated. Peak extra memory: o, the float32 pair matrices and the windows'
    states (16 windows x 2 heads x K x K floats: 0.5 / 2 MiB) with 256 KiB of slack; the
    chunk-start states would be 4.2 / 16.8 MB more."""
    B, T, H = 1, 8192, 2
    q, k, v = (torch.randn(B, T, H, K, device=device, dtype=BF16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=device)).to(BF16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        o, _ = fla_ext.chunk_gla(q, k, v, g)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    pairs = (T // 64) * H * 64 * 64 * 4
    window_states = 16 * H * K * K * 4
    assert extra <= o.numel() * o.element_size() + pairs + window_states + (1 << 18), extra


@pytest.mark.parametrize("device,fam", on_devices(DEVICES[1:], CHUNK_FAMILIES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_state_two_ctas_an_sm(device, fam, dtype, gen):
    """The forward's state kernel with o at K <= 64 where its (sequence, head) CTAs are more than
    the SMs (then built for two an SM: kernels/chunk_launch.cuh launch_state): a forward that
    keeps no workspace (the inference one) and its backward against the float64 oracle."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    x = fam.make(2, 130, sms // 2 + 4, 64, 64, dtype, device, gen)
    with fla_ext.keep_workspaces(False):
        run_and_check(fam, "chunk", x, gen=gen)


@pytest.mark.parametrize("device,fam", on_devices(DEVICES, CHUNK_FAMILIES))
@pytest.mark.parametrize("fill", [-1e4, -math.inf])
def test_analytic_hard_decay(device, fam, fill, gen):
    """§8.4 item 2, over two chunks: with exp(lambda) = 0 a token sees only itself (GLA, on
    either side or both) or the previous token and the bonus (RWKV6); every decay gradient is
    exactly 0 everywhere, and so is dh0 for GLA (RWKV6: only o_0 reads h0)."""
    B, T, H, K, V = 2, 70, 2, 16, 8
    x = fam.make(B, T, H, K, V, F32, device, gen)
    q, k, v, h0 = x[fam.args[0]], x["k"], x["v"], x["h0"]
    for n in fam.decays:
        x[n] = torch.full_like(x[n], fill)
    s = K ** -0.5
    ins = leaves(x)
    o, ht = fam.call("chunk", ins, output_final_state=True)
    if fam is not RWKV6:
        expect = (q * k).sum(-1, keepdim=True) * v
    else:
        expect = torch.einsum("bthk,hk,bthk->bth", q, x["u"], k)[..., None] * v
        expect[:, 1:] += torch.einsum("bthk,bthk->bth", q[:, 1:], k[:, :-1])[..., None] * v[:, :-1]
        expect[:, 0] += torch.einsum("bhk,bhkv->bhv", q[:, 0], h0)
    torch.testing.assert_close(o, s * expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, torch.einsum("bhk,bhv->bhkv", k[:, -1], v[:, -1]))
    do = torch.randn(o.shape, generator=gen).to(o)
    ((o * do).sum() + ht.square().sum()).backward()
    for n in fam.decays:
        assert torch.equal(ins[n].grad, torch.zeros_like(x[n])), n  # exactly, not ~0
    if fam is not RWKV6:
        assert torch.equal(ins["h0"].grad, torch.zeros_like(h0))
    else:
        dh0 = s * torch.einsum("bhk,bhv->bhkv", q[:, 0], do[:, 0])
        torch.testing.assert_close(ins["h0"].grad, dh0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device,fam", on_devices(DEVICES, CHUNK_FAMILIES))
@pytest.mark.parametrize("dtype", DTYPES + [pytest.param(F16, id="fp16")])
@pytest.mark.parametrize("spike", [-100.0, -20.0])
def test_first_row_spike(device, dtype, fam, spike, gen):
    """§2.3: a decay below -88.7 (fp32/bf16; -11 for fp16 operands) at the first row of a
    sub-chunk (rows = 0 mod 16). A reference at that row's inclusive cumsum would give the
    exclusive reader exp(-lambda) = inf there, and inf * 0 = NaN in the off-diagonal blocks."""
    B, T, H, K, V = 2, 80, 2, 64, 32
    x = fam.make(B, T, H, K, V, dtype, device, gen)
    for n in fam.decays:
        w = -0.1 * torch.rand(x[n].shape, generator=gen)
        w[:, ::16] = spike
        x[n] = w.to(device=device, dtype=dtype)
    if dtype == F16:  # keep o and the gradients well inside the fp16 range
        for n in fam.args[:2]:
            x[n] = x[n] * 0.5
    run_and_check(fam, "chunk", x, gen=gen)


# ---------------------------------------------------------------------------------------------
# Variable length

@pytest.mark.parametrize("device,fam", on_devices(DEVICES, CHUNK_FAMILIES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cu", [[0, 70, 70, 135, 200], [0, 1, 17, 81, 145, 400]],
                         ids=["empty", "ragged"])
def test_varlen(device, dtype, fam, cu, gen):
    """Sequences straddling chunk boundaries (each is chunked from its own start), an empty one,
    lengths 1, 16, 64, 64, 255: vs the oracle and vs each sequence run alone."""
    T, N = cu[-1], len(cu) - 1
    x = fam.make(1, T, 2, 32, 16, dtype, device, gen, N=N)
    cu_t = torch.tensor(cu, dtype=torch.long, device=device)
    o, ht, grads = run_and_check(fam, "chunk", x, cu_seqlens=cu_t, gen=gen)
    same = dict(rtol=1e-6, atol=1e-6) if dtype == F32 else dict(rtol=1e-2, atol=1e-2)
    for n in range(N):
        a, b = cu[n], cu[n + 1]
        xn = {name: t if name == "u" else t[:, a:b] for name, t in x.items() if name != "h0"}
        xn["h0"] = x["h0"][n:n + 1]
        on, hn = fam.call("chunk", xn, output_final_state=True)
        torch.testing.assert_close(on, o[:, a:b], **same)
        torch.testing.assert_close(hn, ht[n:n + 1], **same)
    for n in range(N):
        if cu[n] == cu[n + 1]:  # an empty sequence passes its state and its gradient through
            assert torch.equal(ht[n], x["h0"][n])
            ins = leaves(x)
            _, ht2 = fam.call("chunk", ins, output_final_state=True, cu_seqlens=cu_t)
            dht = torch.randn(ht2.shape, generator=gen).to(ht2)
            (ht2 * dht).sum().backward()
            assert torch.equal(ins["h0"].grad[n], dht[n])


# ---------------------------------------------------------------------------------------------
# Exact fp64 path, defaults, inputs left untouched

@pytest.mark.parametrize("fam", CHUNK_FAMILIES)
def test_gradcheck_fp64(fam, gen):
    """Two sequences, the second over a chunk boundary (67 rows), every input incl. h0."""
    x = fam.make(1, 70, 1, 2, 3, F64, "cpu", gen, N=2)
    cu = torch.tensor([0, 3, 70])
    names = list(fam.args) + ["h0"]

    def f(*ts):
        return fam.call("chunk", dict(zip(names, ts)), output_final_state=True, cu_seqlens=cu)

    ins = [x[n].clone().requires_grad_(True) for n in names]
    assert torch.autograd.gradcheck(f, ins, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("device,fam", on_devices(DEVICES, CHUNK_FAMILIES))
def test_defaults_and_inputs_unchanged(device, fam, gen):
    x = fam.make(2, 70, 2, 16, 24, BF16, device, gen, noncontig=True)
    # no final state requested: None, and the same o as with one
    o1, ht = fam.call("chunk", x)
    assert ht is None
    o2, _ = fam.call("chunk", x, output_final_state=True)
    assert torch.equal(o1, o2)
    ins = leaves(x)
    before = {n: t.detach().clone() for n, t in ins.items()}
    o, ht = fam.call("chunk", ins, output_final_state=True)
    (o.float().sum() + ht.sum()).backward()
    for name, t in ins.items():
        assert torch.equal(t.detach(), before[name]), f"{name} was modified"


@pytest.mark.parametrize("device,fam", on_devices(DEVICES, CHUNK_FAMILIES))
def test_no_rows(device, fam, gen):
    """T = 0: the state passes through both ways (no activation has data to point at)."""
    x = fam.make(2, 0, 2, 8, 4, F32, device, gen)
    ins = leaves(x)
    o, ht = fam.call("chunk", ins, output_final_state=True)
    assert o.shape == x["v"].shape and torch.equal(ht, x["h0"])
    dht = torch.randn(ht.shape, generator=gen).to(ht)
    (ht * dht).sum().backward()
    assert torch.equal(ins["h0"].grad, dht)
    if "u" in ins:
        assert torch.equal(ins["u"].grad, torch.zeros_like(x["u"]))


# ---------------------------------------------------------------------------------------------
# The value-side decay gv (docs/algorithms.md §7.1): the shapes the brief names, GSA-strength decays,
# GSA's two passes end to end

VALUE_FAMILIES = [p for p in CHUNK_FAMILIES if p.values[0] in (GLA_GV, GLA_KV)]


@pytest.mark.parametrize("device,dtype,fam", on_devices(DEVICE_DTYPES, VALUE_FAMILIES))
@pytest.mark.parametrize("KV", [(32, 64), (64, 16)], ids=["K32V64", "K64V16"])
@pytest.mark.parametrize("T,cu,head_first", [(1, None, False), (1, None, True), (100, None, False),
                                              (100, None, True), (135, [0, 70, 70, 71, 135], False)],
                         ids=["T1", "T1-hf", "T100", "T100-hf", "varlen"])
def test_value_decay_shapes(device, dtype, fam, KV, T, cu, head_first, gen):
    """K != V both ways, T = 1, T not a multiple of 64, both layouts, varlen with an empty and a
    1-row sequence: forward, final state and every gradient (q, k, v, g, gv, h0) vs the oracle."""
    K, V = KV
    x = fam.make(1 if cu else 2, T, 2, K, V, dtype, device, gen, head_first=head_first,
                 N=len(cu) - 1 if cu else None)
    cu_t = torch.tensor(cu, device=device) if cu else None
    run_and_check(fam, "chunk", x, head_first=head_first, cu_seqlens=cu_t, gen=gen)


@pytest.mark.parametrize("device,dtype,fam", on_devices(DEVICE_DTYPES, VALUE_FAMILIES))
@pytest.mark.parametrize("kind", ["u60_20", "gsa_hard"])
def test_gsa_strength_decay(device, dtype, fam, kind, gen):
    """GSA's slot decays reach far below -20 (logsigmoid of large negative logits, or
    U(-60, -20)): every factor of a pair or a chunk underflows after a step or two, and the
    decay gradients are sums of terms that cancel down to 0."""
    B, T, H, K, V = 2, 150, 2, 32, 48
    x = fam.make(B, T, H, K, V, dtype, device, gen)
    for n in fam.decays:
        x[n] = log_decay(kind, x[n].shape, gen).to(device=device, dtype=dtype)
    run_and_check(fam, "chunk", x, gen=gen)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("with_state", [False, True], ids=["h0none", "h0"])
def test_gsa_two_passes(device, dtype, with_state, gen):
    """GSA (docs/algorithms.md §7) built from two chunk_gla calls, pass 1 with gv = g over the slots,
    a float32 softmax, pass 2 with g: the output, both final states and every gradient
    (q, k, v, s, g, hk0, hv0) vs the float64 GSA oracle."""
    B, T, H, K, M, V = 1, 100, 2, 32, 16, 24
    cu = [0, 30, 30, 100]
    N = len(cu) - 1
    mk = lambda D, x=None: layout(torch.randn(B, T, H, D, generator=gen) if x is None else x,  # noqa: E731
                                  dtype, device)
    q, k, v, s = mk(K), mk(K), mk(V), mk(M)
    g = mk(M, log_decay("typical", (B, T, H, M), gen))
    acc = F64 if dtype == F64 else F32
    hk0 = torch.randn(N, H, K, M, generator=gen).to(device, acc) if with_state else None
    hv0 = torch.randn(N, H, M, V, generator=gen).to(device, acc) if with_state else None
    cu_t = torch.tensor(cu, device=device)
    ins = leaves(dict(q=q, k=k, v=v, s=s, g=g, hk0=hk0, hv0=hv0))
    kw = dict(cu_seqlens=cu_t, output_final_state=True)
    ok, hk = fla_ext.chunk_gla(ins["q"], ins["k"], ins["s"], gv=ins["g"], initial_state=ins["hk0"],
                               **kw)
    p = torch.softmax(ok.to(acc), dim=-1).to(dtype)  # float32 (float64 for float64) softmax
    o, hv = fla_ext.chunk_gla(p, ins["s"], ins["v"], g=ins["g"], scale=1.0,
                              initial_state=ins["hv0"], **kw)
    init = (hk0, hv0) if with_state else None
    o_ref, (hk_ref, hv_ref) = reference.gsa(q, k, v, s, g, initial_state=init, cu_seqlens=cu_t)
    tol, tol_decay, atol = TOL[dtype]
    for name, x, ref in [("o", o, o_ref), ("hk", hk, hk_ref), ("hv", hv, hv_ref)]:
        assert_close(name, x, ref, tol, atol)
    do = torch.randn(o.shape, generator=gen).to(o)
    dhk, dhv = torch.randn(hk.shape, generator=gen).to(hk), torch.randn(hv.shape, generator=gen).to(hv)
    ((o * do).sum() + (hk * dhk).sum() + (hv * dhv).sum()).backward()
    ref = reference.gsa_bwd(q, k, v, s, g, do, (dhk, dhv), initial_state=init, cu_seqlens=cu_t)
    for name in ["q", "k", "v", "s", "g"] + (["hk0", "hv0"] if with_state else []):
        assert_close("d" + name, ins[name].grad, ref[name], tol_decay if name == "g" else tol, atol)


def test_value_decay_is_not_key_decay(gen):
    """gv decays the state's columns, g its rows: with K != V they are different maps, and
    chunk_gla(gv=w) is the transposed problem (q, v swap roles in the read): a cross-check of
    the op's argument routing against a direct float64 recurrence on one small case."""
    B, T, H, K, V = 1, 20, 1, 3, 5
    x = GLA_GV.make(B, T, H, K, V, F64, "cpu", gen)
    o, ht = fla_ext.chunk_gla(x["q"], x["k"], x["v"], gv=x["gv"], initial_state=x["h0"],
                              output_final_state=True)
    h = x["h0"][0, 0].clone()
    for t in range(T):
        h = h * torch.exp(x["gv"][0, t, 0])[None, :] + torch.outer(x["k"][0, t, 0], x["v"][0, t, 0])
        torch.testing.assert_close(o[0, t, 0], K ** -0.5 * h.T @ x["q"][0, t, 0], rtol=1e-12,
                                   atol=1e-12)
    torch.testing.assert_close(ht[0, 0], h, rtol=1e-12, atol=1e-12)
