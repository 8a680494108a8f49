"""The float64 chunk algebra (fla_ext.chunk_reference) equals the recurrent oracle, stress
decays included, and its chunk-start states are the recurrence's states (docs/algorithms.md §8.1)."""
import math

import pytest
import torch

from fla_ext import chunk_reference as cr
from fla_ext import reference as ref
from inputs import log_decay

F64 = torch.float64


def close(name, x, y):
    err = (x - y).norm().item()
    den = y.norm().item()
    assert torch.isfinite(x).all(), f"{name}: non-finite values"
    assert err <= 1e-12 * max(den, 1.0), f"{name}: abs L2 err {err:.2e} (ref norm {den:.2e})"


def draw(T, kind, gen, B=2, H=2, K=5, V=3):
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    g = log_decay(kind, (B, T, H, K), gen).to(F64)
    return mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, V), g, mk(H, K), mk(B, H, K, V), mk(B, T, H, V)


@pytest.mark.parametrize("family", ["gla", "rwkv6"])
@pytest.mark.parametrize("kind", ["typical", "zero", "u30", "neg1e4", "neginf", "mixedinf", "spike0", "spike15"])
@pytest.mark.parametrize("T,C", [(1, 16), (15, 16), (16, 16), (17, 16), (77, 16), (130, 64)])
def test_chunk_equals_recurrence(family, kind, T, C, gen):
    q, k, v, g, u, h0, do = draw(T, kind, gen)
    dht = torch.randn(h0.shape, generator=gen, dtype=F64)
    uu = u if family == "rwkv6" else None
    o, hT, inter = cr.chunk_fwd(q, k, v, g, uu, initial_state=h0, chunk_size=C)
    grads, _ = cr.chunk_bwd(q, k, v, g, do, dht, uu, initial_state=h0, chunk_size=C)
    if family == "gla":
        o_ref, hT_ref = ref.gla(q, k, v, g, initial_state=h0)
        g_ref = ref.gla_bwd(q, k, v, g, do, dht, initial_state=h0)
        names = dict(q="q", k="k", v="v", g="g", h0="h0")
    else:
        o_ref, hT_ref = ref.rwkv6(q, k, v, g, u, initial_state=h0)
        g_ref = ref.rwkv6_bwd(q, k, v, g, u, do, dht, initial_state=h0)
        names = dict(q="r", k="k", v="v", g="w", h0="h0", u="u")
    close("o", o, o_ref)
    close("hT", hT, hT_ref)
    for mine, theirs in names.items():
        close(f"d{theirs}", grads[mine], g_ref[theirs])
    # Hst[n] is the state after the first n*C steps.
    for n in range(1, inter["Hst"].shape[0]):
        t = n * C
        fwd = ref.gla if family == "gla" else (lambda *a, **kw: ref.rwkv6(*a[:4], u, **kw))
        _, h_ref = fwd(q[:, :t], k[:, :t], v[:, :t], g[:, :t], initial_state=h0)
        close(f"Hst[{n}]", inter["Hst"][n], h_ref)


def test_hard_reset_is_exact(gen):
    """With lambda = -inf at a row, prefix differences would give -inf - (-inf) = NaN; the segment
    sums give exactly the restarted recurrence."""
    q, k, v, g, u, h0, do = draw(40, "typical", gen)
    g[:, 20] = -math.inf
    o, hT, _ = cr.chunk_fwd(q, k, v, g, None, initial_state=h0, chunk_size=16)
    o2, hT2, _ = cr.chunk_fwd(q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:], None, chunk_size=16,
                              initial_state=torch.zeros_like(h0))
    close("o after the reset", o[:, 20:], o2)
    close("hT", hT, hT2)
