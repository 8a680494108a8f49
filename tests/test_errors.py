"""Bad input: a clear error naming the argument, raised before any kernel runs."""
import math

import pytest
import torch

import fla_ext
from conftest import DEVICES
from fla_ext import chunk_gla, chunk_rwkv6, fused_recurrent_rwkv6

# Both RWKV6 modes share the argument checks; each must run them (and name the argument).
RWKV6_OPS = [pytest.param(fused_recurrent_rwkv6, id="fused"), pytest.param(chunk_rwkv6, id="chunk")]


def good(device="cpu", B=2, T=5, H=2, K=4, V=6, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    return dict(r=mk(B, T, H, K), k=mk(B, T, H, K), v=mk(B, T, H, V),
                w=-torch.rand(B, T, H, K, generator=g).to(device, dtype), u=mk(H, K))


def call(op=fused_recurrent_rwkv6, **kw):
    args = good()
    extra = {n: kw.pop(n) for n in list(kw) if n not in args}
    args.update(kw)
    return op(args["r"], args["k"], args["v"], args["w"], args["u"], **extra)


CASES = [
    (dict(r=torch.randn(2, 5, 2)), ValueError, r"`r` must be 4-D"),
    (dict(k=torch.randn(2, 5, 2, 3)), ValueError, r"`k` must have the shape of `r`"),
    (dict(w=torch.randn(2, 5, 2, 3)), ValueError, r"`w` must have the shape of `r`"),
    (dict(v=torch.randn(2, 4, 2, 6)), ValueError, r"`v` must be \[B, T, H, D\]"),
    (dict(u=torch.randn(3, 4)), ValueError, r"`u` must have shape \[H, K\] = \[2, 4\]"),
    (dict(v=torch.randn(2, 5, 2, 6, dtype=torch.float64)), ValueError, r"`v` has dtype Double but `r`"),
    (dict(r=torch.randint(0, 3, (2, 5, 2, 4))), ValueError, r"`r` must be float32, bfloat16 or float16"),
    (dict(r=torch.randn(2, 5, 2, 520), k=torch.randn(2, 5, 2, 520), w=-torch.rand(2, 5, 2, 520),
          u=torch.randn(2, 520)), ValueError, r"K \(last dim of r, k, w, u\) must be in \[1, 512\]"),
    (dict(initial_state=torch.randn(2, 2, 4, 5)), ValueError, r"`initial_state` must have shape \[N, H, K, V\] = \[2, 2, 4, 6\]"),
    (dict(initial_state=torch.randn(2, 2, 4, 6, dtype=torch.float64)), ValueError, r"`initial_state` must be Float"),
    (dict(cu_seqlens=torch.tensor([0, 5])), ValueError, r"batch size must be 1, got B = 2"),
    (dict(cu_seqlens=torch.tensor([0.0, 5.0])), ValueError, r"`cu_seqlens` must be int64"),
    (dict(cu_seqlens=torch.tensor([[0, 5]])), ValueError, r"`cu_seqlens` must be 1-D"),
    (dict(scale=math.nan), ValueError, r"`scale` must be finite"),
    (dict(u=None), TypeError, r"`u` must be a torch.Tensor, got NoneType"),
]


@pytest.mark.parametrize("op", RWKV6_OPS)
@pytest.mark.parametrize("kw,exc,msg", CASES, ids=[c[2][:30] for c in CASES])
def test_bad_input(op, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        call(op, **kw)


def call_gla(**kw):
    a = good()
    args = dict(q=a["r"], k=a["k"], v=a["v"], g=a["w"])
    args.update(kw)
    return chunk_gla(**args)


GLA_CASES = [
    (dict(g=0.5), TypeError, r"`g` must be a torch.Tensor or None, got float"),
    (dict(g=-torch.rand(2, 5, 2, 3)), ValueError, r"`g` must have the shape of `q`"),
    # gv is over V (= 6 here), not K: the value-side decay
    (dict(gv=-torch.rand(2, 5, 2, 4)), ValueError, r"`gv` must have the shape of `v` \[2, 5, 2, 6\]"),
    (dict(g=None, gv=-torch.rand(2, 5, 2, 4)), ValueError, r"`gv` must have the shape of `v`"),
    (dict(gv=-torch.rand(2, 5, 2, 6, dtype=torch.float64)), ValueError, r"`gv` has dtype Double but `v` has dtype Float"),
    (dict(gv=-torch.rand(2, 5, 6)), ValueError, r"`gv` must be 4-D"),
    (dict(gv=[0.0]), TypeError, r"`gv` must be a torch.Tensor or None, got list"),
    (dict(q=torch.randn(2, 5, 2, 520), k=torch.randn(2, 5, 2, 520), g=-torch.rand(2, 5, 2, 520)),
     ValueError, r"K \(last dim of q, k, g\) must be in \[1, 512\]"),
    (dict(initial_state=torch.randn(3, 2, 4, 6)), ValueError, r"`initial_state` must have shape"),
]


@pytest.mark.parametrize("kw,exc,msg", GLA_CASES, ids=[c[2][:30] for c in GLA_CASES])
def test_bad_input_chunk_gla(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        call_gla(**kw)


# The backward ops as called by autograd: (r, k, v, w, u, grad_o, grad_final_state) -> grads.
BWD_OPS = [
    pytest.param(lambda r, k, v, w, u, do, dht: torch.ops.fla.fused_recurrent_rwkv6_bwd(
        r, k, v, w, u, do, dht, None, None, False, None, False), id="fused_rwkv6"),
    pytest.param(lambda r, k, v, w, u, do, dht: torch.ops.fla.chunk_rwkv6_bwd(
        r, k, v, w, u, do, dht, None, None, None, False), id="chunk_rwkv6"),
    pytest.param(lambda r, k, v, w, u, do, dht: torch.ops.fla.chunk_gla_bwd(
        r, k, v, w, None, do, dht, None, None, None, False), id="chunk_gla"),
    pytest.param(lambda r, k, v, w, u, do, dht: torch.ops.fla.chunk_gla_bwd(
        r, k, v, None, -torch.rand_like(v), do, dht, None, None, None, False), id="chunk_gla_gv"),
]


@pytest.mark.parametrize("bwd", BWD_OPS)
def test_bad_grad_shapes(bwd):
    a = good()
    with pytest.raises(ValueError, match=r"`grad_o` must have the shape of `v`"):
        bwd(a["r"], a["k"], a["v"], a["w"], a["u"], a["r"], None)
    with pytest.raises(ValueError, match=r"`grad_final_state` must have shape"):
        bwd(a["r"], a["k"], a["v"], a["w"], a["u"], a["v"], torch.zeros(1, 2, 4, 6))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_device_mismatch():
    a = good()
    with pytest.raises(RuntimeError, match=r"`k` is on cuda:0 but `r` is on cpu"):
        fused_recurrent_rwkv6(a["r"], a["k"].cuda(), a["v"], a["w"], a["u"])
    with pytest.raises(ValueError, match=r"float64 on CPU"):
        b = good("cuda", dtype=torch.float64)
        fused_recurrent_rwkv6(b["r"], b["k"], b["v"], b["w"], b["u"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_chunk_gla_both_decays_on_cuda():
    """The CUDA chunk engine takes g or gv, not both yet: a clear error before anything runs
    (forward and backward op), never a wrong result."""
    a = good("cuda")
    gv = -torch.rand_like(a["v"])
    with pytest.raises(ValueError, match=r"`g` or a value-side decay `gv`, not both"):
        chunk_gla(a["r"], a["k"], a["v"], a["w"], gv=gv)
    with pytest.raises(ValueError, match=r"`g` or a value-side decay `gv`, not both"):
        torch.ops.fla.chunk_gla_bwd(a["r"], a["k"], a["v"], a["w"], gv, a["v"], None, None, None,
                                    None, False)


@pytest.fixture
def checks():
    fla_ext.set_checks(True)
    yield
    fla_ext.set_checks(False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", RWKV6_OPS)
def test_value_checks(device, op, checks):
    a = good(device)
    r = a["r"].clone()
    r[1, 2, 0, 3] = math.nan
    with pytest.raises(ValueError, match=r"`r` has a non-finite value at index \(1, 2, 0, 3\)"):
        op(r, a["k"], a["v"], a["w"], a["u"])
    w = a["w"].clone()
    w[0, 4, 1, 2] = 0.5  # a linear-space decay passed by mistake
    with pytest.raises(ValueError, match=r"`w` is a log decay and must be <= 0, but is positive at index \(0, 4, 1, 2\)"):
        op(a["r"], a["k"], a["v"], w, a["u"])
    w[0, 4, 1, 2] = -math.inf  # a hard reset is valid
    op(a["r"], a["k"], a["v"], w, a["u"])
    one = good(device, B=1, T=10)
    for cu, msg in [([0, 4, 3, 10], r"non-decreasing"), ([0, 4, 9], r"must equal the number of rows T = 10"),
                    ([1, 4, 10], r"`cu_seqlens\[0\]` must be 0")]:
        with pytest.raises(ValueError, match=msg):
            op(*one.values(), cu_seqlens=torch.tensor(cu, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_value_checks_gv(device, checks):
    a = good(device)
    gv = -torch.rand_like(a["v"])
    gv[1, 3, 0, 5] = 0.25
    with pytest.raises(ValueError, match=r"`gv` is a log decay and must be <= 0, but is positive at index \(1, 3, 0, 5\)"):
        chunk_gla(a["r"], a["k"], a["v"], gv=gv)
    gv[1, 3, 0, 5] = math.nan
    with pytest.raises(ValueError, match=r"`gv` has a NaN at index \(1, 3, 0, 5\)"):
        chunk_gla(a["r"], a["k"], a["v"], gv=gv)
    gv[1, 3, 0, 5] = -math.inf  # a hard reset is valid
    chunk_gla(a["r"], a["k"], a["v"], gv=gv)


def test_checks_off_by_default():
    a = good()
    a["w"][0, 0, 0, 0] = 0.5
    fused_recurrent_rwkv6(**a)  # no device read, no error
