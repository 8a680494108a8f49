"""Plain data parallelism over fla_ext layers: a small language model (embedding, an RWKV-7 layer, a
GLA layer, a GSA layer, norm, head) trained one SGD step under DistributedDataParallel on two
ranks, each with half the batch, ends with the parameters of the same model stepped in one
process on the same loss, the whole batch's mean, with each half's gradient taken separately and
accumulated (fp32, 1e-5): the sums of the per-rank products in the order DDP forms them. Against
one backward over the whole batch (other summation orders inside the weight gradients) the
difference depends on the CPU's GEMM kernels and was 1.7e-5 on one machine. gloo on the CPU, or
NCCL on two GPUs (launch.py)."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from launch import device, spawn  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

VOCAB, C, T, B_PER_RANK = 50, 32, 40, 2


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from fla_ext.layers import GatedLinearAttention, GatedSlotAttention, RWKV7Attention
        self.embed = torch.nn.Embedding(VOCAB, C)
        self.mixers = torch.nn.ModuleList([
            RWKV7Attention(hidden_size=C, head_dim=16, layer_idx=0, num_hidden_layers=3,
                           decay_low_rank_dim=8, gate_low_rank_dim=8, a_low_rank_dim=8, v_low_rank_dim=8),
            GatedLinearAttention(hidden_size=C, num_heads=2, use_short_conv=True, conv_size=4, layer_idx=1),
            GatedSlotAttention(hidden_size=C, num_heads=2, num_slots=8, layer_idx=2),
        ])
        self.norms = torch.nn.ModuleList([torch.nn.RMSNorm(C) for _ in self.mixers])
        self.head = torch.nn.Linear(C, VOCAB, bias=False)

    def forward(self, tokens):
        from fla_ext.layers import RWKV7Attention
        x, v_first = self.embed(tokens), None
        for norm, mixer in zip(self.norms, self.mixers):
            if isinstance(mixer, RWKV7Attention):
                o, _, _, v_first = mixer(norm(x), v_first=v_first)
            else:
                o = mixer(norm(x))[0]
            x = x + o
        return self.head(x)


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _step(model, tokens, parts=1):
    """One SGD step on the mean loss over `tokens`, its gradient as the sum of `parts` equal
    slices' (each slice's mean loss over parts)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for piece in tokens.chunk(parts):
        (_loss(model, piece) / parts).backward()
    opt.step()


def _ddp_case(_, rank, world):
    dev = device(rank)
    torch.manual_seed(3)
    one = TinyLM().to(dev)
    with torch.no_grad():  # as if trained a while: no zero weight (RWKV-7's output projection
        for p in one.parameters():  # starts at zero) stops the gradients before it
            p.add_(0.02 * torch.randn_like(p))
    ddp_model = TinyLM().to(dev)
    ddp_model.load_state_dict(one.state_dict())
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (world * B_PER_RANK, T + 1), generator=gen).to(dev)
    before = {n: p.detach().clone() for n, p in one.named_parameters()}
    _step(one, tokens, parts=world)  # the whole batch in one process, as the ranks slice it
    ddp = torch.nn.parallel.DistributedDataParallel(
        ddp_model, device_ids=[rank] if dev.type == "cuda" else None)
    _step(ddp, tokens[rank * B_PER_RANK:(rank + 1) * B_PER_RANK])
    still = []
    for (n, want), (_, got) in zip(one.named_parameters(), ddp_model.named_parameters()):
        moved = (want.detach() - before[n]).double().norm().item()
        diff = (got.detach() - want.detach()).double().norm().item()
        if moved == 0:
            still.append(n)
            assert diff == 0, f"{n}: moved under DDP only"
        else:
            assert diff <= 1e-5 * moved, \
                f"{n}: the DDP step differs from the one-process step by {diff / moved:.2e} (relative)"
    assert not still, f"parameters that never moved: {still}"


def test_ddp_step_equals_one_process_with_the_whole_batch():
    spawn(2, _ddp_case, [None])
