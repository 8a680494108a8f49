"""The chunk algebra of docs/algorithms.md §4 (GLA) and §5 (RWKV6) in float64, with its intermediates.

This is the stage-by-stage oracle for the chunk kernels (§8.1): per chunk of C rows it forms the
decay exponents as *additive segment sums* (§2.6: partial sums of lambda <= 0 are only ever
added, never subtracted, so lambda = -inf is exact and nothing cancels), the pair matrix A, the
chunk-start states Hst[n], and in the backward dHst[n] and zeta. Agreement with the recurrent
oracle (fla_ext.reference) to ~1e-12 is what validates the algebra before it is put into CUDA.

Layout: [B, T, H, D] without cu_seqlens (each batch row is one sequence); states [B, H, K, V].
"""
from typing import Dict

import torch

Tensor = torch.Tensor


def _f64(x):
    return None if x is None else x.detach().to("cpu", torch.float64)


def _segments(lam: Tensor) -> Dict[str, Tensor]:
    """Chunk-local decay exponents of lam [B, L, H, K], all built by addition:
    seg[b,h,k,i,j] = sum_{j<s<=i} lam_s (i >= j; -inf above the diagonal), G_i = sum_{s<=i},
    E_i = sum_{s<i}, Omega_j = sum_{s>j}, Gamma = sum over the chunk."""
    B, L, H, K = lam.shape
    x = lam.permute(0, 2, 3, 1)                                        # [B, H, K, L]
    i = torch.arange(L)
    strict = (i[:, None] > i[None, :])                                 # s > j, indexed [s, j]
    xr = torch.where(strict, x[..., :, None], torch.zeros((), dtype=x.dtype))  # [.., s, j]
    seg = torch.cumsum(xr, dim=-2)                                     # sum over j < s <= i
    seg = torch.where(i[:, None] >= i[None, :], seg, torch.tensor(-torch.inf, dtype=x.dtype))
    zero = torch.zeros_like(x[..., :1])
    G = torch.cumsum(x, dim=-1)
    E = torch.cat([zero, G[..., :-1]], dim=-1)
    Omega = torch.cat([torch.flip(torch.cumsum(torch.flip(x[..., 1:], [-1]), -1), [-1]), zero], dim=-1)
    return dict(seg=seg, G=G, E=E, Omega=Omega, Gamma=G[..., -1])


def _pair_factors(sg: Dict[str, Tensor], exclusive: bool):
    """(fac [B, H, K, L, L], read [B, H, K, L], keep [L, L]): the decay factor of a write at row j
    seen by the reader at row i, the reader's exponent from the chunk start, and the pairs that
    carry a decay. GLA reads inclusively (j <= i, exponent sum_{j<s<=i}, reader G); RWKV6
    exclusively (j < i, exponent sum_{j<s<i}: seg one row up, reader E)."""
    seg = sg["seg"]
    i = torch.arange(seg.shape[-1])
    if not exclusive:
        return torch.exp(seg), sg["G"], i[:, None] >= i[None, :]
    keep = i[:, None] > i[None, :]
    ex = torch.cat([torch.full_like(seg[..., :1, :], -torch.inf), seg[..., :-1, :]], dim=-2)
    return torch.exp(ex) * keep, sg["E"], keep


def _bhl(x: Tensor) -> Tensor:  # [B, L, H, D] -> [B, H, L, D]
    return x.permute(0, 2, 1, 3)


def chunk_fwd(q, k, v, g, u=None, scale=None, initial_state=None, chunk_size=64):
    """GLA (u None: inclusive read) or RWKV6 (u [H, K]: exclusive read plus bonus) forward.
    Returns (o [B, T, H, V], hT [B, H, K, V], intermediates: Hst [NT, B, H, K, V], A per chunk)."""
    q, k, v, g, u = (_f64(x) for x in (q, k, v, g, u))
    B, T, H, K = q.shape
    V = v.shape[-1]
    s = K ** -0.5 if scale is None else scale
    S = _f64(initial_state).clone() if initial_state is not None else torch.zeros(B, H, K, V, dtype=torch.float64)
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    Hst, As = [], []
    for c0 in range(0, T, chunk_size):
        sl = slice(c0, min(c0 + chunk_size, T))
        qc, kc, vc = _bhl(q[:, sl]), _bhl(k[:, sl]), _bhl(v[:, sl])       # [B, H, L, D]
        sg = _segments(g[:, sl])
        fac, read, _ = _pair_factors(sg, exclusive=u is not None)
        A = torch.einsum("bhik,bhjk,bhkij->bhij", qc, kc, fac)
        if u is not None:
            A = A + torch.diag_embed(torch.einsum("bhik,hk,bhik->bhi", qc, u, kc))
        qhat = qc * torch.exp(read).transpose(-1, -2)                    # [B, H, L, K]
        khat = kc * torch.exp(sg["Omega"]).transpose(-1, -2)
        Hst.append(S.clone())
        As.append(A)
        o[:, sl] = (s * (qhat @ S + A @ vc)).permute(0, 2, 1, 3)
        S = torch.exp(sg["Gamma"])[..., None] * S + khat.transpose(-1, -2) @ vc
    return o, S, dict(Hst=torch.stack(Hst) if Hst else torch.zeros(0), A=As)


