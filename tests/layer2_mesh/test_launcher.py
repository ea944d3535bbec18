"""The forked launcher's failure modes: a rank that raises, hangs or exits fails its launch in one
line naming the rank, within the timeout, with nothing left running; the next launch works."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from torchtitan_spmd.launcher import WorkerError, run_forked, warm_world_pids

pytestmark = pytest.mark.multiproc


def _sum_of_ranks(rank: int, world: int) -> list[float]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.tolist()


def _healthy_launch_after() -> None:
    """What a later test sees: no process of the failed launch alive (only the ranks of live warm
    worlds), and a working new launch."""
    assert {p.pid for p in multiprocessing.active_children()} <= warm_world_pids()
    assert run_forked(_sum_of_ranks, 3, timeout_s=60) == [[3.0]] * 3


def _raise_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    return rank


def _hang_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(120)
    return rank


def _exit_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(0.5)  # rank 0 has written its result: only rank 1 fails
        os._exit(3)
    return rank


def test_a_rank_that_raises_fails_in_one_line_with_its_traceback() -> None:
    with pytest.raises(WorkerError) as err:
        run_forked(_raise_on_rank_1, 2, timeout_s=60)
    first, *rest = str(err.value).splitlines()
    assert first == "rank 1 raised ValueError: planted failure on rank 1 (of 2 ranks)"
    text = "\n".join(rest)
    assert text.startswith("rank 1:\nTraceback (most recent call last):") and "_raise_on_rank_1" in text
    assert "rank 0" not in text
    _healthy_launch_after()


def test_a_rank_that_hangs_is_killed_at_the_timeout_and_named() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        run_forked(_hang_on_rank_1, 2, timeout_s=3)
    elapsed = time.monotonic() - start
    assert str(err.value).startswith("rank(s) 1 of 2 did not finish within 3 s and were killed"), err.value
    assert len(str(err.value).splitlines()) == 1
    assert elapsed < 3 + 15, f"the launch took {elapsed:.0f} s to give up on a 3 s timeout"
    _healthy_launch_after()


def test_a_rank_that_exits_fails_in_one_line_naming_its_exit_code() -> None:
    with pytest.raises(WorkerError) as err:
        run_forked(_exit_on_rank_1, 2, timeout_s=60)
    first = str(err.value).splitlines()[0]
    assert first == "rank 1 exited with code 3 without a result (of 2 ranks)", first
    assert "rank 1: exited without a result (exit code 3" in str(err.value)
    _healthy_launch_after()
