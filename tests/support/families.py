"""GLA and RWKV6 as one table, for tests that run the same checks on both diagonal-gate families
and on both of their modes (chunk, fused_recurrent): inputs, calls, float64 oracle. GLA also
comes with its value-side decay gv (GSA pass 1), alone and with the key-side g (chunk mode)."""
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import pytest
import torch

import fla_ext
from conftest import TOL, assert_close
from fla_ext import reference
from inputs import layout, log_decay, make_diag


@dataclass(frozen=True)
class Family:
    name: str
    args: Tuple[str, ...]     # activations and parameters, in call order
    modes: Dict[str, Callable]  # mode -> op(*args, **kw)
    ref: Callable             # float64 forward (*args, **kw)
    ref_bwd: Callable         # float64 backward (*args, do, dht, **kw) -> {name: grad}
    cuda: bool = True         # implemented by the CUDA backend

    @property
    def decay(self) -> str:  # the (first) log decay argument
        return self.args[3]

    @property
    def decays(self) -> Tuple[str, ...]:  # every log decay argument
        return tuple(n for n in self.args if n in ("g", "w", "gv"))

    def make(self, B, T, H, K, V, dtype, device, gen, *, u_scale=1.0, **kw) -> Dict:
        """Inputs by name, h0 included (None unless requested), from inputs.make_diag."""
        q, k, v, g, h0 = make_diag(B, T, H, K, V, dtype, device, gen, **kw)
        x = dict(zip(self.args[:3], (q, k, v)))
        for n in self.args[3:]:
            if n in ("g", "w"):
                x[n] = g
            elif n == "gv":  # [.., V]: the same regime and layout as g
                x[n] = layout(log_decay(kw.get("w_kind", "typical"), (B, T, H, V), gen), dtype,
                              device, head_first=kw.get("head_first", False),
                              noncontig=kw.get("noncontig", False))
            elif n == "u":
                x[n] = (u_scale * torch.randn(H, K, generator=gen)).to(device=device, dtype=dtype)
        x["h0"] = h0
        return x

    def call(self, mode, x, **kw):
        """(o, final_state) of `mode` on the inputs x (h0 as initial_state)."""
        return self.modes[mode](*(x[n] for n in self.args), initial_state=x["h0"], **kw)


GLA = Family(
    "gla", ("q", "k", "v", "g"),
    dict(chunk=fla_ext.chunk_gla,
         fused=lambda q, k, v, g, **kw: fla_ext.fused_recurrent_gla(q, k, v, gk=g, **kw)),
    reference.gla, reference.gla_bwd)
RWKV6 = Family(
    "rwkv6", ("r", "k", "v", "w", "u"),
    dict(chunk=fla_ext.chunk_rwkv6, fused=fla_ext.fused_recurrent_rwkv6),
    reference.rwkv6, reference.rwkv6_bwd)

# GLA with the value-side decay gv [.., V] (GSA pass 1), alone and with g (the chunk mode on the
# CPU backend only: CUDA refuses both together). gv alone is compared with fused_recurrent_gla
# too; with both decays fused_recurrent's fp32 decay gradients have their own wider tolerance
# (tests/ops/test_gla_fused.py), so that pair is checked against the oracle only.
GLA_GV = Family(
    "gla_gv", ("q", "k", "v", "gv"),
    dict(chunk=lambda q, k, v, gv, **kw: fla_ext.chunk_gla(q, k, v, gv=gv, **kw),
         fused=lambda q, k, v, gv, **kw: fla_ext.fused_recurrent_gla(q, k, v, gv=gv, **kw)),
    lambda q, k, v, gv, **kw: reference.gla(q, k, v, None, gv, **kw),
    lambda q, k, v, gv, do, dht, **kw: reference.gla_bwd(q, k, v, None, do, dht, gv=gv, **kw))
GLA_KV = Family(
    "gla_kv", ("q", "k", "v", "g", "gv"),
    dict(chunk=lambda q, k, v, g, gv, **kw: fla_ext.chunk_gla(q, k, v, g, gv=gv, **kw)),
    reference.gla,
    lambda q, k, v, g, gv, do, dht, **kw: reference.gla_bwd(q, k, v, g, do, dht, gv=gv, **kw),
    cuda=False)

FAMILIES = [pytest.param(GLA, id="gla"), pytest.param(RWKV6, id="rwkv6")]
# The chunk engine's families: the fused-mode ones plus the value-side decay.
FUSED_FAMILIES = FAMILIES + [pytest.param(GLA_GV, id="gla_gv")]  # those with both modes
CHUNK_FAMILIES = FAMILIES + [pytest.param(GLA_GV, id="gla_gv"), pytest.param(GLA_KV, id="gla_kv")]


def on_devices(devices, families):
    """(device, family) parameters for every device a family runs on: a combination a
    backend does not implement is not generated (its error is tested in test_errors.py).
    `devices` are pytest.params of one value (a device) or two (device, dtype)."""
    out = []
    for d in devices:
        for f in families:
            fam = f.values[0]
            if "cuda" in str(d.values[0]) and not fam.cuda:
                continue
            out.append(pytest.param(*d.values, fam, id=f"{d.id}-{f.id}", marks=d.marks))
    return out


def leaves(x: Dict) -> Dict:
    """Fresh leaf copies of the inputs that require grad (None stays None)."""
    return {n: None if t is None else t.detach().clone().requires_grad_(True) for n, t in x.items()}


def run_and_check(fam: Family, mode: str, x: Dict, *, dht_on=True, gen=None, tol_scale=1.0,
                  **kw):
    """Forward, final state and every gradient of `mode` vs the float64 oracle, with the
    docs/algorithms.md §8.3 tolerances of the input dtype. kw: scale, cu_seqlens, head_first.
    Returns (o, ht, {name: grad})."""
    tol, tol_decay, atol = TOL[x["k"].dtype]
    tol, tol_decay = tol * tol_scale, tol_decay * tol_scale
    ins = leaves(x)
    o, ht = fam.call(mode, ins, output_final_state=True, **kw)
    args = [x[n] for n in fam.args]
    o_ref, ht_ref = fam.ref(*args, initial_state=x["h0"], **kw)
    assert o.dtype == x["k"].dtype
    assert_close("o", o, o_ref, tol, atol)
    assert_close("ht", ht, ht_ref, tol, atol)
    do = torch.randn(o.shape, generator=gen).to(o)
    dht = torch.randn(ht.shape, generator=gen).to(ht) if dht_on else None
    ((o * do).sum() + ((ht * dht).sum() if dht_on else 0)).backward()
    g_ref = fam.ref_bwd(*args, do, dht, initial_state=x["h0"], **kw)
    grads = {}
    for name, t in ins.items():
        if t is None:
            continue
        assert t.grad is not None, f"no gradient for {name}"
        assert_close(f"d{name}", t.grad, g_ref[name], tol_decay if name in fam.decays else tol,
                     atol)
        grads[name] = t.grad
    return o, ht, grads
