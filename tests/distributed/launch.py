"""Spawned process groups for the distributed tests.

Backend from ``FLA_EXT_DIST_BACKEND``: ``gloo`` (default; CPU tensors, any world size, what
`make test` runs) or ``nccl`` (rank r on ``cuda:r``; a world larger than the visible GPUs is
skipped, since NCCL refuses two ranks on one GPU). Test bodies are ``cases(item, rank, world)``
functions run for every item in every rank; ``device()`` says where a rank's tensors live."""
import os
import socket
import sys
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKEND = os.environ.get("FLA_EXT_DIST_BACKEND", "gloo")
if BACKEND not in ("gloo", "nccl"):
    raise ValueError(f"FLA_EXT_DIST_BACKEND must be gloo or nccl, got {BACKEND!r}")


def device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if BACKEND == "nccl" else torch.device("cpu")


def _worker(rank, world, port, cases, items, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(BACKEND, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    try:
        for item in items:
            cases(item, rank, world)
        # no rank tears the group down while another still has collectives in flight (FSDP2's
        # reduce-scatters finish in the background): gloo aborts the process on a closed peer
        dist.barrier()
    except Exception:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
    # Leave without finalizing the interpreter. A gloo worker thread may still be dropping its
    # reference to a finished collective, which takes the GIL; once finalization has begun,
    # Python ends such a thread with pthread_exit inside ProcessGroupGloo::runLoop, a noexcept
    # frame, and the rank aborts ("terminate called without an active exception") after
    # passing. Flush what this rank reports first.
    errors.close()
    errors.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world, cases, items):
    """Run ``cases(item, rank, world)`` for every item on each of ``world`` spawned ranks; fail
    with every rank's traceback if any raised."""
    if BACKEND == "nccl" and world > torch.cuda.device_count():
        pytest.skip(f"NCCL with world size {world} needs {world} GPUs; "
                    f"{torch.cuda.device_count()} visible")
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cases, items, errors))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not msgs, "\n".join(msgs)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
