"""The spawn harness itself: a rank's failure reaches the test, and a rank that passed is not
failed by what happens while its interpreter shuts down (gloo's worker threads can abort a rank
there after every collective has finished: launch.py says how)."""
import atexit
import os

import pytest

from launch import spawn


def _raises_on_rank_one(item, rank, world):
    if rank == 1:
        raise ValueError(f"raised on rank {rank} for {item}")


def _aborts_at_shutdown(item, rank, world):
    atexit.register(os.abort)


def test_a_rank_error_fails_the_run_and_names_the_rank():
    with pytest.raises(AssertionError, match=r"(?s)rank 1: .*ValueError: raised on rank 1 for x"):
        spawn(2, _raises_on_rank_one, ["x"])


def test_a_passing_rank_is_not_failed_by_its_shutdown():
    spawn(2, _aborts_at_shutdown, ["x"])
