"""fla 0.6.0's call signatures for the diagonal family and RWKV7 (issue: fla API parity): every
positional parameter of fla's chunk_ / fused_recurrent_ {gla, rwkv6, gsa, rwkv7} sits at fla's
position here, every keyword fla accepts is accepted, and `state_v_first` ([N, H, V, K] states) means what it means in
fla. The table is fla 0.6.0's (read from its source); where fla is importable the live signatures
are compared too."""
import inspect

import pytest
import torch

import fla_ext
from conftest import DEVICES, assert_close
from inputs import make_diag

# op -> (fla's positional parameters in order, fla's other keywords it reads from **kwargs)
FLA_060 = {
    "chunk_gla": (["q", "k", "v", "g", "scale", "initial_state", "output_final_state",
                   "state_v_first", "cu_seqlens", "cu_seqlens_cpu"], []),
    "fused_recurrent_gla": (["q", "k", "v", "gk", "gv", "scale", "initial_state",
                             "output_final_state", "reverse", "state_v_first", "cu_seqlens"],
                            ["transpose_state_layout"]),
    "chunk_rwkv6": (["r", "k", "v", "w", "u", "scale", "initial_state", "output_final_state",
                     "cu_seqlens", "cu_seqlens_cpu"], ["chunk_size"]),
    "fused_recurrent_rwkv6": (["r", "k", "v", "w", "u", "scale", "initial_state",
                               "output_final_state", "reverse", "cu_seqlens"], []),
    "chunk_gsa": (["q", "k", "v", "s", "g", "scale", "initial_state", "output_final_state",
                   "checkpoint_level", "cu_seqlens", "cu_seqlens_cpu"], ["chunk_size"]),
    "fused_recurrent_gsa": (["q", "k", "v", "s", "g", "scale", "initial_state",
                             "output_final_state", "reverse", "cu_seqlens"], []),
    "chunk_rwkv7": (["r", "w", "k", "v", "a", "b", "scale", "initial_state", "output_final_state",
                     "cu_seqlens", "cu_seqlens_cpu", "safe_gate", "chunk_size", "disable_recompute",
                     "cp_context", "lower_bound"], []),
    "fused_recurrent_rwkv7": (["r", "w", "k", "v", "a", "b", "scale", "initial_state",
                               "output_final_state", "cu_seqlens"], []),
}


def positional(fn):
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]


@pytest.mark.parametrize("op", list(FLA_060))
def test_fla_positional_order_and_keywords(op):
    ours = getattr(fla_ext, op)
    fla_pos, fla_kw = FLA_060[op]
    assert positional(ours)[:len(fla_pos)] == fla_pos
    params = inspect.signature(ours).parameters
    for name in fla_kw:
        assert name in params, f"{op} does not accept fla's keyword {name!r}"


@pytest.mark.parametrize("op", list(FLA_060))
def test_live_fla_signature(op):
    mod = {"gla": "fla.ops.gla", "rwkv6": "fla.ops.rwkv6", "gsa": "fla.ops.gsa",
           "rwkv7": "fla.ops.rwkv7"}[op.split("_")[-1]]
    fla_ops = pytest.importorskip(mod)
    fla_fn = getattr(fla_ops, op)
    fla_pos = positional(fla_fn)
    assert positional(getattr(fla_ext, op))[:len(fla_pos)] == fla_pos


GLA_MODES = {
    "chunk": lambda *a, **kw: fla_ext.chunk_gla(*a, **kw),
    "fused": lambda q, k, v, g, **kw: fla_ext.fused_recurrent_gla(q, k, v, gk=g, **kw),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(GLA_MODES))
def test_state_v_first(device, mode, gen):
    """[N, H, V, K] states in and out (K != V), equal to the [K, V] call transposed, gradients
    included."""
    q, k, v, g, h0 = make_diag(1, 50, 2, 12, 20, torch.float32, device, gen, N=2)
    cu = torch.tensor([0, 17, 50], device=device)
    f = GLA_MODES[mode]
    h0_vk = h0.transpose(-1, -2).contiguous().requires_grad_(True)
    h0_kv = h0.clone().requires_grad_(True)
    o1, ht1 = f(q, k, v, g, initial_state=h0_vk, output_final_state=True, state_v_first=True,
                cu_seqlens=cu)
    o2, ht2 = f(q, k, v, g, initial_state=h0_kv, output_final_state=True, cu_seqlens=cu)
    assert ht1.shape == (2, 2, 20, 12) and ht1.is_contiguous()
    assert_close("o", o1, o2, 1e-6, 1e-7)
    assert_close("ht", ht1, ht2.transpose(-1, -2), 1e-6, 1e-7)
    dht = torch.randn(ht1.shape, generator=gen).to(ht1)
    (o1.sum() + (ht1 * dht).sum()).backward()
    (o2.sum() + (ht2 * dht.transpose(-1, -2)).sum()).backward()
    assert_close("dh0", h0_vk.grad, h0_kv.grad.transpose(-1, -2), 1e-6, 1e-7)


