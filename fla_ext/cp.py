"""Context parallelism: one packed sequence batch split across the ranks of a process group.

fla's convention: the packed B = 1 batch described by ``cu_seqlens`` (T tokens in all) is cut into
``world_size`` equal contiguous slices, rank r holding tokens ``[r T / W, (r + 1) T / W)``. Each
rank passes its slice of every ``[1, T, H, *]`` input together with the context from
:func:`build_cp_context` and gets its slice of the output::

    ctx = fla_ext.cp.build_cp_context(cu_seqlens, group=None)        # the global cu_seqlens
    o, ht = fla_ext.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True,
                              cp_context=ctx)                         # q, k, v, g: this rank's slice

How (docs/design.md §10): a sequence cut at a slice boundary needs, on the later rank, the state
its earlier part ends in. Everything a slice does with its start state is linear in it: the end
state is ``S_end = M S_in + S0`` and each row's output ``o_t = o0_t + readout_t(S_in)``, with
``S0``, ``o0`` the results from a zero start (or from the sequence's own initial state where it
begins) and ``M`` the slice's state map: diagonal for GLA, RWKV6 and GSA (the summed log
decays), a K x K matrix for RWKV7 (the product of its transitions, from the op run on the
identity with v = 0, whose output is RWKV7's readout). Each rank runs its slice once from zero
and forms its readout and M, all-gathers ``S0`` and ``M`` of the sequence cut at its end, chains
its predecessors' to get the true start state of the sequence cut at its beginning, and adds
what that state contributes: no rank runs its rows twice, and none waits on a ring. Autograd
carries the backward through the same steps: the all-gather's backward is an all-reduce that
hands each rank the gradient of its ``S0`` and ``M`` from the ranks after it.

Conventions:
* ``initial_state`` is the global ``[N, H, K, V]`` (the same on every rank); its gradient on each
  rank is that rank's contribution (rows of the sequences beginning there), to be summed over
  ranks like a data-parallel gradient. So are shared parameters' (RWKV6's ``u``).
* ``output_final_state``: every rank returns the global final states ``[N, H, K, V]`` (replicated,
  all-reduced). The global loss is the sum of the ranks' losses, so a replicated output should
  enter it on one rank (or scaled by 1 / W).
* Every rank must run the backward of its outputs (the collectives' backwards are collectives
  too), as with DistributedDataParallel; each output depends on both collectives, so a loss of
  either output on every rank is enough.
"""
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .checks import check_cu_seqlens_values
from .gsa_passes import keys_and_gates, running_lse, two_passes

__all__ = ["CPContext", "build_cp_context"]


@dataclass(frozen=True)
class RankSlice:
    """What a rank holds of the global batch (every rank knows every rank's)."""
    start: int        # its first global row
    end: int          # one past its last
    n0: int           # its sequences: global indices [n0, n1) (empty ones at its rows included)
    n1: int
    first_in: bool    # sequence n0 began on an earlier rank
    last_out: bool    # sequence n1 - 1 goes on to a later rank


@dataclass(frozen=True)
class CPContext:
    """The context of one packed batch split across a process group (build_cp_context)."""
    group: Optional[object]
    rank: int
    world_size: int
    cu_seqlens_global: torch.Tensor   # int64, host
    slices: Tuple[RankSlice, ...]     # one per rank
    cu_seqlens: torch.Tensor          # this rank's local cu_seqlens, on the inputs' device
    cu_seqlens_cpu: torch.Tensor      # its host copy

    @property
    def here(self) -> RankSlice:
        return self.slices[self.rank]

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens_global.numel() - 1

    @property
    def local_rows(self) -> int:
        return self.here.end - self.here.start


