"""The pieces of fla_ext/cp.py that run on one process: the two-level running sum over long
slices and the blocked readout of a start state through a diagonal-decay pass (its own
backward), against torch's cumsum, the formula and autograd's numerical gradients in float64."""
import pytest
import torch

from fla_ext import cp
from fla_ext.cp import _scan_rows


@pytest.mark.parametrize("rows", [1, 255, 256, 257, 1000])
def test_scan_rows_equals_cumsum(rows):
    x = torch.randn(rows, 3, 5, dtype=torch.float64)
    torch.testing.assert_close(_scan_rows(x), x.cumsum(0), rtol=1e-12, atol=1e-12)


def test_scan_rows_keeps_minus_inf_without_nan():
    x = torch.randn(600, 2, dtype=torch.float64)
    x[10, 0] = x[300, 1] = -torch.inf
    y = _scan_rows(x)
    assert not torch.isnan(y).any()
    assert torch.equal(torch.isinf(y), torch.isinf(x.cumsum(0)))


def _reference(x, q, gk, gv, state, scale, exclusive):
    rows = x.shape[1]
    r = scale * q[0, :rows]
    if gk is not None:
        G = gk[0, :rows].cumsum(0)
        if exclusive:
            G = torch.cat([torch.zeros_like(G[:1]), G[:-1]])
        r = r * G.exp()
    y = torch.einsum("thk,hkv->thv", r, state)
    if gv is not None:
        y = y * gv[0, :rows].cumsum(0).exp()
    return x + y.unsqueeze(0)


@pytest.mark.parametrize("exclusive", [False, True])
@pytest.mark.parametrize("decays", ["gk", "gv", "both", "none"])
@pytest.mark.parametrize("block", [7, 1 << 16])
@pytest.mark.parametrize("split", [4, 1024])
def test_readout_values_and_gradients(monkeypatch, exclusive, decays, block, split):
    """Over several blocks of rows (7 rows each: carries across blocks) and one, the state's
    gradient over 4-row pieces and whole, fewer rows than the inputs hold, against the formula and
    autograd's numerical gradients (float64)."""
    monkeypatch.setattr(cp, "_READ_ROWS", block)
    monkeypatch.setattr(cp, "_SPLIT_ROWS", split)
    gen = torch.Generator().manual_seed(3)
    rows, T, H, K, V = 30, 33, 2, 3, 4
    f64 = dict(dtype=torch.float64)
    x = torch.randn(1, rows, H, V, generator=gen, **f64, requires_grad=True)
    q = torch.randn(1, T, H, K, generator=gen, **f64, requires_grad=True)
    gk = (-0.3 * torch.rand(1, T, H, K, generator=gen, **f64)).requires_grad_(decays in ("gk", "both"))
    gv = (-0.3 * torch.rand(1, T, H, V, generator=gen, **f64)).requires_grad_(decays in ("gv", "both"))
    gk, gv = (gk if decays in ("gk", "both") else None), (gv if decays in ("gv", "both") else None)
    state = torch.randn(H, K, V, generator=gen, **f64, requires_grad=True)
    ins = [t for t in (x, q, gk, gv, state) if t is not None]

    def f(*a):
        it = iter(a)
        x_, q_ = next(it), next(it)
        gk_ = next(it) if gk is not None else None
        gv_ = next(it) if gv is not None else None
        return cp.readout(x_, q_[:, :rows], None if gk_ is None else gk_[:, :rows],
                          None if gv_ is None else gv_[:, :rows], next(it), 0.7, exclusive)
    torch.testing.assert_close(f(*ins), _reference(x, q, gk, gv, state, 0.7, exclusive), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(f, ins, eps=1e-6, atol=1e-7, rtol=1e-6)


def test_readout_minus_inf_decays_stay_finite(monkeypatch):
    """A -inf log decay (a reset) zeroes what the state adds from that row on, in every block
    after it, with finite gradients (no exp of a positive sum, no inf - inf)."""
    monkeypatch.setattr(cp, "_READ_ROWS", 5)
    gen = torch.Generator().manual_seed(4)
    x = torch.zeros(1, 20, 1, 2, dtype=torch.float64, requires_grad=True)
    q = torch.randn(1, 20, 1, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    gk = -torch.rand(1, 20, 1, 3, generator=gen, dtype=torch.float64)
    gk[0, 6, 0, 1] = -torch.inf
    gk.requires_grad_(True)
    state = torch.randn(1, 3, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    for exclusive in (False, True):
        y = cp.readout(x, q, gk, None, state, 1.0, exclusive)
        torch.testing.assert_close(y, _reference(x, q, gk, None, state, 1.0, exclusive), rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad(y.sum(), (x, q, gk, state))
        assert all(torch.isfinite(t).all() for t in grads)


def test_readout_keeps_its_inputs_dtype_and_bf16_rounds_once():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 9, 2, 4, generator=gen).bfloat16()
    q = torch.randn(1, 9, 2, 3, generator=gen).bfloat16()
    state = torch.randn(2, 3, 4, generator=gen)
    y = cp.readout(x, q, None, None, state, 0.5)
    assert y.dtype == torch.bfloat16
    ref = (x.float() + torch.einsum("thk,hkv->thv", 0.5 * q[0].float(), state)).bfloat16()
    assert torch.equal(y, ref)
