"""Losses the language models use: a cross-entropy that never holds the full float32 logits, and
RWKV's L2Wrap (a small pull of each row's largest logit towards 0 in the backward)."""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class L2Wrap(torch.autograd.Function):
    """loss in the forward; in the backward, each row's largest logit also gets the gradient
    1e-4 / (rows) x that logit (RWKV-LM's L2Wrap: keeps the logits from drifting upwards)."""

    @staticmethod
    def forward(ctx, loss, logits):
        ctx.save_for_backward(logits)
        return loss

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        factor = 1e-4 / max(1, logits.numel() // logits.shape[-1])
        top, idx = logits.max(-1, keepdim=True)
        glogits = torch.zeros_like(logits).scatter_(-1, idx, top * factor)
        return grad, glogits


def _chunk_loss(hidden, weight, labels, l2wrap):
    logits = F.linear(hidden, weight).float()
    loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    if l2wrap:
        loss = L2Wrap.apply(loss, logits)
    return loss


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          chunk_rows: int = 4096, l2wrap: bool = False) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels`` (-100 ignored), rows in
    chunks: each chunk's logits are made, used and dropped, and made again in the backward
    (activation checkpointing), so no [rows, vocab] float32 tensor is ever held whole."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, hidden.shape[0], chunk_rows):
        h, y = hidden[i:i + chunk_rows], labels[i:i + chunk_rows]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss, h, weight, y, l2wrap, use_reentrant=False)
        else:
            total = total + _chunk_loss(h, weight, y, l2wrap)
    return total / (labels != -100).sum().clamp(min=1)
