"""Float64 oracles: the plain recurrences and hand-written BPTT (docs/algorithms.md §8.1).

Independent of every kernel's algebra (no chunking, no closed forms), validated against finite
differences in tests/oracle/test_reference.py. All functions take fla-layout tensors ``[B, T, H, D]``
(or ``head_first=True``), any dtype (upcast exactly to float64), optional ``cu_seqlens``, and
return float64 results in the input layout. States are ``[N, H, K, V]``.

Conventions: decays are log decays (``exp(w)`` multiplies the state); ``reverse=True`` runs the
recurrence from the last token to the first.
"""
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor


def _f64(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.detach().to("cpu", torch.float64)


def _spans(B: int, T: int, cu_seqlens: Optional[Tensor]) -> List[Tuple[int, int, int]]:
    """(batch row, first t, end t) for each sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def _run(step_fn: Callable, seq_tensors: Sequence[Optional[Tensor]], head_first: bool,
         cu_seqlens: Optional[Tensor], reverse: bool, n_out: int):
    """Apply ``step_fn(n, [x[b, bos:eos] as [L, H, D] (time in processing order)])`` per sequence,
    which returns (per-step outputs [L, H, *] list of n_out, extras), and reassemble outputs."""
    xs = [None if x is None else (_f64(x).transpose(1, 2) if head_first else _f64(x))
          for x in seq_tensors]
    ref = xs[0]
    B, T = ref.shape[0], ref.shape[1]
    outs: List[Optional[Tensor]] = [None] * n_out
    extras = []
    for n, (b, bos, eos) in enumerate(_spans(B, T, cu_seqlens)):
        seq = [None if x is None else x[b, bos:eos] for x in xs]
        if reverse:
            seq = [None if x is None else x.flip(0) for x in seq]
        res, extra = step_fn(n, seq)
        extras.append(extra)
        for i, r in enumerate(res):
            if outs[i] is None:
                outs[i] = torch.zeros(B, T, *r.shape[1:], dtype=torch.float64)
            outs[i][b, bos:eos] = r.flip(0) if reverse else r
    for i, o in enumerate(outs):
        if o is not None and head_first:
            outs[i] = o.transpose(1, 2)
    return outs, extras


def _state(h0: Optional[Tensor], n: int, H: int, K: int, V: int) -> Tensor:
    return _f64(h0[n]).clone() if h0 is not None else torch.zeros(H, K, V, dtype=torch.float64)


# ------------------------------------------------------------------------------------------------
# RWKV6: o_t = s (h_{t-1} + diag(u) k_t v_t^T)^T r_t;  h_t = diag(e^{w_t}) h_{t-1} + k_t v_t^T
# ------------------------------------------------------------------------------------------------

def rwkv6(r, k, v, w, u, scale=None, initial_state=None, reverse=False, cu_seqlens=None,
          head_first=False) -> Tuple[Tensor, Tensor]:
    K, V = r.shape[-1], v.shape[-1]
    s = K ** -0.5 if scale is None else scale
    u64 = _f64(u)
    finals = []

    def seq(n, xs):
        r_, k_, v_, w_ = xs
        L, H = r_.shape[0], r_.shape[1]
        h = _state(initial_state, n, H, K, V)
        o = torch.zeros(L, H, V, dtype=torch.float64)
        for t in range(L):
            kv = k_[t, :, :, None] * v_[t, :, None, :]
            o[t] = s * torch.einsum("hk,hkv->hv", r_[t], h + u64[:, :, None] * kv)
            h = torch.exp(w_[t])[:, :, None] * h + kv
        finals.append(h)
        return [o], None

    (o,), _ = _run(seq, [r, k, v, w], head_first, cu_seqlens, reverse, 1)
    return o, torch.stack(finals)


def rwkv6_bwd(r, k, v, w, u, do, dht=None, scale=None, initial_state=None, reverse=False,
              cu_seqlens=None, head_first=False) -> Dict[str, Tensor]:
    K, V = r.shape[-1], v.shape[-1]
    s = K ** -0.5 if scale is None else scale
    u64 = _f64(u)
    du = torch.zeros_like(u64)
    dh0s = []

    def seq(n, xs):
        nonlocal du
        r_, k_, v_, w_, do_ = xs
        L, H = r_.shape[0], r_.shape[1]
        hs = [_state(initial_state, n, H, K, V)]
        for t in range(L):
            hs.append(torch.exp(w_[t])[:, :, None] * hs[-1] + k_[t, :, :, None] * v_[t, :, None, :])
        D = _f64(dht[n]).clone() if dht is not None else torch.zeros(H, K, V, dtype=torch.float64)
        dr, dk, dw = (torch.zeros(L, H, K, dtype=torch.float64) for _ in range(3))
        dv = torch.zeros(L, H, V, dtype=torch.float64)
        for t in reversed(range(L)):
            hp = hs[t]  # h_{t-1}
            dov = (do_[t] * v_[t]).sum(-1)                       # [H]
            ruk = (r_[t] * u64 * k_[t]).sum(-1)                  # [H]
            dr[t] = s * (torch.einsum("hkv,hv->hk", hp, do_[t]) + u64 * k_[t] * dov[:, None])
            du += s * r_[t] * k_[t] * dov[:, None]
            dk[t] = torch.einsum("hkv,hv->hk", D, v_[t]) + s * u64 * r_[t] * dov[:, None]
            dv[t] = torch.einsum("hkv,hk->hv", D, k_[t]) + s * do_[t] * ruk[:, None]
            dw[t] = torch.exp(w_[t]) * (D * hp).sum(-1)
            D = torch.exp(w_[t])[:, :, None] * D + s * r_[t, :, :, None] * do_[t, :, None, :]
        dh0s.append(D)
        return [dr, dk, dv, dw], None

    (dr, dk, dv, dw), _ = _run(seq, [r, k, v, w, do], head_first, cu_seqlens, reverse, 4)
    return dict(r=dr, k=dk, v=dv, w=dw, u=du, h0=torch.stack(dh0s))


def _grad_state(dht: Optional[Tensor], n: int, H: int, K: int, V: int) -> Tensor:
    return _f64(dht[n]).clone() if dht is not None else torch.zeros(H, K, V, dtype=torch.float64)


# ------------------------------------------------------------------------------------------------
# GLA: h_t = diag(e^{g_t}) h_{t-1} diag(e^{gv_t}) + k_t v_t^T;  o_t = s h_t^T q_t  (inclusive)
# g [.., K] (key-side) and gv [.., V] (value-side, GSA pass 1) are each optional (None: no decay).
# ------------------------------------------------------------------------------------------------

def _gla_decay(g_: Optional[Tensor], gv_: Optional[Tensor], t: int, H: int, K: int, V: int):
    """exp(g_t)[:, :, None] * exp(gv_t)[:, None, :]: the elementwise state decay of step t."""
    a = torch.exp(g_[t]) if g_ is not None else torch.ones(H, K, dtype=torch.float64)
    b = torch.exp(gv_[t]) if gv_ is not None else torch.ones(H, V, dtype=torch.float64)
    return a[:, :, None] * b[:, None, :]


def gla(q, k, v, g=None, gv=None, scale=None, initial_state=None, reverse=False, cu_seqlens=None,
        head_first=False) -> Tuple[Tensor, Tensor]:
    K, V = q.shape[-1], v.shape[-1]
    s = K ** -0.5 if scale is None else scale
    finals = []

    def seq(n, xs):
        q_, k_, v_, g_, gv_ = xs
        L, H = q_.shape[0], q_.shape[1]
        h = _state(initial_state, n, H, K, V)
        o = torch.zeros(L, H, V, dtype=torch.float64)
        for t in range(L):
            h = _gla_decay(g_, gv_, t, H, K, V) * h + k_[t, :, :, None] * v_[t, :, None, :]
            o[t] = s * torch.einsum("hk,hkv->hv", q_[t], h)
        finals.append(h)
        return [o], None

    (o,), _ = _run(seq, [q, k, v, g, gv], head_first, cu_seqlens, reverse, 1)
    return o, torch.stack(finals)


def gla_bwd(q, k, v, g, do, dht=None, scale=None, initial_state=None, reverse=False,
            cu_seqlens=None, head_first=False, gv=None) -> Dict[str, Tensor]:
    """Gradients by name: q, k, v, h0, and g / gv when given."""
    K, V = q.shape[-1], v.shape[-1]
    s = K ** -0.5 if scale is None else scale
    dh0s = []

    def seq(n, xs):
        q_, k_, v_, g_, gv_, do_ = xs
        L, H = q_.shape[0], q_.shape[1]
        # exp of the log decays; an absent side is 1 (shapes broadcast to [H, K, V])
        a = torch.exp(g_)[:, :, :, None] if g_ is not None else torch.ones(L, H, 1, 1, dtype=torch.float64)
        b = torch.exp(gv_)[:, :, None, :] if gv_ is not None else torch.ones(L, H, 1, 1, dtype=torch.float64)
        hs = [_state(initial_state, n, H, K, V)]
        for t in range(L):
            hs.append(a[t] * hs[-1] * b[t] + k_[t, :, :, None] * v_[t, :, None, :])
        D = _grad_state(dht, n, H, K, V)  # dL/dh_t, accumulated from the future
        dq, dk, dg = (torch.zeros(L, H, K, dtype=torch.float64) for _ in range(3))
        dv, dgv = (torch.zeros(L, H, V, dtype=torch.float64) for _ in range(2))
        for t in reversed(range(L)):
            D = D + s * q_[t, :, :, None] * do_[t, :, None, :]
            dq[t] = s * torch.einsum("hkv,hv->hk", hs[t + 1], do_[t])
            dk[t] = torch.einsum("hkv,hv->hk", D, v_[t])
            dv[t] = torch.einsum("hkv,hk->hv", D, k_[t])
            # d/dg_t[i] of (e^{g_t[i]} ...) and d/dgv_t[j] of (... e^{gv_t[j]}): each is its own
            # factor times a finite sum, so an exp that underflows to 0 gives exactly 0.
            dg[t] = (a[t] * (D * hs[t] * b[t])).sum(-1)
            dgv[t] = (b[t] * (D * a[t] * hs[t])).sum(-2)
            D = a[t] * D * b[t]
        dh0s.append(D)
        return [dq, dk, dv, dg, dgv], None

    (dq, dk, dv, dg, dgv), _ = _run(seq, [q, k, v, g, gv, do], head_first, cu_seqlens, reverse, 5)
    out = dict(q=dq, k=dk, v=dv, h0=torch.stack(dh0s))
    if g is not None:
        out["g"] = dg
    if gv is not None:
        out["gv"] = dgv
    return out


# ------------------------------------------------------------------------------------------------
# RWKV7 (DPLR): h_t = diag(e^{w_t}) h_{t-1} + b_t (a_t^T h_{t-1}) + k_t v_t^T;  o_t = s h_t^T r_t
# ------------------------------------------------------------------------------------------------

def _rwkv7_step(h: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor) -> Tensor:
    c = torch.einsum("hkv,hk->hv", h, a)  # h_{t-1}^T a_t
    return torch.exp(w)[:, :, None] * h + b[:, :, None] * c[:, None, :] + k[:, :, None] * v[:, None, :]


def rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, reverse=False, cu_seqlens=None,
          head_first=False) -> Tuple[Tensor, Tensor]:
    K, V = r.shape[-1], v.shape[-1]
    s = 1.0 if scale is None else scale
    finals = []

    def seq(n, xs):
        r_, w_, k_, v_, a_, b_ = xs
        L, H = r_.shape[0], r_.shape[1]
        h = _state(initial_state, n, H, K, V)
        o = torch.zeros(L, H, V, dtype=torch.float64)
        for t in range(L):
            h = _rwkv7_step(h, w_[t], k_[t], v_[t], a_[t], b_[t])
            o[t] = s * torch.einsum("hk,hkv->hv", r_[t], h)
        finals.append(h)
        return [o], None

    (o,), _ = _run(seq, [r, w, k, v, a, b], head_first, cu_seqlens, reverse, 1)
    return o, torch.stack(finals)


def rwkv7_bwd(r, w, k, v, a, b, do, dht=None, scale=1.0, initial_state=None, reverse=False,
              cu_seqlens=None, head_first=False) -> Dict[str, Tensor]:
    K, V = r.shape[-1], v.shape[-1]
    s = 1.0 if scale is None else scale
    dh0s = []

    def seq(n, xs):
        r_, w_, k_, v_, a_, b_, do_ = xs
        L, H = r_.shape[0], r_.shape[1]
        hs = [_state(initial_state, n, H, K, V)]
        for t in range(L):
            hs.append(_rwkv7_step(hs[-1], w_[t], k_[t], v_[t], a_[t], b_[t]))
        D = _grad_state(dht, n, H, K, V)
        dr, dw, dk, da, db = (torch.zeros(L, H, K, dtype=torch.float64) for _ in range(5))
        dv = torch.zeros(L, H, V, dtype=torch.float64)
        for t in reversed(range(L)):
            hp = hs[t]  # h_{t-1}
            D = D + s * r_[t, :, :, None] * do_[t, :, None, :]
            dr[t] = s * torch.einsum("hkv,hv->hk", hs[t + 1], do_[t])
            dk[t] = torch.einsum("hkv,hv->hk", D, v_[t])
            dv[t] = torch.einsum("hkv,hk->hv", D, k_[t])
            c = torch.einsum("hkv,hk->hv", hp, a_[t])          # h_{t-1}^T a_t   [H, V]
            e = torch.einsum("hkv,hk->hv", D, b_[t])           # D^T b_t         [H, V]
            db[t] = torch.einsum("hkv,hv->hk", D, c)
            da[t] = torch.einsum("hkv,hv->hk", hp, e)
            dw[t] = torch.exp(w_[t]) * (D * hp).sum(-1)
            D = torch.exp(w_[t])[:, :, None] * D + a_[t, :, :, None] * e[:, None, :]
        dh0s.append(D)
        return [dr, dw, dk, dv, da, db], None

    (dr, dw, dk, dv, da, db), _ = _run(seq, [r, w, k, v, a, b, do], head_first, cu_seqlens,
                                       reverse, 6)
    return dict(r=dr, w=dw, k=dk, v=dv, a=da, b=db, h0=torch.stack(dh0s))


# ------------------------------------------------------------------------------------------------
# GSA: pass 1  Hk_t = Hk_{t-1} diag(e^{g_t}) + k_t s_t^T,  p_t = softmax_M(s Hk_t^T q_t)
#      pass 2  Hv_t = diag(e^{g_t}) Hv_{t-1} + s_t v_t^T,   o_t = Hv_t^T p_t
# ------------------------------------------------------------------------------------------------

def _gsa_states(initial_state, n: int, H: int, K: int, M: int, V: int) -> Tuple[Tensor, Tensor]:
    hk0, hv0 = (None, None) if initial_state is None else initial_state
    return _state(hk0, n, H, K, M), _state(hv0, n, H, M, V)


def _gsa_step(hk, hv, q, k, v, s_, g, scale):
    a = torch.exp(g)                                            # [H, M]
    hk = hk * a[:, None, :] + k[:, :, None] * s_[:, None, :]    # [H, K, M]
    hv = a[:, :, None] * hv + s_[:, :, None] * v[:, None, :]    # [H, M, V]
    p = torch.softmax(scale * torch.einsum("hk,hkm->hm", q, hk), dim=-1)
    return hk, hv, p


def gsa(q, k, v, s, g, scale=None, initial_state=None, reverse=False, cu_seqlens=None,
        head_first=False) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    K, V, M = q.shape[-1], v.shape[-1], s.shape[-1]
    sc = K ** -0.5 if scale is None else scale
    finals_k, finals_v = [], []

    def seq(n, xs):
        q_, k_, v_, s_, g_ = xs
        L, H = q_.shape[0], q_.shape[1]
        hk, hv = _gsa_states(initial_state, n, H, K, M, V)
        o = torch.zeros(L, H, V, dtype=torch.float64)
        for t in range(L):
            hk, hv, p = _gsa_step(hk, hv, q_[t], k_[t], v_[t], s_[t], g_[t], sc)
            o[t] = torch.einsum("hm,hmv->hv", p, hv)
        finals_k.append(hk)
        finals_v.append(hv)
        return [o], None

    (o,), _ = _run(seq, [q, k, v, s, g], head_first, cu_seqlens, reverse, 1)
    return o, (torch.stack(finals_k), torch.stack(finals_v))


def gsa_bwd(q, k, v, s, g, do, dht=None, scale=None, initial_state=None, reverse=False,
            cu_seqlens=None, head_first=False) -> Dict[str, Tensor]:
    K, V, M = q.shape[-1], v.shape[-1], s.shape[-1]
    sc = K ** -0.5 if scale is None else scale
    dhkT, dhvT = (None, None) if dht is None else dht
    dhk0s, dhv0s = [], []

    def seq(n, xs):
        q_, k_, v_, s_, g_, do_ = xs
        L, H = q_.shape[0], q_.shape[1]
        hk, hv = _gsa_states(initial_state, n, H, K, M, V)
        hks, hvs, ps = [hk], [hv], []
        for t in range(L):
            hk, hv, p = _gsa_step(hks[-1], hvs[-1], q_[t], k_[t], v_[t], s_[t], g_[t], sc)
            hks.append(hk)
            hvs.append(hv)
            ps.append(p)
        Dk = _grad_state(dhkT, n, H, K, M)   # dL/dHk_t  [H, K, M]
        Dv = _grad_state(dhvT, n, H, M, V)   # dL/dHv_t  [H, M, V]
        dq, dk = (torch.zeros(L, H, K, dtype=torch.float64) for _ in range(2))
        ds, dg = (torch.zeros(L, H, M, dtype=torch.float64) for _ in range(2))
        dv = torch.zeros(L, H, V, dtype=torch.float64)
        for t in reversed(range(L)):
            a = torch.exp(g_[t])
            p = ps[t]
            # pass 2: GLA rules with q := p, k := s, scale 1
            Dv = Dv + p[:, :, None] * do_[t, :, None, :]
            dp = torch.einsum("hmv,hv->hm", hvs[t + 1], do_[t])
            ds[t] = torch.einsum("hmv,hv->hm", Dv, v_[t])
            dv[t] = torch.einsum("hmv,hm->hv", Dv, s_[t])
            dg[t] = a * (Dv * hvs[t]).sum(-1)
            Dv = a[:, :, None] * Dv
            # softmax backward
            dok = p * (dp - (p * dp).sum(-1, keepdim=True))
            # pass 1: decay on the slot (column) dim
            Dk = Dk + sc * q_[t, :, :, None] * dok[:, None, :]
            dq[t] = sc * torch.einsum("hkm,hm->hk", hks[t + 1], dok)
            dk[t] = torch.einsum("hkm,hm->hk", Dk, s_[t])
            ds[t] += torch.einsum("hkm,hk->hm", Dk, k_[t])
            dg[t] += a * (Dk * hks[t]).sum(-2)
            Dk = Dk * a[:, None, :]
        dhk0s.append(Dk)
        dhv0s.append(Dv)
        return [dq, dk, dv, ds, dg], None

    (dq, dk, dv, ds, dg), _ = _run(seq, [q, k, v, s, g, do], head_first, cu_seqlens, reverse, 5)
    return dict(q=dq, k=dk, v=dv, s=ds, g=dg, hk0=torch.stack(dhk0s), hv0=torch.stack(dhv0s))
