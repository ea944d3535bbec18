"""The forked CPU launcher: run a function on N gloo ranks forked from this process.

``python -m torchtitan_spmd.parity`` launches its runs with it (``--launcher fork``);
the test suite and the benchmarks use it too. Ranks are forked (cheap: about 0.5 s
for 4 ranks on 2 cores, against 6 s for spawned ones), rendezvous through a
``FileStore`` in a temporary directory, run one thread each, and send their results
back as pickles: return plain Python data (lists, floats), not tensors. Every
collective gets the given timeout, and the launcher kills ranks that outlive it.

:func:`run_isolated` runs one function in a clean child process instead (a fork server's):
for work that must not run in this process (a dry run's meta backward starts autograd's
threads) and must not be forked from it either (this process may hold threads).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["WorkerError", "run_forked", "run_isolated"]


#: When set to a file path, every launch appends one JSON line to it: the test that launched
#: (``PYTEST_CURRENT_TEST``), the function, the world size, and rank 0's seconds from fork to the
#: end of its work and within ``fn`` alone. ``bench/suite_profile.py`` reads it.
PROFILE_ENV = "TORCHTITAN_SPMD_LAUNCH_PROFILE"


def _record_launch(fn: Callable[..., Any], world_size: int, wall_s: float, workdir: str,
                   args: tuple[Any, ...]) -> None:
    """Append the launch's line to the profile file, when one is asked for."""
    path = os.environ.get(PROFILE_ENV)
    if not path:
        return
    import hashlib
    import json

    inner = fn.__closure__[0].cell_contents if getattr(fn, "__closure__", None) else fn
    try:  # the same function on the same arguments twice: a run two tests could share
        digest: str | None = hashlib.sha1(pickle.dumps(
            (getattr(inner, "__qualname__", ""), world_size, args))).hexdigest()[:16]
    except Exception:  # noqa: BLE001 - unpicklable arguments: no digest
        digest = None

    work_s = None
    try:
        with open(os.path.join(workdir, "rank0.work"), encoding="utf-8") as f:
            work_s = float(f.read())
    except (OSError, ValueError):
        pass
    line = json.dumps({
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
        "fn": getattr(fn, "__qualname__", repr(fn)),
        "world_size": world_size,
        "wall_s": round(wall_s, 4),
        "work_s": None if work_s is None else round(work_s, 4),
        "args_digest": digest,
    })
    with open(path, "a", encoding="utf-8") as f:  # one short append per launch
        f.write(line + "\n")


class WorkerError(RuntimeError):
    """A rank raised; the message holds that rank's traceback."""


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    workdir: str,
    args: tuple[Any, ...],
    timeout_s: float,
) -> None:
    torch.set_num_threads(1)
    out = os.path.join(workdir, f"rank{rank}.pkl")
    try:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        ready = time.monotonic()
        try:
            result: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
        finally:
            if rank == 0 and os.environ.get(PROFILE_ENV):
                with open(os.path.join(workdir, "rank0.work"), "w", encoding="utf-8") as f:
                    f.write(str(time.monotonic() - ready))
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report every failure, then exit non-zero
        result = ("error", traceback.format_exc())
    # Written whole or not at all: when one rank fails, torch's join terminates the others,
    # possibly halfway through their own write; a rename is atomic, a partial file is never seen.
    partial = out + ".partial"
    with open(partial, "wb") as f:
        pickle.dump(result, f)
    os.replace(partial, out)
    if result[0] == "error":
        os._exit(1)


def run_forked(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks.

    Returns the per-rank return values, in rank order. Raises :class:`WorkerError` if any rank
    raises or exits without a result: its first line says what each failing rank did (``rank 1
    raised ValueError: ...; rank 2 exited with code 3 without a result (of 4 ranks)``), the
    failing ranks' tracebacks follow. Raises ``TimeoutError`` naming the ranks still running
    (after killing them) if they do not finish within ``timeout_s``. Nothing outlives the call:
    the next launch starts from fresh processes.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    with tempfile.TemporaryDirectory(prefix="tts-mp-") as workdir:
        launched = time.monotonic()
        ctx = mp.start_processes(
            _worker,
            args=(fn, world_size, workdir, args, timeout_s),
            nprocs=world_size,
            join=False,
            start_method="fork",
        )
        deadline = time.monotonic() + timeout_s
        failure: BaseException | None = None
        hung: list[int] = []
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    hung = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
                    break
        except mp.ProcessRaisedException as err:  # pragma: no cover - we catch in-worker
            failure = err
        except mp.ProcessExitedException as err:
            failure = err
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        _record_launch(fn, world_size, time.monotonic() - launched, workdir, args)
        if hung:
            done = [r for r in range(world_size) if r not in hung]
            raise TimeoutError(
                f"rank(s) {', '.join(map(str, hung))} of {world_size} did not finish within "
                f"{timeout_s:.0f} s and were killed"
                + (f" (rank(s) {', '.join(map(str, done))} had finished)" if done else ""))
        results: list[Any] = []
        errors: list[str] = []
        summary: list[str] = []
        for rank in range(world_size):
            path = os.path.join(workdir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                code = ctx.processes[rank].exitcode
                errors.append(f"rank {rank}: exited without a result (exit code {code}: killed, "
                              f"or ended by a failing rank)")
                summary.append(f"rank {rank} exited with code {code} without a result")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
                summary.append(f"rank {rank} raised {_last_line(value)}")
                results.append(None)
            else:
                results.append(value)
        if errors:
            # One line first (what each failing rank did), then every failing rank's traceback.
            raise WorkerError(f"{'; '.join(summary)} (of {world_size} ranks)\n" + "\n".join(errors)) \
                from failure
        return results


def _last_line(traceback_text: str) -> str:
    """The exception line of a formatted traceback (its last non-empty line)."""
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "an exception"


def run_isolated(fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0) -> Any:
    """Return ``fn(*args)`` run in a child of a fork server, a process that never ran this one's
    threads; raise :class:`TimeoutError` (the child killed) after ``timeout_s``.

    Why not a plain fork: a child forked from a process that holds threads (autograd's workers
    after a backward, a checkpoint or progress-bar thread pool) inherits every lock one of them
    held at that instant, and can wait on it forever (seen: a forked child of the test session,
    0 CPU seconds on a futex). Why not spawn: the fork server imports torch and this package
    once (``set_forkserver_preload``), so each child starts in well under a second. ``fn`` and
    ``args`` are pickled: ``fn`` must be importable by name, and the result must pickle.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torchtitan_spmd.train"])
    with ctx.Pool(1, maxtasksperchild=1) as pool:  # the context's exit terminates the child
        pending = pool.apply_async(fn, args)
        try:
            return pending.get(timeout=timeout_s)
        except multiprocessing.TimeoutError:
            raise TimeoutError(f"{getattr(fn, '__qualname__', fn)} did not finish within "
                               f"{timeout_s:.0f} s in its isolated child") from None