def _slices(cu: List[int], world: int) -> Tuple[RankSlice, ...]:
    T, N = cu[-1], len(cu) - 1
    per = T // world
    out = []
    for r in range(world):
        start, end = r * per, (r + 1) * per
        last = r == world - 1

        def here(n):  # sequence n has rows in [start, end), or is empty at a row of it
            if cu[n] == cu[n + 1]:
                return start <= cu[n] < end or (last and cu[n] == end)
            return cu[n] < end and cu[n + 1] > start
        seqs = [n for n in range(N) if here(n)]
        n0, n1 = (seqs[0], seqs[-1] + 1) if seqs else (0, 0)
        out.append(RankSlice(start, end, n0, n1, bool(seqs) and cu[n0] < start,
                             bool(seqs) and cu[n1] > end))
    return tuple(out)


def build_cp_context(cu_seqlens: torch.Tensor, group=None,
                     cu_seqlens_cpu: Optional[torch.Tensor] = None) -> CPContext:
    """The context parallelism context of the packed batch ``cu_seqlens`` (int64 ``[N + 1]``, the
    global boundaries, on the device of the inputs) split over ``group`` (a
    ``torch.distributed`` process group; default the world). ``cu_seqlens_cpu``: its host copy,
    else it is copied (once). T = ``cu_seqlens[-1]`` must be a positive multiple of the world
    size."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fla_ext.cp: torch.distributed is not initialised")
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"fla_ext.cp: `cu_seqlens` must be a tensor, got {type(cu_seqlens).__name__}")
    host = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).detach().cpu().to(torch.int64)
    if host.dim() != 1 or host.numel() < 2:
        raise ValueError(f"fla_ext.cp: `cu_seqlens` must be 1-D with at least 2 entries, got shape "
                         f"{tuple(host.shape)}")
    T = int(host[-1])
    check_cu_seqlens_values(host, T, "cu_seqlens_cpu" if cu_seqlens_cpu is not None else "cu_seqlens")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if T <= 0 or T % world:
        raise ValueError(f"fla_ext.cp: the total length T = {T} must be a positive multiple of the "
                         f"world size {world} (each rank holds T / {world} rows)")
    slices = _slices(host.tolist(), world)
    s = slices[rank]
    local = (host[s.n0:s.n1 + 1].clamp(s.start, s.end) - s.start).contiguous()
    return CPContext(group, rank, world, host, slices, local.to(cu_seqlens.device), local)


# ------------------------------------------------------------------------------------------------
# Differentiable collectives (gloo and NCCL: all_gather and all_reduce only)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g[dist.get_rank(ctx.group)], None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _After(torch.autograd.Function):
    """``x`` itself, made to depend on ``deps`` in autograd: the backward of x's consumers then
    reaches the collectives that produced deps on every rank (their backwards are collectives
    that all ranks must enter), with no pass over x."""
    @staticmethod
    def forward(ctx, x, *deps):
        ctx.deps = [(d.shape, d.dtype, d.device) for d in deps]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g, *[torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.deps])


# ------------------------------------------------------------------------------------------------
# The algorithm, for any family: `run_slice(cu, h0)` runs the op on the local slice with local
# boundaries cu (host list) and initial states h0 ([n, *state] or None), returning (o, final
# states [n, *state]); `carry(rows)` describes how rows [0, rows) of the
# first sequence carry a start state S through: (readout, M) with readout(S) what S adds to
# those rows' outputs and M (flat, `m_numel` long) their state map; `apply(M, S)` is M applied
# to S. Every piece of a family's state recurrence is linear in the start state, so the output
# of a sequence continuing into this slice is its zero-start output plus readout(S_in), and its
# end state M S_in plus its zero-start end state: nothing runs again once S_in is known.


def _begin_rank(ctx: CPContext) -> int:
    """The rank where the sequence continuing into this slice began: back over the ranks whose
    first sequence is it (they hold only rows of it)."""
    n, r0 = ctx.here.n0, ctx.rank - 1
    while ctx.slices[r0].first_in and ctx.slices[r0].n0 == n:
        r0 -= 1
    return r0


def run(ctx: CPContext, *, run_slice: Callable, carry: Callable, m_numel: int, apply: Callable,
        state_shape, state_dtype, initial_state, output_final_state: bool, device):
    if not isinstance(ctx, CPContext):
        raise TypeError(f"fla_ext: `cp_context` must come from fla_ext.cp.build_cp_context, got "
                        f"{type(ctx).__name__}")
    s = ctx.here
    dev = device  # the inputs' (the context's cu_seqlens may sit elsewhere)
    nl = s.n1 - s.n0
    cu = ctx.cu_seqlens_cpu.tolist()
    state_numel = 1
    for d in state_shape:
        state_numel *= d
    zeros = lambda n: torch.zeros(n, *state_shape, dtype=state_dtype, device=dev)  # noqa: E731

    # 1. The slice with every sequence's start state known here; the sequence continuing from an
    #    earlier rank starts from zero, and its rows' readout and state map are formed, all before
    #    any rank waits on another.
    h0 = None
    if initial_state is not None or s.first_in:
        h0 = initial_state[s.n0:s.n1] if initial_state is not None else zeros(nl)
        if s.first_in:
            h0 = torch.cat([zeros(1), h0[1:]])
    first_rows = cu[1]
    o, ht = run_slice(cu, h0)
    readout, m_first = carry(first_rows) if s.first_in else (None, None)

    # 2. What the sequence cut at this slice's end needs from here: S0, and M where it also began
    #    before this slice (it then spans the whole slice).
    through = s.first_in and s.last_out and nl == 1
    payload_s0 = ht[-1].reshape(-1) if s.last_out else zeros(1).reshape(-1)
    payload_m = (m_first.reshape(-1) if through
                 else torch.zeros(m_numel, dtype=state_dtype, device=dev))
    payload = torch.cat([payload_s0.to(state_dtype), payload_m.to(state_dtype)])
    if torch.is_grad_enabled() and not payload.requires_grad:
        # a rank whose payload is constant (zeros) still takes part in the backward's all-reduce
        payload.requires_grad_(True)
    gathered = _AllGather.apply(payload, ctx.group)

    # 3. The first sequence's true start state, chained over the ranks before this one, and what
    #    it adds to that sequence's rows and end state.
    if s.first_in:
        r0 = _begin_rank(ctx)
        state = gathered[r0, :state_numel].reshape(state_shape)
        for r in range(r0 + 1, ctx.rank):  # ranks it passes through
            m = gathered[r, state_numel:]
            state = apply(m, state) + gathered[r, :state_numel].reshape(state_shape)
        o_first = (o[:, :first_rows] + readout(state)).to(o.dtype)
        o = torch.cat([o_first, o[:, first_rows:]], dim=1) if first_rows < ctx.local_rows else o_first
        ht_first = (apply(m_first, state) + ht[0].to(state_dtype)).to(ht.dtype).unsqueeze(0)
        ht = torch.cat([ht_first, ht[1:]]) if nl > 1 else ht_first
    o = _After.apply(o, gathered)  # every rank's outputs depend on the gather: its backward runs

    if not output_final_state:
        return o, None
    # 4. Final states: the rows of the sequences ending here, the rest 0, summed over ranks.
    ends = nl - (1 if s.last_out else 0)
    full = torch.zeros(ctx.num_sequences, *state_shape, dtype=state_dtype, device=dev)
    if ends > 0:
        full = torch.cat([full[:s.n0], ht[:ends].to(state_dtype), full[s.n0 + ends:]])
    full = _AllReduce.apply(_After.apply(full, gathered), ctx.group)
    # o depends on the all-reduce too: a rank whose loss takes only o runs its backward as well,
    # so that every rank makes the same collective calls in the same order
    return _After.apply(o, full), full


# ------------------------------------------------------------------------------------------------
# Families


def _local_cu(cu, device) -> dict:
    """The keywords that hand a piece of the slice its boundaries (host list `cu`) on `device`."""
    host = torch.tensor(cu, dtype=torch.int64)
    return dict(cu_seqlens=host.to(device), cu_seqlens_cpu=host)


def _rows(x: Optional[torch.Tensor], rows: int):
    return None if x is None else x[:, :rows]


def check_inputs(ctx, x: torch.Tensor, head_first: bool, cu_seqlens, reverse=False, name="the inputs"):
    """What an op checks of a call with ``cp_context`` before anything runs."""
    if not isinstance(ctx, CPContext):
        raise TypeError(f"fla_ext: `cp_context` must come from fla_ext.cp.build_cp_context, got "
                        f"{type(ctx).__name__}")
    if head_first:
        raise NotImplementedError("fla_ext: `cp_context` takes [1, T, H, D] inputs (head_first=False)")
    if cu_seqlens is not None:
        raise ValueError("fla_ext: with `cp_context`, pass no `cu_seqlens`: the context carries the "
                         "boundaries (build_cp_context takes the global cu_seqlens)")
    if reverse:
        raise NotImplementedError("fla_ext: `cp_context` with reverse=True is not supported")
    if x.dim() != 4 or x.shape[0] != 1 or x.shape[1] != ctx.local_rows:
        raise ValueError(f"fla_ext: with `cp_context`, `{name}` must be this rank's slice [1, "
                         f"{ctx.local_rows}, H, D], got {tuple(x.shape)}")


_SCAN_BLOCK = 256


def _scan_rows(x):
    """Inclusive running sums of x [rows, ...] over dim 0 in two levels (within blocks of 256
    rows, then over the blocks' totals): torch scans an outer dimension with a loop over its
    length, so one level over a long slice is a long serial chain."""
    rows = x.shape[0]
    if rows <= _SCAN_BLOCK:
        return torch.cumsum(x, 0)
    nb = -(-rows // _SCAN_BLOCK)
    padded = torch.cat([x, x.new_zeros(nb * _SCAN_BLOCK - rows, *x.shape[1:])])
    y = padded.view(nb, _SCAN_BLOCK, *x.shape[1:]).cumsum(1)
    before = y[:, -1].cumsum(0)  # the blocks' running totals (-inf stays -inf: no +inf anywhere)
    y[1:] += before[:-1].unsqueeze(1)
    return y.view(nb * _SCAN_BLOCK, *x.shape[1:])[:rows]


def _running_sum(g, rows, dtype, exclusive=False):
    """The running sums of g[0, :rows] ([1, T, H, D]) over time, [rows, H, D] in ``dtype``.
    ``exclusive``: the sum of the rows before each."""
    run = _scan_rows(g[0, :rows].to(dtype))
    if exclusive:  # shifted, not run - g: that is NaN where the decay is -inf
        run = torch.cat([torch.zeros_like(run[:1]), run[:-1]])
    return run


def _reverse_running_sum(x):
    return torch.flip(_scan_rows(torch.flip(x, [0])), [0])


class _DiagReader(torch.autograd.Function):
    """scale q_t * e^G_t over rows [0, rows), G the running sums of gk (exclusive: of the rows
    before), [rows, H, K] float32 (float64 for float64 inputs): how row t reads a start state.
    Keeps only its output for the backward."""
    @staticmethod
    def forward(ctx, q, gk, scale, exclusive, rows, dtype):
        decay = torch.exp(_running_sum(gk, rows, dtype, exclusive)).mul_(scale)
        reader = q[0, :rows] * decay
        ctx.save_for_backward(q, gk, reader)
        ctx.scale, ctx.exclusive, ctx.rows = scale, exclusive, rows
        return reader

    @staticmethod
    def backward(ctx, dreader):
        q, gk, reader = ctx.saved_tensors
        rows = ctx.rows
        decay = torch.exp(_running_sum(gk, rows, reader.dtype, ctx.exclusive)).mul_(ctx.scale)
        dq_rows = (dreader * decay).to(q.dtype)
        dsum = dreader * reader  # d/d(the running sum)
        if ctx.exclusive:  # row t's sum holds the rows before it
            dsum = torch.cat([dsum[1:], torch.zeros_like(dsum[:1])])
        dgk_rows = _reverse_running_sum(dsum).to(gk.dtype)
        if rows == q.shape[1]:
            return dq_rows.unsqueeze(0), dgk_rows.unsqueeze(0), None, None, None, None
        dq, dgk = torch.zeros_like(q), torch.zeros_like(gk)
        dq[0, :rows], dgk[0, :rows] = dq_rows, dgk_rows
        return dq, dgk, None, None, None, None


_SPLIT_ROWS = 1024


class _ReadState(torch.autograd.Function):
    """reader [rows, H, K] times state [H, K, V], per head: [rows, H, V]. The state's gradient,
    a sum over all rows, runs as many products over blocks of rows (one over a long slice
    leaves most of the GPU idle) and is formed first: the ranks before this one wait on it."""
    @staticmethod
    def forward(ctx, reader, state):
        ctx.save_for_backward(reader, state)
        return torch.matmul(reader.transpose(0, 1), state).transpose(0, 1)

    @staticmethod
    def backward(ctx, grad):
        reader, state = ctx.saved_tensors
        grad = grad.to(state.dtype)
        rows = reader.shape[0]
        whole = rows // _SPLIT_ROWS * _SPLIT_ROWS
        dstate = torch.einsum("thk,thv->hkv", reader[whole:], grad[whole:])
        if whole:
            split = lambda x: x[:whole].view(whole // _SPLIT_ROWS, _SPLIT_ROWS, *x.shape[1:])  # noqa: E731
            dstate = dstate + torch.einsum("sthk,sthv->shkv", split(reader), split(grad)).sum(0)
        dreader = torch.matmul(grad.transpose(0, 1), state.transpose(1, 2)).transpose(0, 1)
        return dreader, dstate


def _diag_carry(q, gk, gv, scale, H, K, V, dtype, exclusive_reader=False):
    """GLA / RWKV6 / GSA pass, S_t = diag(e^gk_t) S_{t-1} diag(e^gv_t) + k_t v_t^T read by
    o_t = scale q_t^T S_t (RWKV6: S_{t-1}, the exclusive reader): a start state S reaches row t
    as diag(e^Gk_t) S diag(e^Gv_t), G the running sums of the log decays (never positive, so
    the exponentials cannot overflow). M = (e^Gk, e^Gv) at the last row, flat [H, K + V].
    The reader is formed before the all-gather, while other ranks still run their slices."""
    def fn(rows):
        dev = q.device
        if gk is not None:
            reader = _DiagReader.apply(q, gk, scale, exclusive_reader, rows, dtype)
        else:
            reader = q[0, :rows].to(dtype) * scale
        value_decay = None if gv is None else torch.exp(_running_sum(gv, rows, dtype))

        def readout(state):  # [H, K, V] -> [1, rows, H, V]
            out = _ReadState.apply(reader, state)
            return (out if value_decay is None else out * value_decay).unsqueeze(0)
        dk = (torch.exp(gk[0, :rows].to(dtype).sum(0)) if gk is not None
              else torch.ones(H, K, dtype=dtype, device=dev))
        dv = value_decay[-1] if gv is not None else torch.ones(H, V, dtype=dtype, device=dev)
        return readout, torch.cat([dk, dv], dim=-1)
    return fn


def _diag_apply(H, K, V):
    def apply(m, state):
        m = m.reshape(H, K + V)
        return m[:, :K, None] * state * m[:, None, K:]
    return apply


def gla(op, ctx, q, k, v, gk, gv, scale, initial_state, output_final_state, extra):
    """chunk_gla / fused_recurrent_gla (``op``: the public function) under ``ctx``."""
    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = K ** -0.5 if scale is None else scale

    def run_slice(cu, h0):
        return op(q, k, v, gk, gv=gv, scale=scale, initial_state=h0, output_final_state=True,
                  **_local_cu(cu, q.device), **extra)
    return run(ctx, run_slice=run_slice, carry=_diag_carry(q, gk, gv, scale, H, K, V, acc),
               m_numel=H * (K + V), apply=_diag_apply(H, K, V), state_shape=(H, K, V), state_dtype=acc,
               initial_state=initial_state, output_final_state=output_final_state, device=k.device)


def rwkv6(op, ctx, r, k, v, w, u, scale, initial_state, output_final_state):
    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    acc = torch.float64 if r.dtype == torch.float64 else torch.float32
    scale = K ** -0.5 if scale is None else scale

    def run_slice(cu, h0):
        return op(r, k, v, w, u, scale=scale, initial_state=h0, output_final_state=True,
                  **_local_cu(cu, r.device))
    carry = _diag_carry(r, w, None, scale, H, K, V, acc, exclusive_reader=True)
    return run(ctx, run_slice=run_slice, carry=carry, m_numel=H * (K + V),
               apply=_diag_apply(H, K, V), state_shape=(H, K, V), state_dtype=acc,
               initial_state=initial_state, output_final_state=output_final_state, device=k.device)


def rwkv7(op, ctx, r, w, k, v, a, b, scale, initial_state, output_final_state):
    """chunk_rwkv7 / fused_recurrent_rwkv7. The rows' map P_t = the product of their transitions
    (diag(e^w) + b a^T) acts on each value column of the state alike, so the op run from the
    identity with v = 0 gives both what a start state S adds to row t (its output Y_t, times S)
    and M = P at the last row (its final state)."""
    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    acc = torch.float64 if r.dtype == torch.float64 else torch.float32

    def call(rows, cu, h0, vv):
        return op(_rows(r, rows), _rows(w, rows), _rows(k, rows), vv, _rows(a, rows), _rows(b, rows),
                  scale=scale, initial_state=h0, output_final_state=True, **_local_cu(cu, r.device))

    def run_slice(cu, h0):
        return call(cu[-1], cu, h0, v)

    def carry(rows):
        eye = torch.eye(K, dtype=acc, device=r.device).expand(1, H, K, K).contiguous()
        zero_v = torch.zeros(1, rows, H, K, dtype=v.dtype, device=v.device)
        reader, m = call(rows, [0, rows], eye, zero_v)

        def readout(state):  # [H, K, V] -> [1, rows, H, V]
            return _ReadState.apply(reader[0].to(acc), state).unsqueeze(0)
        return readout, m[0]

    def apply(m, state):
        return torch.matmul(m.reshape(H, K, K), state)
    return run(ctx, run_slice=run_slice, carry=carry, m_numel=H * K * K, apply=apply,
               state_shape=(H, K, V), state_dtype=acc, initial_state=initial_state,
               output_final_state=output_final_state, device=k.device)


def _additive_gate(ctx: CPContext, s: torch.Tensor, key_dtype):
    """GSA's g = None (fla's ABC) under ``ctx`` (gsa_passes.py): the running log-sum-exp of the
    sequence continuing into this slice starts from the earlier ranks' totals (one all-gather)."""
    sl = ctx.here
    x = s.float()
    cu = ctx.cu_seqlens_cpu.tolist()
    parts = running_lse(x, cu, 1)
    # each rank's total over its last sequence's rows, where that sequence goes on
    H, M = x.shape[2], x.shape[3]
    total = parts[-1][0, -1] if sl.last_out else torch.full((H, M), -torch.inf, device=x.device)
    if torch.is_grad_enabled() and not total.requires_grad:
        total = total.detach().requires_grad_(True)
    totals = _AllGather.apply(total.contiguous(), ctx.group)  # [world, H, M]
    z_in = None
    if sl.first_in:
        r0 = _begin_rank(ctx)
        z_in = torch.logsumexp(totals[r0:ctx.rank], 0)
        parts[0] = torch.logaddexp(parts[0], z_in)
    keys, gates = keys_and_gates(x, parts, cu, 1, z_in)
    # every rank's result depends on the gather
    return _After.apply(keys.to(key_dtype), totals), _After.apply(gates.to(s.dtype), totals)


