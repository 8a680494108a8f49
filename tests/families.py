"""GLA and RWKV6 as one table, for tests that run the same checks on both diagonal-gate families
and on both of their modes (chunk, fused_recurrent): inputs, calls, float64 oracle."""
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import pytest
import torch

import fla_ext
from conftest import TOL, assert_close
from fla_ext import reference
from inputs import make_diag


@dataclass(frozen=True)
class Family:
    name: str
    args: Tuple[str, ...]     # activations and parameters, in call order
    modes: Dict[str, Callable]  # mode -> op(*args, **kw)
    ref: Callable             # float64 forward (*args, **kw)
    ref_bwd: Callable         # float64 backward (*args, do, dht, **kw) -> {name: grad}

    @property
    def decay(self) -> str:  # the log decay argument
        return self.args[3]

    def make(self, B, T, H, K, V, dtype, device, gen, *, u_scale=1.0, **kw) -> Dict:
        """Inputs by name, h0 included (None unless requested), from inputs.make_diag."""
        q, k, v, g, h0 = make_diag(B, T, H, K, V, dtype, device, gen, **kw)
        x = dict(zip(self.args, (q, k, v, g)))
        if "u" in self.args:
            x["u"] = (u_scale * torch.randn(H, K, generator=gen)).to(device=device, dtype=dtype)
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

FAMILIES = [pytest.param(GLA, id="gla"), pytest.param(RWKV6, id="rwkv6")]


def leaves(x: Dict) -> Dict:
    """Fresh leaf copies of the inputs that require grad (None stays None)."""
    return {n: None if t is None else t.detach().clone().requires_grad_(True) for n, t in x.items()}


def run_and_check(fam: Family, mode: str, x: Dict, *, dht_on=True, gen=None, tol_scale=1.0,
                  **kw):
    """Forward, final state and every gradient of `mode` vs the float64 oracle, with the
    ALGORITHMS.md §8.3 tolerances of the input dtype. kw: scale, cu_seqlens, head_first.
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
        assert_close(f"d{name}", t.grad, g_ref[name], tol_decay if name == fam.decay else tol, atol)
        grads[name] = t.grad
    return o, ht, grads
