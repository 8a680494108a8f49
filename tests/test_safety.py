"""No input corrupts memory or returns garbage silently: malformed cu_seqlens raise (CPU always;
CUDA with its host copy or value checks), empty inputs give the exact state pass-through, a
double backward raises naming the op, value checks name the user's argument, and the check
switch takes only the values it documents. Every public op, through tests/support/safety_cases.py."""
import os

import pytest
import torch

import fla_ext
from conftest import DEVICES, HAS_CUDA
from safety_cases import OPS, OPS_BY_NAME, final_states, initial_state

OP_IDS = [c.name for c in OPS]

# (cu_seqlens over T = 10 rows, the message): past the end, huge, negative, short, not from 0,
# decreasing.
BAD_CU = [
    ([0, 4, 12], r"`cu_seqlens\[-1\]` must equal the number of rows T = 10, got 12"),
    ([0, 4, 2 ** 40], r"`cu_seqlens\[-1\]` must equal the number of rows T = 10"),
    ([0, -5, 10], r"`cu_seqlens` must be non-decreasing"),
    ([0, 4, 8], r"`cu_seqlens\[-1\]` must equal the number of rows T = 10, got 8"),
    ([2, 4, 10], r"`cu_seqlens\[0\]` must be 0, got 2"),
    ([0, 6, 4, 10], r"cu_seqlens\[2\] = 4 < cu_seqlens\[1\] = 6"),
]


@pytest.fixture
def checks_off(monkeypatch):
    monkeypatch.delenv("FLA_EXT_CHECKS", raising=False)


@pytest.mark.parametrize("op", OP_IDS)
@pytest.mark.parametrize("cu,msg", BAD_CU, ids=[str(c[0]) for c in BAD_CU])
def test_malformed_cu_seqlens_on_cpu_raise(op, cu, msg, gen, checks_off):
    case = OPS_BY_NAME[op]
    x = case.make(1, 10, 2, "cpu", gen)
    with pytest.raises(ValueError, match=msg):
        case.call(x, cu_seqlens=torch.tensor(cu))


@pytest.mark.parametrize("op", OP_IDS)
def test_malformed_cu_seqlens_cpu_copy_raises(op, gen, checks_off):
    """fla's cu_seqlens_cpu is checked in place of the (here CPU, on the GPU: device) tensor."""
    case = OPS_BY_NAME[op]
    x = case.make(1, 10, 2, "cpu", gen)
    with pytest.raises(ValueError, match=r"`cu_seqlens_cpu\[-1\]` must equal"):
        case.call(x, cu_seqlens=torch.tensor([0, 4, 10]), cu_seqlens_cpu=torch.tensor([0, 4, 12]))
    with pytest.raises(ValueError, match=r"`cu_seqlens_cpu` has shape \[4\] but `cu_seqlens`"):
        case.call(x, cu_seqlens=torch.tensor([0, 4, 10]),
                  cu_seqlens_cpu=torch.tensor([0, 4, 6, 10]))
    with pytest.raises(ValueError, match=r"`cu_seqlens_cpu` was given without `cu_seqlens`"):
        case.call(x, cu_seqlens_cpu=torch.tensor([0, 4, 10]))
    o, _ = case.call(x, cu_seqlens=torch.tensor([0, 4, 10]),
                     cu_seqlens_cpu=torch.tensor([0, 4, 10]))
    assert torch.isfinite(o).all()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("op", OP_IDS)
def test_malformed_cu_seqlens_on_cuda(op, gen, monkeypatch):
    """Unchecked on the GPU (no host copy, checks off) a malformed cu_seqlens must stay inside the
    tensors (clamped by the kernels; compute-sanitizer proves it: `make sanitize`), forward and
    backward; with its host copy, or with the checks on, it raises before any kernel runs."""
    case = OPS_BY_NAME[op]
    monkeypatch.delenv("FLA_EXT_CHECKS", raising=False)
    for cu, msg in BAD_CU:
        x = case.make(1, 10, 2, "cuda", gen)
        for t in x.values():
            t.requires_grad_(True)
        o, _ = case.call(x, cu_seqlens=torch.tensor(cu, device="cuda"))
        o.float().sum().backward()
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match=msg.replace("cu_seqlens", "cu_seqlens_cpu")):
            case.call(x, cu_seqlens=torch.tensor(cu, device="cuda"),
                      cu_seqlens_cpu=torch.tensor(cu))
        fla_ext.set_checks(True)
        try:
            with pytest.raises(ValueError, match=msg):
                case.call(x, cu_seqlens=torch.tensor(cu, device="cuda"))
        finally:
            fla_ext.set_checks(False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OP_IDS)
