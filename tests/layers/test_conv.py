"""ShortConvolution (fla's causal depthwise conv): against a float64 loop, varlen equal to each
sequence alone, decoding with the cache equal to one full forward, fla's cache layout [N, D, W],
and clear errors for bad arguments."""
import pytest
import torch

from conftest import DEVICES, TOL, assert_close
from fla_ext.layers.conv import ShortConvolution


def conv(D=24, W=4, bias=True, activation="silu", device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    c = ShortConvolution(D, W, bias=bias, activation=activation)
    if bias:
        with torch.no_grad():
            c.bias.normal_()
    return c.to(device=device, dtype=dtype)


def loop_reference(c, x, cache=None):
    """One sequence x [T, D] in float64, token by token: the window is the last W inputs (the
    cache [D, W] before the first token). Returns (y [T, D], final cache [D, W])."""
    W = c.kernel_size[0]
    w = c.weight[:, 0].double()
    window = cache.double().clone() if cache is not None else x.new_zeros(x.shape[1], W).double()
    ys = []
    for t in range(x.shape[0]):
        window = torch.cat([window[:, 1:], x[t, :, None].double()], 1)
        y = (window * w).sum(1) + (c.bias.double() if c.bias is not None else 0)
        ys.append(y * torch.sigmoid(y) if c.activation else y)
    return torch.stack(ys) if ys else window.new_zeros(0, x.shape[1]), window


def test_parameters_match_fla():
    c = conv(D=24, W=3, bias=True)
    assert isinstance(c, torch.nn.Conv1d) and c.groups == 24
    shapes = {n: tuple(p.shape) for n, p in c.named_parameters()}
    assert shapes == {"weight": (24, 1, 3), "bias": (24,)}
    assert [n for n, _ in conv(bias=False).named_parameters()] == ["weight"]
    assert c.state_size == 24 * 3 and c.activation == "silu"
    assert ShortConvolution(8, 4, activation="swish").activation == "swish"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("bias,activation", [(True, "silu"), (False, None)])
@pytest.mark.parametrize("with_cache", [False, True], ids=["zeros", "cache"])
def test_matches_float64_loop(device, dtype, W, bias, activation, with_cache):
    c = conv(W=W, bias=bias, activation=activation, device=device, dtype=dtype)
    x = torch.randn(3, 37, 24, device=device, dtype=dtype)
    cache = torch.randn(3, 24, W, device=device, dtype=dtype) if with_cache else None
    y, state = c(x, cache=cache, output_final_state=True)
    assert y.dtype == dtype and state.dtype == dtype and state.shape == (3, 24, W)
    tol, _, atol = TOL[dtype]
    for b in range(3):
        ref_y, ref_state = loop_reference(c, x[b], cache[b] if with_cache else None)
        assert_close("y", y[b], ref_y, tol, atol)
        assert torch.equal(state[b].double().cpu(), ref_state.cpu())  # inputs moved, not computed
    assert c(x, cache=cache)[1] is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_cache", [False, True], ids=["zeros", "cache"])
def test_varlen_is_each_sequence_alone(device, with_cache):
    """Lengths 9, 0 (empty: keeps its cache), 2 (< W - 1: the window reaches into the cache), 1
    and 30: nothing leaks from one sequence into the next."""
    c = conv(device=device)
    lens = [9, 0, 2, 1, 30]
    cu = torch.tensor([0] + lens, device=device).cumsum(0)
    x = torch.randn(1, sum(lens), 24, device=device)
    cache = torch.randn(len(lens), 24, 4, device=device) if with_cache else None
    y, state = c(x, cache=cache, output_final_state=True, cu_seqlens=cu)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone, alone_state = c(x[:, a:b], cache=cache[n:n + 1] if with_cache else None,
                               output_final_state=True)
        torch.testing.assert_close(y[:, a:b], alone, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state[n:n + 1], alone_state, rtol=0, atol=0)
        ref_y, ref_state = loop_reference(c, x[0, a:b], cache[n] if with_cache else None)
        assert_close("y", y[0, a:b], ref_y, 1e-5, 1e-6)
    if with_cache:
        assert torch.equal(state[1], cache[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_decoding_with_cache_matches_full_forward(device, varlen):
    """A 7-token prompt, then token by token (the single-step path), then a piece of 5, with
    and without autograd: equal to one forward over everything (fp32 <= 1e-5), same final cache."""
    c = conv(device=device)
    x = torch.randn(2, 20, 24, device=device)
    full, full_state = c(x, output_final_state=True)

    def run(piece, cache):
        if not varlen:
            return c(piece, cache=cache, output_final_state=True)
        T = piece.shape[1]
        cu = torch.arange(3, device=device) * T
        y, cache = c(piece.reshape(1, 2 * T, 24), cache=cache, output_final_state=True,
                     cu_seqlens=cu)
        return y.view(2, T, 24), cache

    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            y, cache = run(x[:, :7], None)
            outs = [y]
            for t in range(7, 15):
                y, cache = run(x[:, t:t + 1], cache)
                outs.append(y)
            y, cache = run(x[:, 15:], cache)
            outs.append(y)
        torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache, full_state, rtol=0, atol=0)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_gradcheck(varlen):
    c = conv(D=3, W=3, device="cpu", dtype=torch.float64)
    x = torch.randn(1 if varlen else 2, 5, 3, dtype=torch.float64, requires_grad=True)
    cache = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 2, 5]) if varlen else None

    def f(x, cache, w, b, cu=cu):
        return torch.func.functional_call(c, {"weight": w, "bias": b}, (x,), dict(
            cache=cache, output_final_state=True, cu_seqlens=cu))

    w = c.weight.detach().clone().requires_grad_()
    b = c.bias.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (x, cache, w, b))
    step = torch.randn(2, 1, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: f(*a, cu=None), (step, cache, w, b))  # one token


