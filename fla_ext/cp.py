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
# first sequence carry a start state S through: (read, M) with read(x, S) those rows' outputs x
# plus what S adds to them and M (flat, `m_numel` long) their state map; `apply(M, S)` is M applied
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


def _require_context(ctx, who: str = "") -> None:
    if not isinstance(ctx, CPContext):
        at = f"fla_ext: {who}: " if who else "fla_ext: "
        if type(ctx).__module__.split(".")[0] == "fla":  # fla's FLACPContext: another protocol
            raise NotImplementedError(
                f"{at}fla's context parallelism ({type(ctx).__name__}: local cu_seqlens, no "
                "states) is not supported; build a `cp_context` with fla_ext.cp.build_cp_context "
                "(the global cu_seqlens; initial and final states work)")
        raise TypeError(f"{at}`cp_context` must come from fla_ext.cp.build_cp_context, got "
                        f"{type(ctx).__name__}")


def run(ctx: CPContext, *, run_slice: Callable, carry: Callable, m_numel: int, apply: Callable,
        state_shape, state_dtype, initial_state, output_final_state: bool, device):
    _require_context(ctx)
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
    read, m_first = carry(first_rows) if s.first_in else (None, None)

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
        o_first = read(o[:, :first_rows], state)
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
    _require_context(ctx)
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


# Rows per block of the readout: its float32 temporaries are [block, H, K or V], whatever the
# slice's length (held whole, they were several times the inputs' size on long slices).
_READ_ROWS = 1 << 16


def _blocks(rows):
    return [(t0, min(rows, t0 + _READ_ROWS)) for t0 in range(0, rows, _READ_ROWS)]


def _block_carries(g, rows, acc):
    """The sum of g[0] over the rows before each block, [blocks, H, D] in ``acc`` (None for g
    None): the running sums then start each block from its carry."""
    if g is None:
        return None
    totals = torch.stack([g[0, t0:t1].sum(0, dtype=acc) for t0, t1 in _blocks(rows)])
    return torch.cat([torch.zeros_like(totals[:1]), totals[:-1].cumsum(0)])


class _Reader:
    """How rows [0, rows) of a diagonal-decay pass read a start state S: row t adds
    (scale q_t e^Gk_t)^T S e^Gv_t, Gk / Gv the running sums of gk / gv over the slice (Gk of the
    rows before t for RWKV6's exclusive reader; gk or gv None: no such decay), formed per block
    of rows, each from its carries ck / cv (_block_carries). Every exponent is a sum of log
    decays <= 0: no overflow."""

    def __init__(self, q, gk, gv, ck, cv, scale, exclusive, rows, acc):
        self.q, self.gk, self.gv, self.scale, self.exclusive, self.acc = q, gk, gv, scale, exclusive, acc
        self.rows, self.blocks, self.ck, self.cv = rows, _blocks(rows), ck, cv

    def _running(self, g, carry, t0, t1, exclusive):
        run = _scan_rows(g[0, t0:t1].to(self.acc)) + carry
        return torch.cat([carry.unsqueeze(0), run[:-1]]) if exclusive else run

    def block(self, i):
        """(reader [n, H, K], e^Gk [n, H, K] or None, e^Gv [n, H, V] or None) of block i."""
        t0, t1 = self.blocks[i]
        q = self.q[0, t0:t1].to(self.acc)
        egk = None if self.gk is None else torch.exp(self._running(self.gk, self.ck[i], t0, t1, self.exclusive))
        egv = None if self.gv is None else torch.exp(self._running(self.gv, self.cv[i], t0, t1, False))
        reader = q * self.scale if egk is None else q * egk * self.scale
        return reader, egk, egv


_SPLIT_ROWS = 1024