def gsa(gla_op, ctx, q, k, v, s, g, scale, initial_state, output_final_state):
    """chunk_gsa / fused_recurrent_gsa as its two GLA passes around the float32 softmax over
    slots (gsa_passes.py), each pass under ``ctx``."""
    if g is None:
        s, g = _additive_gate(ctx, s, k.dtype)
    return two_passes(
        lambda q_, k_, v_, gk, gv, scale_, h0: gla(gla_op, ctx, q_, k_, v_, gk, gv, scale_, h0,
                                                   output_final_state, {}),
        q, k, v, s, g, scale, initial_state, output_final_state, heads_dim=2)


# ------------------------------------------------------------------------------------------------
# Layers: token shift and short convolutions read the rows before the slice


def layer_inputs(layer, ctx, hidden_states, attention_mask, past_key_values, use_cache, cu_seqlens):
    """What a layer checks of a call with ``cp_context``; returns this slice's (cu_seqlens,
    cu_seqlens_cpu)."""
    who = type(layer).__name__
    if not isinstance(ctx, CPContext):
        raise TypeError(f"fla_ext: {who}: `cp_context` must come from fla_ext.cp.build_cp_context, "
                        f"got {type(ctx).__name__}")
    if attention_mask is not None or cu_seqlens is not None:
        raise ValueError(f"fla_ext: {who}: with `cp_context`, pass neither attention_mask nor "
                         "cu_seqlens (the context carries the sequences)")
    if past_key_values is not None or use_cache:
        raise NotImplementedError(f"fla_ext: {who}: a cache is not supported with `cp_context`")
    if hidden_states.dim() != 3 or hidden_states.shape[:2] != (1, ctx.local_rows):
        raise ValueError(f"fla_ext: {who}: with `cp_context`, hidden_states must be this rank's "
                         f"slice [1, {ctx.local_rows}, hidden_size], got {tuple(hidden_states.shape)}")
    return ctx.cu_seqlens, ctx.cu_seqlens_cpu


