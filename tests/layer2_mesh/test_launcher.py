"""The forked launcher's failure modes: a rank that raises, hangs or exits fails its launch in one
line naming the rank, within the timeout, with nothing left running; the next launch works. Each
in fresh forks and in a warm world (long-lived ranks that run launch after launch: a failure
ends the world, the next launch gets a new one). Then what a warm world's launch may rely on:
the same ranks, the caller's environment and directory, what earlier launches patched put back,
its output and CPU seconds reported to the caller, and a closure still run (in fresh forks)."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

import torchtitan_spmd.launcher as launcher
from torchtitan_spmd.launcher import (
    WorkerError,
    run_forked,
    warm_cpu_seconds,
    warm_world_pids,
    warm_worlds,
)

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
    dist.barrier()  # every rank past the set-up (a rank ending early would fail another's connect)
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    return rank


def _hang_on_rank_1(rank: int, world: int) -> int:
    dist.barrier()  # every rank past the set-up (a rank ending early would fail another's connect)
    if rank == 1:
        time.sleep(120)
    return rank


def _exit_on_rank_1(rank: int, world: int) -> int:
    dist.barrier()  # every rank past the set-up (a rank ending early would fail another's connect)
    if rank == 1:
        time.sleep(0.5)  # rank 0 has written its result: only rank 1 fails
        os._exit(3)
    return rank


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_a_rank_that_raises_fails_in_one_line_with_its_traceback(warm: bool) -> None:
    with warm_worlds(warm):
        _test_a_rank_that_raises_fails_in_one_line_with_its_traceback()


def _test_a_rank_that_raises_fails_in_one_line_with_its_traceback() -> None:
    with pytest.raises(WorkerError) as err:
        run_forked(_raise_on_rank_1, 2, timeout_s=60)
    first, *rest = str(err.value).splitlines()
    assert first == "rank 1 raised ValueError: planted failure on rank 1 (of 2 ranks)"
    text = "\n".join(rest)
    assert text.startswith("rank 1:\nTraceback (most recent call last):") and "_raise_on_rank_1" in text
    assert "rank 0" not in text
    _healthy_launch_after()


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_a_rank_that_hangs_is_killed_at_the_timeout_and_named(warm: bool) -> None:
    with warm_worlds(warm):
        _test_a_rank_that_hangs_is_killed_at_the_timeout_and_named()


def _test_a_rank_that_hangs_is_killed_at_the_timeout_and_named() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        run_forked(_hang_on_rank_1, 2, timeout_s=3)
    elapsed = time.monotonic() - start
    assert str(err.value).startswith("rank(s) 1 of 2 did not finish within 3 s and were killed"), err.value
    assert len(str(err.value).splitlines()) == 1
    assert elapsed < 3 + 15, f"the launch took {elapsed:.0f} s to give up on a 3 s timeout"
    _healthy_launch_after()


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_a_rank_that_exits_fails_in_one_line_naming_its_exit_code(warm: bool) -> None:
    with warm_worlds(warm):
        _test_a_rank_that_exits_fails_in_one_line_naming_its_exit_code()


def _test_a_rank_that_exits_fails_in_one_line_naming_its_exit_code() -> None:
    with pytest.raises(WorkerError) as err:
        run_forked(_exit_on_rank_1, 2, timeout_s=60)
    first = str(err.value).splitlines()[0]
    assert first == "rank 1 exited with code 3 without a result (of 2 ranks)", first
    assert "rank 1: exited without a result (exit code 3" in str(err.value)
    _healthy_launch_after()


# --------------------------------------------------------------------------- warm worlds
def _what_the_rank_sees(rank: int, world: int, patch: bool) -> dict[str, object]:
    import logging

    seen = {"pid": os.getpid(), "env": os.environ.get("TTS_LAUNCH_PROBE"), "cwd": os.getcwd(),
            "grace": launcher._GRACE_S, "handlers": len(logging.getLogger("torchtitan_spmd").handlers)}
    if patch:  # what a careless launch leaves behind: a patched module attribute and a handler
        launcher._GRACE_S = -1.0
        logging.getLogger("torchtitan_spmd").addHandler(logging.NullHandler())
    print(f"rank {rank} says hello", flush=True)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return seen


def _spin(rank: int, world: int, seconds: float) -> int:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return rank


def test_a_warm_world_runs_each_launch_in_the_same_ranks_as_the_caller_would_fork_them(
        tmp_path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    launcher.close_warm_worlds()
    with warm_worlds(True):
        monkeypatch.setenv("TTS_LAUNCH_PROBE", "first")
        first = run_forked(_what_the_rank_sees, 2, True, timeout_s=60)
        monkeypatch.setenv("TTS_LAUNCH_PROBE", "second")
        monkeypatch.chdir(tmp_path)
        second = run_forked(_what_the_rank_sees, 2, False, timeout_s=60)
        assert [r["pid"] for r in second] == [r["pid"] for r in first]  # the same processes
        assert {r["pid"] for r in first} <= warm_world_pids()
        assert [r["env"] for r in first] == ["first"] * 2 and [r["env"] for r in second] == ["second"] * 2
        assert [r["cwd"] for r in second] == [str(tmp_path)] * 2
        # the first launch's patch and handler were put back before the second
        assert [r["grace"] for r in second] == [launcher._GRACE_S] * 2 and launcher._GRACE_S > 0
        assert [r["handlers"] for r in second] == [r["handlers"] for r in first]
        out = capfd.readouterr().out
        assert out.count("rank 0 says hello") == 2 and out.count("rank 1 says hello") == 2, out

        before = warm_cpu_seconds()
        assert run_forked(_spin, 2, 0.5, timeout_s=60) == [0, 1]
        assert warm_cpu_seconds() - before >= 2 * 0.5 * 0.9  # both ranks' seconds, counted here

        # a closure does not pickle: it runs in fresh forks, the warm world untouched
        pids = warm_world_pids()
        assert run_forked(lambda rank, world: os.getpid(), 2, timeout_s=60)[0] not in pids
        assert warm_world_pids() == pids

        # a failed launch ends its world: the next one runs in new ranks
        with pytest.raises(WorkerError):
            run_forked(_raise_on_rank_1, 2, timeout_s=60)
        third = run_forked(_what_the_rank_sees, 2, False, timeout_s=60)
        assert not {r["pid"] for r in third} & {r["pid"] for r in first}


def _launch_from_a_fork(out: str) -> None:
    """In a process forked from one with a warm world: a launch runs in fresh forks of its own."""
    import pickle

    pids = run_forked(lambda rank, world: os.getpid(), 2, timeout_s=60)
    named = run_forked(_sum_of_ranks, 2, timeout_s=60)
    with open(out, "wb") as f:
        pickle.dump((pids, named, sorted(warm_world_pids())), f)


def test_a_process_forked_from_one_with_a_warm_world_does_not_use_it(tmp_path) -> None:
    """Its ranks answer the pipes of the process that started them: a forked child (a replica
    group of tools/ft_launch) sending them its launch would mix the two up. (Found: the fault
    tolerance tests hung in the suite's run, where the worker had a warm world of that size.)"""
    import pickle

    with warm_worlds(True):
        before = run_forked(_what_the_rank_sees, 2, False, timeout_s=60)
        child = multiprocessing.get_context("fork").Process(target=_launch_from_a_fork,
                                                              args=(str(tmp_path / "out"),))
        child.start()
        child.join(90)
        assert child.exitcode == 0, child.exitcode
        with open(tmp_path / "out", "rb") as f:
            pids, named, child_warm = pickle.load(f)
        assert named == [[1.0], [1.0]] and child_warm == []
        assert not set(pids) & {r["pid"] for r in before}
        after = run_forked(_what_the_rank_sees, 2, False, timeout_s=60)  # the parent's world still works
        assert [r["pid"] for r in after] == [r["pid"] for r in before]


def _start_time(rank: int, world: int) -> float:
    return time.time()


def test_no_rank_starts_its_function_before_every_rank_has_connected(monkeypatch) -> None:
    """gloo's ``init_process_group`` returns on a rank once its own side is up; a rank that then
    ran a function with no collective and exited closed a socket its peer was still reading
    ("Connection closed by peer": 2 launches in 100 under load, and one CI run). Here rank 1
    lingers 1.5 s after its init: rank 0 must not start before it is done."""
    real = dist.init_process_group

    def slow_on_rank_1(*args, **kwargs):
        real(*args, **kwargs)
        if kwargs.get("rank") == 1:
            time.sleep(1.5)

    monkeypatch.setattr(dist, "init_process_group", slow_on_rank_1)
    with warm_worlds(False):  # fresh forks inherit the patch
        started = run_forked(_start_time, 2, timeout_s=60)
    assert started[0] >= started[1] - 0.5, started
