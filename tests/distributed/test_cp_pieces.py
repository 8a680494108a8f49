"""The pieces of fla_ext/cp.py that run on one process: the two-level running sum over long
slices, the reader of a start state through a diagonal-decay pass and its product with the
state (their own backwards), against torch's cumsum, einsum and autograd's numerical gradients
in float64."""
import pytest
import torch

from fla_ext.cp import _SPLIT_ROWS, _DiagReader, _ReadState, _scan_rows


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


@pytest.mark.parametrize("exclusive", [False, True])
def test_diag_reader_gradients(exclusive):
    """Over 256 rows (the blocked scan in the path), fewer rows than the inputs hold."""
    gen = torch.Generator().manual_seed(3)
    rows, T, H, K = 300, 310, 2, 3
    q = torch.randn(1, T, H, K, generator=gen, dtype=torch.float64, requires_grad=True)
    gk = (-0.02 * torch.rand(1, T, H, K, generator=gen, dtype=torch.float64)).requires_grad_(True)
    f = lambda q_, gk_: _DiagReader.apply(q_, gk_, 0.7, exclusive, rows, torch.float64)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, gk), eps=1e-6, atol=1e-7, rtol=1e-6)
    G = gk[0, :rows].cumsum(0)
    if exclusive:
        G = torch.cat([torch.zeros_like(G[:1]), G[:-1]])
    torch.testing.assert_close(f(q, gk), 0.7 * q[0, :rows] * G.exp(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows", [5, 2 * _SPLIT_ROWS + 37])
def test_read_state_gradients(rows):
    """Both sides of the row split of the state's gradient."""
    gen = torch.Generator().manual_seed(4)
    reader = torch.randn(rows, 2, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    state = torch.randn(2, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_ReadState.apply, (reader, state), eps=1e-6, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(_ReadState.apply(reader, state),
                               torch.einsum("thk,hkv->thv", reader, state), rtol=1e-12, atol=1e-12)
