"""Losses the language models use, with fla 0.6.0's semantics: a cross-entropy over given logits
and a fused linear + cross-entropy, neither holding a float32 copy of the full logits, and RWKV's
L2Wrap (each row's largest logit pulled towards 0: in the backward it gets l2_penalty_factor /
rows x itself, times the loss's own gradient, as fla's l2_warp; RWKV-LM's original leaves that
part unscaled, which loss scaling and gradient accumulation then distort)."""
import torch
import torch.nn.functional as F

_REDUCTIONS = ("mean", "sum")


def l2wrap_factor(rows: int, l2_penalty_factor: float = 1e-4) -> float:
    """L2Wrap's weight over `rows` rows of logits: a row's largest logit gets this x itself."""
    return l2_penalty_factor / max(1, rows)


class L2Wrap(torch.autograd.Function):
    """loss in the forward; in the backward each row's largest logit also gets l2wrap_factor(rows)
    x itself x the loss's gradient (fla's l2_warp; rows: every dimension of logits but the last).
    Keeps each row's top logit and its index, not the logits."""

    @staticmethod
    def forward(ctx, loss, logits, l2_penalty_factor: float = 1e-4):
        top, idx = logits.max(-1, keepdim=True)
        rows = logits.numel() // max(1, logits.shape[-1])
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        ctx.save_for_backward(top * l2wrap_factor(rows, l2_penalty_factor), idx)
        return loss

    @staticmethod
    def backward(ctx, grad):
        top, idx = ctx.saved_tensors
        glogits = torch.zeros(ctx.shape, dtype=ctx.dtype, device=top.device)
        return grad, glogits.scatter_(-1, idx, (top * grad).to(ctx.dtype)), None


l2_warp = L2Wrap.apply  # fla's name: l2_warp(loss, logits, l2_penalty_factor=1e-4)