def test_mask_residual_and_inputs_unchanged():
    c = conv()
    x = torch.randn(2, 10, 24)
    r = torch.randn(2, 10, 24)
    cache = torch.randn(2, 24, 4)
    mask = (torch.arange(10) >= torch.tensor([[3], [0]])).long()
    x0, cache0 = x.clone(), cache.clone()
    y, state = c(x, residual=r, mask=mask, cache=cache, output_final_state=True)
    ref, ref_state = c(x * mask[..., None], cache=cache, output_final_state=True)
    torch.testing.assert_close(y, ref + r, rtol=0, atol=0)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0)
    with torch.no_grad():
        c(x[:, :1], cache=cache, output_final_state=True)  # fla updates this cache in place
    assert torch.equal(x, x0) and torch.equal(cache, cache0)
    y4, _ = c(x.view(2, 10, 4, 6))  # [B, T, H, d] flattens to D (as fla)
    assert y4.shape == (2, 10, 4, 6)
    torch.testing.assert_close(y4.flatten(2), c(x)[0], rtol=0, atol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="activation"):
        ShortConvolution(8, 4, activation="relu")
    with pytest.raises(ValueError, match="kernel_size"):
        ShortConvolution(8, 0)
    c = conv(D=8, W=4)
    with pytest.raises(ValueError, match="hidden_size 8"):
        c(torch.randn(1, 5, 6))
    with pytest.raises(ValueError, match=r"\[B, T, D\]"):
        c(torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"cache must be \[N, D, W\] = \(2, 8, 4\)"):
        c(torch.randn(2, 5, 8), cache=torch.randn(2, 8, 3))
    with pytest.raises(ValueError, match="B = 1"):
        c(torch.randn(2, 5, 8), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="1-D integer"):
        c(torch.randn(1, 5, 8), cu_seqlens=torch.tensor([0.0, 5.0]))
    with pytest.raises(ValueError, match="not both"):
        c(torch.randn(1, 5, 8), mask=torch.ones(1, 5), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"mask must be \[B, T\]"):
        c(torch.randn(2, 5, 8), mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match=r"cache must be \[N, D, W\] = \(3, 8, 4\)"):
        c(torch.randn(1, 5, 8), cache=torch.randn(2, 8, 4), cu_seqlens=torch.tensor([0, 1, 2, 5]))
