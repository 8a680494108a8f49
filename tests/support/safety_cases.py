"""Every public op as one table entry (inputs by name, a call), for tests that must hold for all
of them: malformed cu_seqlens, empty inputs, double backward, bad values (tests/test_safety.py)
and the GPU memory checks (tests/sanitize.py)."""
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch

import fla_ext


@dataclass(frozen=True)
class OpCase:
    name: str
    make: Callable[..., Dict[str, torch.Tensor]]  # (B, T, H, device, gen, dtype, K, V) -> inputs
    call: Callable  # (inputs, **kw) -> (o, final state or (hk, hv))
    state_dims: Callable[..., Tuple]  # (H, K, V) -> the state shapes (one tuple per state)


K, V, M = 8, 6, 4  # default head dims (GSA's M slots: 4)


def _t(gen, *shape, device="cpu", dtype=torch.float32, decay=False):
    x = torch.randn(*shape, generator=gen)
    if decay:
        x = torch.nn.functional.logsigmoid(x)
    return x.to(device, dtype)


def _acts(B, T, H, device, gen, dtype, **dims):
    """[B, T, H, D] activations by name: dims maps a name to D, or to (D, "decay") for a log
    decay."""
    out = {}
    for name, d in dims.items():
        d, decay = (d[0], True) if isinstance(d, tuple) else (d, False)
        out[name] = _t(gen, B, T, H, d, device=device, dtype=dtype, decay=decay)
    return out


def _rwkv6(B, T, H, device, gen, dtype=torch.float32, K=K, V=V):
    x = _acts(B, T, H, device, gen, dtype, r=K, k=K, v=V, w=(K, "decay"))
    return dict(x, u=_t(gen, H, K, device=device, dtype=dtype))


def _gla(B, T, H, device, gen, dtype=torch.float32, K=K, V=V):
    return _acts(B, T, H, device, gen, dtype, q=K, k=K, v=V, g=(K, "decay"))


def _rwkv7(B, T, H, device, gen, dtype=torch.float32, K=K, V=V):
    x = _acts(B, T, H, device, gen, dtype, r=K, w=(K, "decay"), k=K, v=V, kk=K)
    kk = torch.nn.functional.normalize(x.pop("kk").float(), dim=-1).to(dtype)
    return dict(x, a=-kk, b=(kk * 0.5))


def _rwkv7_mul(B, T, H, device, gen, dtype=torch.float32, K=K, V=V):
    x = _rwkv7(B, T, H, device, gen, dtype, K, V)
    return dict(r=x["r"], w=x["w"], k=x["k"], v=x["v"], kk=-x["a"],
                a=torch.rand(x["a"].shape, generator=gen).to(device, dtype))


def _gsa(B, T, H, device, gen, dtype=torch.float32, K=K, V=V):
    return _acts(B, T, H, device, gen, dtype, q=K, k=K, v=V, s=M, g=(M, "decay"))


def _args(x, names):
    return [x[n] for n in names]


def _diag_states(H, K=K, V=V):
    return ((H, K, V),)


def _gsa_states(H, K=K, V=V):
    return ((H, K, M), (H, M, V))


RWKV6_ARGS, GLA_ARGS = ("r", "k", "v", "w", "u"), ("q", "k", "v", "g")
RWKV7_ARGS, MUL_ARGS = ("r", "w", "k", "v", "a", "b"), ("r", "w", "k", "v", "kk", "a")
GSA_ARGS = ("q", "k", "v", "s", "g")

OPS = [
    OpCase("fused_recurrent_rwkv6", _rwkv6,
           lambda x, **kw: fla_ext.fused_recurrent_rwkv6(*_args(x, RWKV6_ARGS), **kw), _diag_states),
    OpCase("chunk_rwkv6", _rwkv6,
           lambda x, **kw: fla_ext.chunk_rwkv6(*_args(x, RWKV6_ARGS), **kw), _diag_states),
    OpCase("fused_recurrent_gla", _gla,
           lambda x, **kw: fla_ext.fused_recurrent_gla(x["q"], x["k"], x["v"], gk=x["g"], **kw),
           _diag_states),
    OpCase("chunk_gla", _gla,
           lambda x, **kw: fla_ext.chunk_gla(*_args(x, GLA_ARGS), **kw), _diag_states),
    OpCase("fused_recurrent_rwkv7", _rwkv7,
           lambda x, **kw: fla_ext.fused_recurrent_rwkv7(*_args(x, RWKV7_ARGS), **kw), _diag_states),
    OpCase("fused_mul_recurrent_rwkv7", _rwkv7_mul,
           lambda x, **kw: fla_ext.fused_mul_recurrent_rwkv7(*_args(x, MUL_ARGS), **kw),
           _diag_states),
    OpCase("chunk_rwkv7", _rwkv7,
           lambda x, **kw: fla_ext.chunk_rwkv7(*_args(x, RWKV7_ARGS), **kw), _diag_states),
    OpCase("chunk_gsa", _gsa,
           lambda x, **kw: fla_ext.chunk_gsa(*_args(x, GSA_ARGS), **kw), _gsa_states),
    OpCase("fused_recurrent_gsa", _gsa,
           lambda x, **kw: fla_ext.fused_recurrent_gsa(*_args(x, GSA_ARGS), **kw), _gsa_states),
]
OPS_BY_NAME = {c.name: c for c in OPS}


def initial_state(case: OpCase, N, H, device, gen, K=K, V=V):
    """The op's initial_state argument: one float32 state, or GSA's pair."""
    states = tuple(_t(gen, N, *dims, device=device) for dims in case.state_dims(H, K, V))
    return states[0] if len(states) == 1 else states


def final_states(case: OpCase, out):
    """The final states an op returned, as a tuple."""
    ht = out[1]
    return tuple(ht) if isinstance(ht, (tuple, list)) else (ht,)