def default_chunk_rows(vocab: int) -> int:
    """Rows per chunk: a chunk's float32 logits stay near 256 MB whatever the vocabulary."""
    return max(64, (1 << 26) // max(1, vocab))


def _targets(labels):
    """(which rows count: label not -100, the labels as gather indices [rows, 1] with -100 as 0)."""
    live = labels != -100
    return live, torch.where(live, labels, torch.zeros_like(labels)).unsqueeze(-1)


def _chunk_loss(logits, labels):
    """(sum of -log softmax at the labels over the rows that count, the rows' log-sum-exp, and
    _targets(labels)) of float logits."""
    lse = torch.logsumexp(logits, -1)
    live, safe = _targets(labels)
    return torch.where(live, lse - logits.gather(-1, safe).squeeze(-1), 0.).sum(), lse, live, safe


def _logit_grads_(logits, lse, live, safe, weight, l2):
    """The gradient wrt float logits, in place of them: (softmax - one-hot label) x weight on the
    rows that count, 0 on the others, plus (``l2`` not None) l2 x each row's top logit there."""
    top, idx = logits.max(-1, keepdim=True) if l2 is not None else (None, None)
    g = logits.sub_(lse.unsqueeze(-1)).exp_()
    g.scatter_add_(-1, safe, -live.unsqueeze(-1).to(g.dtype))
    g.mul_((live.to(g.dtype) * weight).unsqueeze(-1))
    if l2 is not None:
        g.scatter_add_(-1, idx, top * l2)
    return g


def _divisor(labels, reduction, acc):
    """What the summed loss is divided by: the count of labels that are not -100 ("mean"), or 1."""
    count = (labels != -100).sum().clamp(min=1).to(acc)
    return count if reduction == "mean" else torch.ones_like(count)


class _LinearCrossEntropy(torch.autograd.Function):
    """-log softmax(hidden @ weight.T)[label] summed over the rows (divided by the count of labels
    that are not -100 for "mean"), with L2Wrap's gradient. The loss is a scalar, so its gradients
    are made in the forward, chunk by chunk (as fla's fused linear cross-entropy): a chunk's
    logits are made, turned into their gradient in place and dropped, and the backward only
    scales what was kept ([rows, hidden] and [vocab, hidden] in float32, float64 for float64
    inputs)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_rows: int, l2wrap: bool, reduction: str):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = torch.promote_types(hidden.dtype, torch.float32)
        div = _divisor(labels, reduction, acc)
        total = hidden.new_zeros((), dtype=acc)
        dh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if want_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        l2 = l2wrap_factor(hidden.shape[0]) if l2wrap else None
        for i in range(0, hidden.shape[0], chunk_rows):
            h, y = hidden[i:i + chunk_rows], labels[i:i + chunk_rows]
            logits = F.linear(h, weight).to(acc)
            loss, lse, live, safe = _chunk_loss(logits, y)
            total = total + loss
            if not (want_h or want_w):
                continue
            g = _logit_grads_(logits, lse, live, safe, 1 / div, l2).to(weight.dtype)
            if want_h:
                dh[i:i + chunk_rows] = g @ weight
            if want_w:
                dw += g.t() @ h
        ctx.save_for_backward(dh, dw)
        ctx.dtypes = hidden.dtype, weight.dtype
        return total / div

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        gh = None if dh is None else (dh * grad).to(ctx.dtypes[0])
        gw = None if dw is None else (dw * grad).to(ctx.dtypes[1])
        return gh, gw, None, None, None, None


class _LogitsCrossEntropy(torch.autograd.Function):
    """The same loss over given logits, without the float32 copies autograd would keep (the logits
    in float32 and their log-softmax, each twice the size of bf16 logits): rows in chunks, the
    forward keeps each row's log-sum-exp, and the backward makes a chunk's softmax again from the
    logits, which the caller holds anyway."""

    @staticmethod
    def forward(ctx, logits, labels, chunk_rows: int, l2wrap: bool, reduction: str):
        acc = torch.promote_types(logits.dtype, torch.float32)
        div = _divisor(labels, reduction, acc)
        total = logits.new_zeros((), dtype=acc)
        lses = []
        for i in range(0, logits.shape[0], chunk_rows):
            loss, lse, _, _ = _chunk_loss(logits[i:i + chunk_rows].to(acc), labels[i:i + chunk_rows])
            total = total + loss
            lses.append(lse)
        ctx.save_for_backward(logits, labels, torch.cat(lses) if lses else logits.new_zeros(0, dtype=acc), div)
        ctx.chunk_rows, ctx.l2wrap = chunk_rows, l2wrap
        return total / div

    @staticmethod
    def backward(ctx, grad):
        logits, labels, lse, div = ctx.saved_tensors
        out = torch.empty_like(logits)
        l2 = l2wrap_factor(logits.shape[0]) * grad if ctx.l2wrap else None
        for i in range(0, logits.shape[0], ctx.chunk_rows):
            x = logits[i:i + ctx.chunk_rows].to(lse.dtype, copy=True)
            live, safe = _targets(labels[i:i + ctx.chunk_rows])
            out[i:i + ctx.chunk_rows] = _logit_grads_(x, lse[i:i + ctx.chunk_rows], live, safe, grad / div, l2)
        return out, None, None, None, None


def _flat_rows(x, labels, vocab, chunk_rows, reduction, what):
    """x as [rows, last dim], labels flat and as many, and the chunk's rows (all checked)."""
    x, labels = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
    if labels.shape[0] != x.shape[0]:
        raise ValueError(f"labels: {labels.shape[0]} rows for {x.shape[0]} rows of {what}")
    rows = chunk_rows or default_chunk_rows(vocab)
    if rows < 1:
        raise ValueError(f"chunk_rows: must be >= 1, got {chunk_rows}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: must be one of {_REDUCTIONS}, got {reduction!r}")
    return x, labels, rows


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, chunk_rows: int = None,
                  l2wrap: bool = False, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits`` ([.., vocab]) against ``labels`` (-100 ignored; "mean" over the
    others, or "sum"), with L2Wrap's gradient when ``l2wrap``: equal to F.cross_entropy (+ L2Wrap)
    on the float32 logits, holding nothing beyond the logits but a float per row."""
    logits, labels, rows = _flat_rows(logits, labels, logits.shape[-1], chunk_rows, reduction, "logits")
    return _LogitsCrossEntropy.apply(logits, labels, rows, l2wrap, reduction)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          chunk_rows: int = None, l2wrap: bool = False, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels`` (as cross_entropy), equal to the
    plain form (full logits, ``F.cross_entropy``, ``L2Wrap``) without holding more than one chunk
    of ``chunk_rows`` rows' logits (default: default_chunk_rows)."""
    hidden, labels, rows = _flat_rows(hidden, labels, weight.shape[0], chunk_rows, reduction, "hidden states")
    return _LinearCrossEntropy.apply(hidden, weight, labels, rows, l2wrap, reduction)