def halo(ctx: CPContext, x: torch.Tensor, width: int) -> torch.Tensor:
    """The ``width`` rows before this slice of the sequence that continues into it, as the
    per-sequence cache of token shift / a short convolution: [local sequences, width, C], zero
    for the other sequences and before that sequence's first row. x: this slice [1, rows, C].
    Differentiable (the rows' gradient goes back to the rank that holds them)."""
    s = ctx.here
    if ctx.local_rows < width:
        raise NotImplementedError(f"fla_ext: `cp_context` needs at least {width} rows per rank "
                                  f"here (a {width}-row look-back), got {ctx.local_rows}")
    tail = x[0, ctx.local_rows - width:]
    if torch.is_grad_enabled() and not tail.requires_grad:
        tail = tail.detach().requires_grad_(True)
    rows = _AllGather.apply(tail, ctx.group)  # [world, width, C]
    cache = torch.zeros(s.n1 - s.n0, width, x.shape[-1], dtype=x.dtype, device=x.device)
    if s.first_in:
        first_row = int(ctx.cu_seqlens_global[s.n0])
        keep = torch.arange(s.start - width, s.start, device=x.device) >= first_row
        cache = torch.cat([(rows[ctx.rank - 1] * keep[:, None].to(x.dtype)).unsqueeze(0), cache[1:]])
    return _After.apply(cache, rows)  # every rank's result depends on the gather