@pytest.mark.parametrize("B,T,H,cu", [(2, 0, 2, None), (1, 0, 2, [0, 0, 0]), (0, 5, 2, None),
                                      (2, 5, 0, None), (1, 5, 2, [0, 0, 5, 5])],
                         ids=["T0", "T0-varlen", "B0", "H0", "empty-seqs"])
def test_empty_inputs(op, B, T, H, cu, device, gen):
    """Without rows the final state is the initial one and its gradient the final state's
    (the fused RWKV7 backward once returned uninitialised dh0 at T = 0); empty sequences among
    full ones are passed through the same way; nothing is non-finite."""
    case = OPS_BY_NAME[op]
    if op.endswith("gsa") and H == 0:
        pytest.skip("GSA needs a head (its query heads are a multiple of the key heads)")
    x = case.make(B, T, H, device, gen)
    N = B if cu is None else len(cu) - 1
    h0 = initial_state(case, N, H, device, gen)
    h0s = h0 if isinstance(h0, tuple) else (h0,)
    for t in list(x.values()) + list(h0s):
        t.requires_grad_(True)
    kw = dict(initial_state=h0, output_final_state=True)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, device=device)
    o, ht = case.call(x, **kw)
    hts = final_states(case, (o, ht))
    dhts = [torch.randn(h.shape, generator=gen).to(device) for h in hts]
    loss = (o.float() * 0.5).sum() + sum((h * d).sum() for h, d in zip(hts, dhts))
    grads = torch.autograd.grad(loss, list(x.values()) + list(h0s), allow_unused=True)
    for gr in grads:
        assert gr is None or torch.isfinite(gr).all()
    if T == 0:
        for h, h_in in zip(hts, h0s):
            torch.testing.assert_close(h, h_in, rtol=0, atol=0)
        for dh0, dht in zip(grads[len(x):], dhts):
            torch.testing.assert_close(dh0, dht, rtol=0, atol=0)
    if cu == [0, 0, 5, 5]:  # sequences 0 and 2 are empty
        for h, h_in, dh0, dht in zip(hts, h0s, grads[len(x):], dhts):
            for n in (0, 2):
                torch.testing.assert_close(h[n], h_in[n], rtol=0, atol=0)
                torch.testing.assert_close(dh0[n], dht[n], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OP_IDS)
def test_double_backward_raises(op, device, gen):
    """Gradients taken with create_graph=True exist, and differentiating them again raises an
    error naming the op (it once returned None / zeros for the second-order terms)."""
    case = OPS_BY_NAME[op]
    x = case.make(2, 5, 2, device, gen)
    for t in x.values():
        t.requires_grad_(True)
    o, _ = case.call(x)
    first = torch.autograd.grad(o.float().square().sum(), list(x.values()), create_graph=True)
    base = "gla" if op == "fused_recurrent_gsa" else op.replace("fused_mul_", "fused_")
    with pytest.raises(RuntimeError, match=f"fla_ext: \\w*{base.split('_')[-1]}\\w* has no double backward"):
        torch.autograd.grad(sum(g.float().square().sum() for g in first), list(x.values()))
    # Without create_graph the first-order gradients are plain tensors, as before.
    again = torch.autograd.grad(case.call(x)[0].float().square().sum(), list(x.values()))
    for a, b in zip(again, first):
        torch.testing.assert_close(a, b.detach())
        assert not a.requires_grad


@pytest.mark.parametrize("value,enabled", [("0", False), ("1", True), ("true", True),
                                           ("False", False), ("ON", True), ("off", False),
                                           ("yes", True), ("no", False), ("", False)])
def test_checks_switch_values(value, enabled, monkeypatch, gen):
    monkeypatch.setenv("FLA_EXT_CHECKS", value)
    assert fla_ext.checks.checks_enabled() is enabled
    case = OPS_BY_NAME["chunk_gla"]
    x = case.make(1, 4, 1, "cpu", gen)
    x["q"][0, 1, 0, 0] = float("nan")
    if enabled:
        with pytest.raises(ValueError, match=r"`q` has a non-finite value at index \(0, 1, 0, 0\)"):
            case.call(x)
    else:
        case.call(x)  # NaN in, NaN out: no check


@pytest.mark.parametrize("value", ["2", "maybe", "false!", "none"])
def test_checks_switch_rejects_other_values(value, monkeypatch, gen):
    monkeypatch.setenv("FLA_EXT_CHECKS", value)
    with pytest.raises(ValueError, match="FLA_EXT_CHECKS must be one of"):
        fla_ext.checks.checks_enabled()
    case = OPS_BY_NAME["chunk_rwkv6"]
    with pytest.raises(ValueError, match="FLA_EXT_CHECKS must be one of"):
        case.call(case.make(1, 4, 1, "cpu", gen))


