"""fla_ext.models.losses: the chunked linear cross-entropy and the cross-entropy over logits
against the plain form (full float32 logits, F.cross_entropy, L2Wrap), forward and gradients,
with ignored labels, several chunks, "sum" and a scaled loss; L2Wrap's gradient as fla 0.6.0's
l2_warp (scaled by the loss's gradient)."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
from fla_ext.models.losses import L2Wrap, chunked_cross_entropy, cross_entropy, default_chunk_rows, l2_warp  # noqa: E402


def plain(hidden, weight, labels, l2wrap, reduction="mean"):
    logits = F.linear(hidden, weight).to(torch.promote_types(hidden.dtype, torch.float32))
    loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction=reduction)
    return L2Wrap.apply(loss, logits) if l2wrap else loss


@pytest.mark.parametrize("l2wrap", [False, True])
@pytest.mark.parametrize("chunk_rows", [7, 64, None])
@pytest.mark.parametrize("scale", [1.0, 3.0])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_equals_plain(l2wrap, chunk_rows, scale, reduction):
    torch.manual_seed(0)
    rows, hid, vocab = 50, 24, 97
    h = torch.randn(rows, hid, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, hid, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, vocab, (rows,))
    y[::5] = -100
    h0, w0 = h.detach().clone(), w.detach().clone()
    ref = plain(h, w, y, l2wrap, reduction)
    (scale * ref).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    got = chunked_cross_entropy(h, w, y, chunk_rows=chunk_rows, l2wrap=l2wrap, reduction=reduction)
    (scale * got).backward()
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, gh, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(w.grad, gw, rtol=1e-10, atol=1e-14)
    assert torch.equal(h.detach(), h0) and torch.equal(w.detach(), w0)  # inputs unchanged


def test_l2wrap_weight_is_over_all_rows_not_a_chunk():
    """The first form checkpointed L2Wrap per chunk, so its weight was 1e-4 / (a chunk's rows),
    not 1e-4 / (all rows): with several chunks the logits' pull was (chunks) times too strong."""
    torch.manual_seed(1)
    h = torch.randn(40, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, dtype=torch.float64)
    y = torch.full((40,), -100)  # no label: only L2Wrap's gradient is left
    chunked_cross_entropy(h, w, y, chunk_rows=10, l2wrap=True).backward()
    logits = h.detach() @ w.t()
    top, idx = logits.max(-1)
    expected = (1e-4 / 40) * top.unsqueeze(-1) * w[idx]
    torch.testing.assert_close(h.grad, expected, rtol=1e-9, atol=1e-15)


def test_no_grad_and_all_ignored():
    h, w = torch.randn(9, 4), torch.randn(5, 4)
    with torch.no_grad():
        ref = F.cross_entropy(h @ w.t(), torch.arange(9) % 5)
        torch.testing.assert_close(chunked_cross_entropy(h, w, torch.arange(9) % 5, chunk_rows=4), ref)
    assert chunked_cross_entropy(h, w, torch.full((9,), -100)).item() == 0.0
    assert default_chunk_rows(50304) * 50304 <= 1 << 26


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="labels"):
        chunked_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_rows"):
        chunked_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.long), chunk_rows=-1)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(torch.randn(4, 3), torch.zeros(4, dtype=torch.long), reduction="none")


def test_l2wrap_gradient_is_fla_s():
    """fla 0.6.0's l2_warp: each row's top logit gets 1e-4 / (B T) x itself x the loss's
    gradient (RWKV-LM's original ignores the loss's gradient: under loss scaling or gradient
    accumulation its pull was off by that factor)."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    loss = torch.zeros((), dtype=torch.float64, requires_grad=True)
    (0.25 * l2_warp(loss, logits)).backward()
    top, idx = logits.detach().max(-1, keepdim=True)
    expected = torch.zeros_like(logits).scatter_(-1, idx, 0.25 * 1e-4 / 10 * top)
    torch.testing.assert_close(logits.grad, expected, rtol=1e-12, atol=0)
    assert loss.grad.item() == 0.25


@pytest.mark.parametrize("l2wrap", [False, True])
@pytest.mark.parametrize("chunk_rows", [7, None])
@pytest.mark.parametrize("scale", [1.0, 3.0])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_logits_cross_entropy_equals_plain(l2wrap, chunk_rows, scale, reduction):
    """cross_entropy over given logits (the models' loss when logits are returned) against
    F.cross_entropy + L2Wrap on the same logits; the logits are left unchanged (the backward
    makes the softmax in place of a float32 chunk, which must be a copy for float32 logits)."""
    torch.manual_seed(2)
    rows, vocab = 45, 31
    x = torch.randn(rows, vocab, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, vocab, (rows,))
    y[1::4] = -100
    x0 = x.detach().clone()
    ref = F.cross_entropy(x, y, ignore_index=-100, reduction=reduction)
    ref = L2Wrap.apply(ref, x) if l2wrap else ref
    (scale * ref).backward()
    gx = x.grad.clone()
    x.grad = None
    got = cross_entropy(x, y, chunk_rows=chunk_rows, l2wrap=l2wrap, reduction=reduction)
    (scale * got).backward()
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, gx, rtol=1e-10, atol=1e-14)
    assert torch.equal(x.detach(), x0)
    with pytest.raises(ValueError, match="labels"):
        cross_entropy(x, y[:-1])
