"""The test harness itself (tests/conftest.py)."""
import os

import torch


def test_xdist_workers_share_the_cores():
    """Under pytest-xdist every worker takes at most cores / workers CPU threads: more threads than
    cores in all made the oracles' OpenMP barriers spin against each other (docs/design.md §8).
    Without xdist nothing is capped."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        assert torch.get_num_threads() <= max(1, (os.cpu_count() or 1) // workers)