@pytest.mark.parametrize("value", ["False", "0", 1, None])
def test_set_checks_takes_a_bool(value, monkeypatch):
    monkeypatch.delenv("FLA_EXT_CHECKS", raising=False)
    with pytest.raises(TypeError, match="set_checks takes a bool"):
        fla_ext.set_checks(value)
    assert "FLA_EXT_CHECKS" not in os.environ
    fla_ext.set_checks(True)
    assert fla_ext.checks.checks_enabled()
    fla_ext.set_checks(False)
    assert not fla_ext.checks.checks_enabled()


# (op, the input poisoned, its index or None for a state, the name the error must carry)
VALUE_NAMES = [
    ("chunk_gsa", "g", r"`g` has a NaN"),
    ("chunk_gsa", "s", r"`s` has a non-finite"),
    ("chunk_gsa", "v", r"`v` has a non-finite"),
    ("fused_recurrent_gsa", "g", r"`g` has a NaN"),
    ("fused_recurrent_gsa", "s", r"`s` has a non-finite"),
    ("fused_recurrent_gsa", "q", r"`q` has a non-finite"),
    ("fused_mul_recurrent_rwkv7", "kk", r"`kk` has a non-finite"),
    ("fused_mul_recurrent_rwkv7", "a", r"`a` has a non-finite"),
    ("chunk_gsa", "hk0", r"`initial_state\[0\] \(hk0\)` has a non-finite"),
    ("chunk_gsa", "hv0", r"`initial_state\[1\] \(hv0\)` has a non-finite"),
    ("fused_recurrent_gsa", "hv0", r"`initial_state\[1\] \(hv0\)` has a non-finite"),
]


@pytest.mark.parametrize("op,name,msg", VALUE_NAMES, ids=[f"{o}-{n}" for o, n, _ in VALUE_NAMES])
def test_value_checks_name_the_argument(op, name, msg, monkeypatch, gen):
    """With checks on, a NaN names the user's argument (not an internal tensor such as GSA's `p`,
    its pass-1 `gv` or the `a` that fused_mul_recurrent_rwkv7 forms from `kk`)."""
    monkeypatch.setenv("FLA_EXT_CHECKS", "1")
    case = OPS_BY_NAME[op]
    x = case.make(1, 6, 2, "cpu", gen)
    h0 = initial_state(case, 1, 2, "cpu", gen)
    if name in ("hk0", "hv0"):
        h0[0 if name == "hk0" else 1][0, 1, 0, 0] = float("nan")
    else:
        x[name][0, 3, 1, 0] = float("nan")
    with pytest.raises(ValueError, match=msg):
        case.call(x, initial_state=h0)


RAW_NONE = [
    ("fused_recurrent_rwkv6", 0, "r"), ("chunk_rwkv6", 0, "r"), ("fused_recurrent_gla", 0, "q"),
    ("chunk_gla", 0, "q"), ("fused_recurrent_rwkv7", 0, "r"), ("chunk_rwkv7", 0, "r"),
    ("chunk_gsa", 0, "q"), ("fused_recurrent_gsa", 0, "q"), ("chunk_rwkv6", 1, "k"),
    ("fused_recurrent_rwkv7", 5, "b"),
]


@pytest.mark.parametrize("op,pos,name", RAW_NONE, ids=[f"{o}-{n}" for o, _, n in RAW_NONE])
def test_raw_op_none_names_the_argument(op, pos, name, gen):
    """torch.ops.fla.* with None for a required tensor: an error naming it (it once said 'tensor
    does not have a device')."""
    case = OPS_BY_NAME[op]
    x = case.make(1, 4, 1, "cpu", gen)
    args = list(x.values())
    args[pos] = None
    with pytest.raises(ValueError, match=f"`{name}` must be a tensor, got None"):
        getattr(torch.ops.fla, op)(*args)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_workspace_on_another_device_names_it(gen):
    """A kept workspace on the GPU among CPU inputs, even an empty one, would send the call to
    the CUDA kernels with host pointers: it is an error naming the argument."""
    x = OPS_BY_NAME["chunk_gla"].make(2, 5, 2, "cpu", gen)
    go = torch.randn_like(x["v"])
    empty = torch.empty(0, device="cuda")
    with pytest.raises(RuntimeError, match=r"`hst` is on cuda:0 but the inputs are on cpu"):
        torch.ops.fla.chunk_gla_bwd(x["q"], x["k"], x["v"], x["g"], None, go, None, None, None,
                                    None, False, empty, None)
    y = OPS_BY_NAME["chunk_rwkv7"].make(2, 5, 2, "cpu", gen)
    with pytest.raises(RuntimeError, match=r"`saved` is on cuda:0 but the inputs are on cpu"):
        torch.ops.fla.chunk_rwkv7_bwd(*y.values(), torch.randn_like(y["v"]), None, 1.0, None,
                                      None, False, empty)
