"""Head dims above the kernels' 256, up to 512, for the diagonal-decay ops (GLA, RWKV6), as
slices the kernels take. Their state's rows (keys) and columns (values) evolve independently:
row k of S_t depends only on q, k, g at k and v; column v only on v, gv at v. So the op on
key slice i and value slice j gives the (i, j) block of the final state, and the output's value
slice j is the sum over key slices of their outputs (o_t = scale sum_k q_tk S_tk, RWKV6's bonus
term sum_k r_tk u_k k_tk v_t alike). The sum is taken in float32. Autograd runs the slices'
backwards. GSA above 256 runs as its two GLA passes, each through here (gsa_passes.py). RWKV7's
keys mix (the a b^T transition), so its K stays at most 256."""
from typing import Callable, Dict, Optional

import torch

KERNEL_MAX_HEAD_DIM = 256  # csrc/ops/common.h kMaxHeadDim
MAX_HEAD_DIM = 2 * KERNEL_MAX_HEAD_DIM


def needs_slices(*dims: int) -> bool:
    return any(d > KERNEL_MAX_HEAD_DIM for d in dims)


def _dim(named: Dict[str, Optional[torch.Tensor]], what: str) -> int:
    """The common last dim of the named tensors (None skipped), checked."""
    dims = {n: t.shape[-1] for n, t in named.items() if t is not None}
    names = ", ".join(dims)
    if len(set(dims.values())) != 1:
        raise ValueError(f"fla_ext: {what} (last dim of {names}) must agree: " +
                         ", ".join(f"`{n}` has {d}" for n, d in dims.items()))
    d = next(iter(dims.values()))
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"fla_ext: {what} (last dim of {names}) must be in [1, {MAX_HEAD_DIM}], got {d}")
    return d


def _pieces(d: int):
    return [(a, min(a + KERNEL_MAX_HEAD_DIM, d)) for a in range(0, d, KERNEL_MAX_HEAD_DIM)]


def by_slices(run: Callable, keyed: Dict[str, Optional[torch.Tensor]],
              valued: Dict[str, Optional[torch.Tensor]], initial_state: Optional[torch.Tensor],
              output_final_state: bool):
    """(o, final state or None) of the op over key and value slices of at most 256.
    ``run(keyed_slices, valued_slices, h0_slice)`` runs the op on one pair of slices (dicts of
    the same names, tensors sliced on their last dim; h0 as the state block) and returns
    (o, ht). keyed: the inputs whose last dim is K (q, k, g, u); valued: V (v, gv);
    initial_state: [..., K, V]. Every shape is checked before anything runs."""
    K, V = _dim(keyed, "K"), _dim(valued, "V")
    if initial_state is not None and tuple(initial_state.shape[-2:]) != (K, V):
        raise ValueError(f"fla_ext: `initial_state` must end in [K, V] = [{K}, {V}], got "
                         f"{tuple(initial_state.shape)}")
    cut = lambda t, a, b: None if t is None else t[..., a:b]  # noqa: E731
    outs, state_cols = [], []
    for v0, v1 in _pieces(V):
        total, rows = None, []
        for k0, k1 in _pieces(K):
            o, ht = run({n: cut(t, k0, k1) for n, t in keyed.items()},
                        {n: cut(t, v0, v1) for n, t in valued.items()},
                        None if initial_state is None else initial_state[..., k0:k1, v0:v1])
            total = o.float() if total is None else total + o.float()
            rows.append(ht)
        outs.append(total.to(o.dtype))
        if output_final_state:
            state_cols.append(torch.cat(rows, dim=-2))
    return torch.cat(outs, dim=-1), (torch.cat(state_cols, dim=-1) if output_final_state else None)
