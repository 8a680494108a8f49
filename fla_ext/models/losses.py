"""Losses the language models use: a linear + cross-entropy that never holds the full float32
logits, and RWKV's L2Wrap (a small pull of each row's largest logit towards 0 in the backward)."""
import torch
import torch.nn.functional as F


def l2wrap_factor(rows: int) -> float:
    """RWKV-LM's L2Wrap weight: each row's largest logit gets this x the logit as its gradient."""
    return 1e-4 / max(1, rows)


class L2Wrap(torch.autograd.Function):
    """loss in the forward; in the backward, each row's largest logit also gets the gradient
    l2wrap_factor(rows) x that logit, whatever the loss's own gradient (RWKV-LM's L2Wrap: keeps
    the logits from drifting upwards)."""

    @staticmethod
    def forward(ctx, loss, logits):
        ctx.save_for_backward(logits)
        return loss

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        top, idx = logits.max(-1, keepdim=True)
        glogits = torch.zeros_like(logits).scatter_(-1, idx, top * l2wrap_factor(logits.numel() // logits.shape[-1]))
        return grad, glogits


def default_chunk_rows(vocab: int) -> int:
    """Rows per chunk: a chunk's float32 logits stay near 256 MB whatever the vocabulary."""
    return max(64, (1 << 26) // max(1, vocab))


def _chunk_loss(logits, labels):
    """(sum of -log softmax at the labels over the rows whose label is not -100, the rows'
    log-sum-exp, which rows count, the labels with -100 as 0) of float logits."""
    lse = torch.logsumexp(logits, -1)
    live = labels != -100
    safe = torch.where(live, labels, torch.zeros_like(labels)).unsqueeze(-1)
    return torch.where(live, lse - logits.gather(-1, safe).squeeze(-1), 0.).sum(), lse, live, safe


def _logit_grads_(logits, lse, live, safe, weight):
    """The loss's gradient wrt float logits, in place of them: (softmax - one-hot label) x weight
    on rows that count, 0 on the others."""
    g = logits.sub_(lse.unsqueeze(-1)).exp_()
    g.scatter_add_(-1, safe, -live.unsqueeze(-1).to(g.dtype))
    return g.mul_((live.to(g.dtype) * weight).unsqueeze(-1))


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum over rows of -log softmax(hidden @ weight.T)[label], divided by the count of labels
    that are not -100. The loss is a scalar, so its gradients are made in the forward, chunk by
    chunk (fla's fused linear cross-entropy does the same): a chunk's logits are made, turned into
    their gradient in place and dropped, and the backward only scales what was kept ([rows,
    hidden] and [vocab, hidden] in float32, float64 for float64 inputs). L2Wrap's part does not scale with the loss's gradient
    (as RWKV-LM's), so only its rows' top logit and index are kept and applied in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_rows: int, l2wrap: bool):
        rows = hidden.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want = want_h or want_w
        acc = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 for float64 inputs
        count = (labels != -100).sum().clamp(min=1).to(acc)
        total = hidden.new_zeros((), dtype=acc)
        dh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if want_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        tops, idxs = [], []
        for i in range(0, rows, chunk_rows):
            h, y = hidden[i:i + chunk_rows], labels[i:i + chunk_rows]
            logits = F.linear(h, weight).to(acc)
            if l2wrap and want:
                top, idx = logits.max(-1)
                tops.append(top), idxs.append(idx)
            loss, lse, live, safe = _chunk_loss(logits, y)
            total = total + loss
            if not want:
                continue
            g = _logit_grads_(logits, lse, live, safe, 1 / count).to(weight.dtype)
            if want_h:
                dh[i:i + chunk_rows] = g @ weight
            if want_w:
                dw += g.t() @ h
        if want:
            top = torch.cat(tops) if tops else None
            idx = torch.cat(idxs) if idxs else None
            ctx.save_for_backward(dh, dw, hidden, weight, top, idx)
        return total / count

    @staticmethod
    def backward(ctx, grad):
        dh, dw, hidden, weight, top, idx = ctx.saved_tensors
        gh = gw = None
        if dh is not None:
            dh = dh * grad
        if dw is not None:
            dw = dw * grad
        if top is not None:  # each row's top logit: d logit = factor x top
            coef = top * l2wrap_factor(hidden.shape[0])
            if dh is not None:
                dh += coef.unsqueeze(-1) * weight.to(dh.dtype)[idx]
            if dw is not None:
                dw.index_add_(0, idx, coef.unsqueeze(-1) * hidden.to(dw.dtype))
        if dh is not None:
            gh = dh.to(hidden.dtype)
        if dw is not None:
            gw = dw.to(weight.dtype)
        return gh, gw, None, None, None


class _LogitsCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of given logits (and L2Wrap's gradient over all rows), without the
    float32 copies autograd would keep (the logits in float32 and their log-softmax, each twice
    the size of bf16 logits): rows in chunks, the forward keeps each row's log-sum-exp, and the
    backward makes a chunk's softmax again from the logits, which the caller holds anyway."""

    @staticmethod
    def forward(ctx, logits, labels, chunk_rows: int, l2wrap: bool):
        acc = torch.promote_types(logits.dtype, torch.float32)
        count = (labels != -100).sum().clamp(min=1).to(acc)
        total = logits.new_zeros((), dtype=acc)
        lses = []
        for i in range(0, logits.shape[0], chunk_rows):
            x, y = logits[i:i + chunk_rows].to(acc), labels[i:i + chunk_rows]
            loss, lse, _, _ = _chunk_loss(x, y)
            total = total + loss
            lses.append(lse)
        ctx.save_for_backward(logits, labels, torch.cat(lses) if lses else logits.new_zeros(0, dtype=acc), count)
        ctx.chunk_rows, ctx.l2wrap = chunk_rows, l2wrap
        return total / count

    @staticmethod
    def backward(ctx, grad):
        logits, labels, lse, count = ctx.saved_tensors
        out = torch.empty_like(logits)
        factor = l2wrap_factor(logits.shape[0])
        for i in range(0, logits.shape[0], ctx.chunk_rows):
            x, y = logits[i:i + ctx.chunk_rows].to(lse.dtype, copy=True), labels[i:i + ctx.chunk_rows]
            live = y != -100
            safe = torch.where(live, y, torch.zeros_like(y)).unsqueeze(-1)
            top, idx = x.max(-1, keepdim=True) if ctx.l2wrap else (None, None)
            g = _logit_grads_(x, lse[i:i + ctx.chunk_rows], live, safe, grad / count)
            if ctx.l2wrap:  # unscaled by the loss's gradient, as RWKV-LM's
                g.scatter_add_(-1, idx, top * factor)
            out[i:i + ctx.chunk_rows] = g
        return out, None, None, None


def _flat_rows(x, labels, vocab, chunk_rows, what):
    """x as [rows, last dim], labels flat and as many, and the chunk's rows (checked)."""
    x, labels = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
    if labels.shape[0] != x.shape[0]:
        raise ValueError(f"labels: {labels.shape[0]} rows for {x.shape[0]} rows of {what}")
    rows = chunk_rows or default_chunk_rows(vocab)
    if rows < 1:
        raise ValueError(f"chunk_rows: must be >= 1, got {chunk_rows}")
    return x, labels, rows


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, chunk_rows: int = None,
                  l2wrap: bool = False) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` ([rows, vocab]) against ``labels`` (-100 ignored), with
    L2Wrap's gradient when ``l2wrap``: equal to F.cross_entropy (+ L2Wrap) on the float32 logits,
    holding nothing beyond the logits but a float per row."""
    logits, labels, rows = _flat_rows(logits, labels, logits.shape[-1], chunk_rows, "logits")
    return _LogitsCrossEntropy.apply(logits, labels, rows, l2wrap)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          chunk_rows: int = None, l2wrap: bool = False) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels`` (-100 ignored), with the
    gradient of L2Wrap over all rows when ``l2wrap``, equal to the plain form (full logits,
    ``F.cross_entropy``, ``L2Wrap``) without holding more than one chunk of ``chunk_rows`` rows'
    logits (default: default_chunk_rows)."""
    hidden, labels, rows = _flat_rows(hidden, labels, weight.shape[0], chunk_rows, "hidden states")
    return _LinearCrossEntropy.apply(hidden, weight, labels, rows, l2wrap)