def test_transpose_state_layout_alias(gen):
    q, k, v, g, h0 = make_diag(2, 9, 1, 4, 6, torch.float32, "cpu", gen)
    h0_vk = h0.transpose(-1, -2).contiguous()
    with pytest.warns(DeprecationWarning):
        o1, ht1 = fla_ext.fused_recurrent_gla(q, k, v, g, initial_state=h0_vk, output_final_state=True,
                                              transpose_state_layout=True)
    o2, ht2 = fla_ext.fused_recurrent_gla(q, k, v, g, initial_state=h0_vk, output_final_state=True,
                                          state_v_first=True)
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    torch.testing.assert_close(ht1, ht2, rtol=0, atol=0)
    with pytest.raises(ValueError, match="transpose_state_layout"), pytest.warns(DeprecationWarning):
        fla_ext.fused_recurrent_gla(q, k, v, g, state_v_first=True, transpose_state_layout=True)


def test_transpose_state_layout_warns(gen):
    q, k, v, g, h0 = make_diag(1, 9, 1, 4, 6, torch.float32, "cpu", gen)
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        fla_ext.fused_recurrent_gla(q, k, v, g, transpose_state_layout=False)


@pytest.mark.parametrize("mode", list(GLA_MODES))
def test_state_v_first_shape_error_names_the_callers_layout(mode, gen):
    """A [K, V] state under state_v_first (K != V) is refused with the [V, K] shape it needs; the
    message once named the transposed view, telling the caller to pass what they had passed."""
    q, k, v, g, h0 = make_diag(1, 9, 2, 16, 24, torch.float32, "cpu", gen)
    with pytest.raises(ValueError, match=r"\[N, H, V, K\] = \[N, H, 24, 16\], got \[1, 2, 16, 24\]"):
        GLA_MODES[mode](q, k, v, g, initial_state=h0, state_v_first=True)