def chunk_bwd(q, k, v, g, do, dht=None, u=None, scale=None, initial_state=None, chunk_size=64):
    """Backward of chunk_fwd by §4.2 (GLA) / §5.2 (RWKV6): the reverse state pass gives dHst, then
    per chunk dA, dV, the decay-carrying dq'/dk' (intra sums at exponent <= 0), the u terms, and
    dlambda = (reverse cumsum of q*dq' - k*dk', exclusive for RWKV6's reader) + zeta."""
    q, k, v, g, u, do, dht = (_f64(x) for x in (q, k, v, g, u, do, dht))
    B, T, H, K = q.shape
    V = v.shape[-1]
    s = K ** -0.5 if scale is None else scale
    _, _, inter = chunk_fwd(q, k, v, g, u, scale, initial_state, chunk_size)
    starts = list(range(0, T, chunk_size))
    dS = dht.clone() if dht is not None else torch.zeros(B, H, K, V, dtype=torch.float64)
    dq, dk, dg = (torch.zeros(B, T, H, K, dtype=torch.float64) for _ in range(3))
    dv = torch.zeros(B, T, H, V, dtype=torch.float64)
    du = torch.zeros(H, K, dtype=torch.float64) if u is not None else None
    dHst, zetas = [None] * len(starts), [None] * len(starts)
    for n in reversed(range(len(starts))):
        sl = slice(starts[n], min(starts[n] + chunk_size, T))
        qc, kc, vc, doc = _bhl(q[:, sl]), _bhl(k[:, sl]), _bhl(v[:, sl]), _bhl(do[:, sl])
        sg = _segments(g[:, sl])
        S, A, dSp = inter["Hst"][n], inter["A"][n], dS
        dHst[n] = dSp
        fac, read, keep = _pair_factors(sg, exclusive=u is not None)
        eread, eomega = torch.exp(read).transpose(-1, -2), torch.exp(sg["Omega"]).transpose(-1, -2)
        qhat, khat = qc * eread, kc * eomega
        dA = s * torch.tril(doc @ vc.transpose(-1, -2))                  # diagonal included
        dvc = s * A.transpose(-1, -2) @ doc + khat @ dSp
        dAo = dA * keep                                                  # decay-carrying pairs
        dqc = s * (doc @ S.transpose(-1, -2)) * eread + torch.einsum("bhij,bhjk,bhkij->bhik", dAo, kc, fac)
        vdS = vc @ dSp.transpose(-1, -2)                                 # [B, H, L, K]
        dkc = vdS * eomega + torch.einsum("bhij,bhik,bhkij->bhjk", dAo, qc, fac)
        Splus = torch.exp(sg["Gamma"])[..., None] * S + khat.transpose(-1, -2) @ vc
        zeta = (Splus * dSp).sum(-1)                                     # [B, H, K]
        zetas[n] = zeta
        termq, termk = qc * dqc, kc * dkc
        rq = torch.flip(torch.cumsum(torch.flip(termq, [2]), 2), [2])   # sum_{t' >= t}
        rk = torch.flip(torch.cumsum(torch.flip(termk, [2]), 2), [2])
        if u is not None:                                                # reader: t' > t
            rq = torch.cat([rq[:, :, 1:], torch.zeros_like(rq[:, :, :1])], dim=2)
            dii = torch.diagonal(dA, dim1=-2, dim2=-1)[..., None]        # [B, H, L, 1]
            du += (dii * qc * kc).sum((0, 2))
            dqc = dqc + dii * u[None, :, None, :] * kc
            dkc = dkc + dii * u[None, :, None, :] * qc
        dgc = rq - rk + zeta[:, :, None, :]
        dq[:, sl], dk[:, sl], dv[:, sl], dg[:, sl] = (x.permute(0, 2, 1, 3) for x in (dqc, dkc, dvc, dgc))
        dS = torch.exp(sg["Gamma"])[..., None] * dSp + s * qhat.transpose(-1, -2) @ doc
    grads = dict(q=dq, k=dk, v=dv, g=dg, h0=dS)
    if u is not None:
        grads["u"] = du
    return grads, dict(dHst=torch.stack(dHst) if dHst else torch.zeros(0), zeta=zetas)