def _state_grad(reader, grad):
    """sum over rows t of reader_t grad_t^T per head ([n, H, K] x [n, H, V] -> [H, K, V]) as many
    products over 1024-row pieces: one product over many rows runs on a handful of CTAs
    (benchmarks/NOTES.md c23)."""
    rows = reader.shape[0]
    whole = rows // _SPLIT_ROWS * _SPLIT_ROWS
    out = torch.einsum("thk,thv->hkv", reader[whole:], grad[whole:])
    if whole:
        split = lambda x: x[:whole].view(whole // _SPLIT_ROWS, _SPLIT_ROWS, *x.shape[1:])  # noqa: E731
        out = out + torch.einsum("sthk,sthv->shkv", split(reader), split(grad)).sum(0)
    return out


def _keep_reader(ctx, x, q, gk, gv, ck, cv, state, scale, exclusive):
    """What both readout nodes keep for their backward: the reader's inputs, not the reader."""
    ctx.scale, ctx.exclusive, ctx.rows = scale, exclusive, x.shape[1]
    ctx.save_for_backward(q, gk, gv, ck, cv, state)


def _kept_reader(ctx):
    """(the _Reader, the state) from what _keep_reader kept."""
    q, gk, gv, ck, cv, state = ctx.saved_tensors
    return _Reader(q, gk, gv, ck, cv, ctx.scale, ctx.exclusive, ctx.rows, state.dtype), state


class _ReadoutState(torch.autograd.Function):
    """x + what ``state`` adds to rows [0, rows) (x: [1, rows, H, V], their zero-start outputs),
    in x's dtype, block by block. Its backward gives only the state's gradient (the ranks before
    this one wait on it in the all-reduce); _ReadoutInputs, inside it, gives q's and the decays'."""
    @staticmethod
    def forward(ctx, x, q, gk, gv, ck, cv, state, scale, exclusive):
        _keep_reader(ctx, x, q, gk, gv, ck, cv, state, scale, exclusive)
        reader = _Reader(q, gk, gv, ck, cv, scale, exclusive, x.shape[1], state.dtype)
        out = torch.empty_like(x)
        for i, (t0, t1) in enumerate(reader.blocks):
            r, _, egv = reader.block(i)
            y = torch.einsum("thk,hkv->thv", r, state)
            out[0, t0:t1] = x[0, t0:t1] + (y if egv is None else y * egv)  # one rounding to x's dtype
        return out

    @staticmethod
    def backward(ctx, g):
        reader, state = _kept_reader(ctx)
        dstate = torch.zeros_like(state)
        for i, (t0, t1) in enumerate(reader.blocks):
            r, _, egv = reader.block(i)
            gb = g[0, t0:t1].to(state.dtype)
            dstate += _state_grad(r, gb if egv is None else gb * egv)
        return g, None, None, None, None, None, dstate, None, None


class _ReadoutInputs(torch.autograd.Function):
    """x itself in the forward; in the backward, the gradients of q, gk and gv through the
    readout of ``state`` (a constant here: _ReadoutState gives its gradient), block by block
    from the last, the decays' as reverse running sums carried across blocks."""
    @staticmethod
    def forward(ctx, x, q, gk, gv, ck, cv, state, scale, exclusive):
        _keep_reader(ctx, x, q, gk, gv, ck, cv, state, scale, exclusive)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        reader, state = _kept_reader(ctx)
        q, gk, gv = reader.q, reader.gk, reader.gv
        need_q, need_gk, need_gv = ctx.needs_input_grad[1:4]
        dq = torch.zeros_like(q) if need_q else None
        dgk = torch.zeros_like(gk) if need_gk else None
        dgv = torch.zeros_like(gv) if need_gv else None
        acc = state.dtype
        after_k = after_v = None  # the reverse running sums at the start of the later block
        next_k = None  # exclusive reader: the first row's d/dGk of the later block
        for i in reversed(range(len(reader.blocks))):
            t0, t1 = reader.blocks[i]
            r, egk, egv = reader.block(i)
            gb = g[0, t0:t1].to(acc)
            if need_gv:  # y = (r^T S) e^Gv: d/dGv_t = g_t (r_t^T S) e^Gv_t
                dsv = gb * torch.einsum("thk,hkv->thv", r, state) * egv
                rev = _reverse_running_sum(dsv) + (0 if after_v is None else after_v)
                after_v, dgv[0, t0:t1] = rev[0], rev
            dr = torch.einsum("thv,hkv->thk", gb if egv is None else gb * egv, state)
            if need_q:
                dq[0, t0:t1] = dr * ctx.scale if egk is None else dr * egk * ctx.scale
            if need_gk:  # d/dGk_t = dr_t r_t; Gk_t sums the rows up to t (before t: exclusive)
                dsk = dr * r
                if ctx.exclusive:
                    first = dsk[0]
                    dsk = torch.cat([dsk[1:], (torch.zeros_like(first) if next_k is None else next_k).unsqueeze(0)])
                    next_k = first
                rev = _reverse_running_sum(dsk) + (0 if after_k is None else after_k)
                after_k, dgk[0, t0:t1] = rev[0], rev
        return g, dq, dgk, dgv, None, None, None, None, None


def readout(x, q, gk, gv, state, scale, exclusive=False):
    """x [1, rows, H, V] plus what ``state`` [H, K, V] adds to those rows of a diagonal-decay pass
    (see _Reader; RWKV7: q its identity run's output, no decays), in x's dtype, with no
    [rows, H, K]-sized float32 tensor kept or held whole. The blocks' carries are summed once, for
    both nodes and their backwards."""
    with torch.no_grad():
        ck = _block_carries(gk, x.shape[1], state.dtype)
        cv = _block_carries(gv, x.shape[1], state.dtype)
    x = _ReadoutInputs.apply(x, q, gk, gv, ck, cv, state.detach(), scale, exclusive)
    return _ReadoutState.apply(x, q.detach(), None if gk is None else gk.detach(),
                               None if gv is None else gv.detach(), ck, cv, state, scale, exclusive)


def _reverse_running_sum(x):
    return torch.flip(_scan_rows(torch.flip(x, [0])), [0])


def _diag_carry(q, gk, gv, scale, H, K, V, dtype, exclusive_reader=False):
    """GLA / RWKV6 / GSA pass, S_t = diag(e^gk_t) S_{t-1} diag(e^gv_t) + k_t v_t^T read by
    o_t = scale q_t^T S_t (RWKV6: S_{t-1}, the exclusive reader): a start state S reaches row t
    as diag(e^Gk_t) S diag(e^Gv_t), G the running sums of the log decays (never positive, so
    the exponentials cannot overflow). M = (e^Gk, e^Gv) at the last row, flat [H, K + V]."""
    def fn(rows):
        dev = q.device

        def read(x, state):  # x [1, rows, H, V] plus what state [H, K, V] adds to it
            return readout(x, q[:, :rows], None if gk is None else gk[:, :rows],
                           None if gv is None else gv[:, :rows], state, scale, exclusive_reader)
        dk = (torch.exp(gk[0, :rows].sum(0, dtype=dtype)) if gk is not None
              else torch.ones(H, K, dtype=dtype, device=dev))
        dv = (torch.exp(gv[0, :rows].sum(0, dtype=dtype)) if gv is not None
              else torch.ones(H, V, dtype=dtype, device=dev))
        return read, torch.cat([dk, dv], dim=-1)
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

        def read(x, state):  # x [1, rows, H, V] plus what state [H, K, V] adds to it
            return readout(x, reader, None, None, state, 1.0)
        return read, m[0]

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
    _require_context(ctx, who)
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