def test_fla_hint_values_refused_as_fla_refuses_them(gen):
    """fla's tuning hints have no effect here, but values fla refuses are refused too."""
    q, k, v, g, _ = make_diag(1, 8, 2, 8, 8, torch.float32, "cpu", gen)
    u = torch.randn(2, 8, generator=gen)
    for bad in (0, 48, -64):
        with pytest.raises(ValueError, match="chunk_size"):
            fla_ext.chunk_rwkv6(q, k, v, g, u, chunk_size=bad)
    s = torch.randn(1, 8, 2, 4, generator=gen)
    with pytest.raises(ValueError, match="chunk_size"):
        fla_ext.chunk_gsa(q, k, v, s, chunk_size=48)
    for bad in (-1, 3):
        with pytest.raises(ValueError, match="checkpoint_level"):
            fla_ext.chunk_gsa(q, k, v, s, checkpoint_level=bad)
    a, b = -torch.nn.functional.normalize(k, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    for bad in (0.0, 0.5):
        with pytest.raises(ValueError, match="lower_bound"):
            fla_ext.chunk_rwkv7(q, g, k, v, a, b, lower_bound=bad)
    fla_ext.chunk_rwkv6(q, k, v, g, u, chunk_size=32)  # valid hints run
    fla_ext.chunk_gsa(q, k, v, s, checkpoint_level=0, chunk_size=16)
    fla_ext.chunk_rwkv7(q, g, k, v, a, b, lower_bound=-0.6)


def test_gsa_final_states_are_a_list_as_in_fla(gen):
    q, k, v, _, _ = make_diag(1, 8, 2, 8, 8, torch.float32, "cpu", gen)
    s = torch.randn(1, 8, 2, 4, generator=gen)
    for op in (fla_ext.chunk_gsa, fla_ext.fused_recurrent_gsa):
        o, ht = op(q, k, v, s, output_final_state=True)
        assert isinstance(ht, list) and len(ht) == 2 and all(isinstance(x, torch.Tensor) for x in ht)
        o2, _ = op(q, k, v, s, initial_state=ht)  # passed back as fla's callers do
        assert op(q, k, v, s)[1] == [None, None]


def test_fla_cp_context_is_not_implemented(gen):
    """fla's FLACPContext (local cu_seqlens, no states) is another protocol: NotImplementedError
    naming it; any other object is a TypeError."""
    FLACPContext = type("FLACPContext", (), {"__module__": "fla.ops.cp"})
    q, k, v, g, _ = make_diag(1, 8, 2, 8, 8, torch.float32, "cpu", gen)
    a, b = -torch.nn.functional.normalize(k, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    with pytest.raises(NotImplementedError, match="FLACPContext"):
        fla_ext.chunk_rwkv7(q, g, k, v, a, b, cp_context=FLACPContext())
    with pytest.raises(NotImplementedError, match="FLACPContext"):
        fla_ext.chunk_gla(q, k, v, g, cp_context=FLACPContext())
    with pytest.raises(TypeError, match="build_cp_context"):
        fla_ext.chunk_gla(q, k, v, g, cp_context=object())


def test_fla_positional_calls(gen):
    """Calls written for fla's positional order run with fla's meaning."""
    q, k, v, g, h0 = make_diag(1, 20, 2, 8, 8, torch.float32, "cpu", gen, N=2)
    cu = torch.tensor([0, 5, 20])
    o, ht = fla_ext.chunk_gla(q, k, v, g, 0.5, h0, True, False, cu, cu)
    o_ref, ht_ref = fla_ext.fused_recurrent_gla(q, k, v, g, None, 0.5, h0, True, False, False, cu)
    assert_close("o", o, o_ref, 1e-5, 1e-6)
    assert_close("ht", ht, ht_ref, 1e-5, 1e-6)
    u = torch.randn(2, 8, generator=gen)
    o, _ = fla_ext.chunk_rwkv6(q, k, v, g, u, 0.5, h0, False, cu, cu, chunk_size=64)
    o_ref, _ = fla_ext.fused_recurrent_rwkv6(q, k, v, g, u, 0.5, h0, False, False, cu)
    assert_close("o rwkv6", o, o_ref, 1e-5, 1e-6)
    s = torch.randn(1, 20, 2, 4, generator=gen)
    gs = torch.nn.functional.logsigmoid(torch.randn(1, 20, 2, 4, generator=gen))
    o, _ = fla_ext.chunk_gsa(q, k, v, s, gs, 0.5, None, False, 2, cu, cu)
    o_ref, _ = fla_ext.fused_recurrent_gsa(q, k, v, s, gs, 0.5, None, False, False, cu)
    assert_close("o gsa", o, o_ref, 1e-5, 1e-6)
    # chunk_rwkv7: fla's 16 positional parameters (cu_seqlens_cpu at #10, where head_first was)
    a, b = -torch.nn.functional.normalize(k, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    o, ht = fla_ext.chunk_rwkv7(q, g, k, v, a, b, 1.0, h0, True, cu, cu, False, None, False, None, None)
    o_ref, ht_ref = fla_ext.fused_recurrent_rwkv7(q, g, k, v, a, b, 1.0, h0, True, cu)
    assert_close("o rwkv7", o, o_ref, 1e-5, 1e-6)
    assert_close("ht rwkv7", ht, ht_ref, 1e-5, 1e-6)


def _low_state_calls(op, q, k, v, g, h0, gen):
    """(call(h0) -> (o, final state), the state args) of one fla-compatible op at small shapes."""
    H, K = q.shape[2], q.shape[3]
    if op in ("chunk_gla", "fused_recurrent_gla"):
        f = getattr(fla_ext, op)
        return lambda h: f(q, k, v, g, initial_state=h, output_final_state=True), [h0]
    if op in ("chunk_rwkv6", "fused_recurrent_rwkv6"):
        u = torch.randn(H, K, generator=gen).to(q)
        f = getattr(fla_ext, op)
        return lambda h: f(q, k, v, g, u, initial_state=h, output_final_state=True), [h0]
    if op in ("chunk_rwkv7", "fused_recurrent_rwkv7"):
        kk = torch.nn.functional.normalize(k.float(), dim=-1)
        a, b = (-kk).to(q), (kk * 0.5).to(q)
        f = getattr(fla_ext, op)
        return (lambda h: f(q, g.clamp(min=-5), k, v, a, b, initial_state=h, output_final_state=True),
                [h0])
    M = 4  # GSA: slots, (hk0, hv0)
    s = torch.randn(*q.shape[:3], M, generator=gen).to(q)
    gs = torch.nn.functional.logsigmoid(torch.randn(*q.shape[:3], M, generator=gen)).to(q)
    hk0 = torch.randn(h0.shape[0], H, K, M, generator=gen)
    hv0 = torch.randn(h0.shape[0], H, M, v.shape[-1], generator=gen)
    f = getattr(fla_ext, op)
    return lambda h: f(q, k, v, s, gs, initial_state=tuple(h), output_final_state=True), [hk0, hv0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("op", list(FLA_060))
def test_initial_state_in_input_dtype(op, dtype, gen):
    """fla's ops take an initial state in the inputs' 16-bit dtype (fla's own tests pass one):
    it is lifted to the float32 state exactly, so the outputs equal those of the float32 state,
    and its gradient comes back in its own dtype, equal to the float32 state's gradient rounded."""
    q, k, v, g, h0 = make_diag(1, 20, 2, 8, 8, dtype, "cpu", gen)
    call, states = _low_state_calls(op, q, k, v, g, h0, gen)
    low = [x.to(dtype).requires_grad_(True) for x in states]
    full = [x.to(dtype).float().requires_grad_(True) for x in states]
    o1, ht1 = call(low if len(low) > 1 else low[0])
    o2, ht2 = call(full if len(full) > 1 else full[0])
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    for x, y in zip(ht1 if isinstance(ht1, (tuple, list)) else [ht1], ht2 if isinstance(ht2, (tuple, list)) else [ht2]):
        assert x.dtype == torch.float32
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    loss = lambda o, ht: o.float().sum() + sum(x.sum() for x in (ht if isinstance(ht, (tuple, list)) else [ht]))
    loss(o1, ht1).backward()
    loss(o2, ht2).backward()
    for x, y in zip(low, full):
        assert x.grad.dtype == dtype
        torch.testing.assert_close(x.grad, y.grad.to(dtype), rtol=0, atol=0)


def _rms_ratio(x, ref):
    """fla's assert_close measure: rms of the difference over rms of the reference."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["chunk", "fused"])
@pytest.mark.parametrize("B,T,H,D,gate_logit_normalizer", [
    (1, 15, 2, 60, 1.0), (3, 60, 3, 64, 0.1), (3, 64, 2, 64, 1.0)])
def test_fla_rwkv6_fp16_suite_inputs(device, mode, B, T, H, D, gate_logit_normalizer, gen):
    """fla's own chunk_rwkv6 fp16 test inputs (short sequences, an fp16 initial state, decays up
    to 10x logsigmoid): o, the final state and every gradient against the float64 oracle within
    fla's tolerances (4e-3 for o, 5e-3 for the rest, its rms measure)."""
    from fla_ext import reference
    dt = torch.float16
    draw = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dt)  # noqa: E731
    r, k, v = draw(B, T, H, D), draw(B, T, H, D), draw(B, T, H, D)
    w = (torch.nn.functional.logsigmoid(torch.randn(B, T, H, D, generator=gen)) / gate_logit_normalizer
         ).to(device=device, dtype=dt)
    u, h0, do = draw(H, D), draw(B, H, D, D), draw(B, T, H, D)
    xs = [x.clone().requires_grad_(True) for x in (r, k, v, w, u, h0)]
    op = fla_ext.chunk_rwkv6 if mode == "chunk" else fla_ext.fused_recurrent_rwkv6
    o, ht = op(*xs[:5], initial_state=xs[5], output_final_state=True)
    grads = torch.autograd.grad((o * do).sum(), xs)
    o_ref, ht_ref = reference.rwkv6(r, k, v, w, u, initial_state=h0)
    g_ref = reference.rwkv6_bwd(r, k, v, w, u, do, initial_state=h0)
    assert _rms_ratio(o, o_ref) < 4e-3
    assert _rms_ratio(ht, ht_ref) < 5e-3
    for name, x in zip(["r", "k", "v", "w", "u", "h0"], grads):
        assert x.dtype == dt
        assert _rms_ratio(x, g_ref[name]) < 5e-3, name
