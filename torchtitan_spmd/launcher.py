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

import atexit
import contextlib
import functools
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .distributed import sharding_memo

__all__ = ["WarmWorld", "WorkerError", "close_warm_worlds", "run_forked", "run_isolated", "warm_cpu_seconds",
           "warm_world_pids",
           "warm_worlds"]


#: When set to a file path, every launch appends one JSON line to it: the test that launched
#: (``PYTEST_CURRENT_TEST``), the function, the world size, and rank 0's seconds from fork to the
#: end of its work and within ``fn`` alone. ``bench/suite_profile.py`` reads it.
PROFILE_ENV = "TORCHTITAN_SPMD_LAUNCH_PROFILE"


def _record_launch(fn: Callable[..., Any], world_size: int, wall_s: float, work_s: float | None,
                   args: tuple[Any, ...], *, warm: bool = False) -> None:
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

    line = json.dumps({
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
        "fn": getattr(fn, "__qualname__", repr(fn)),
        "world_size": world_size,
        "wall_s": round(wall_s, 4),
        "work_s": None if work_s is None else round(work_s, 4),
        "args_digest": digest,
        "warm": warm,
    })
    with open(path, "a", encoding="utf-8") as f:  # one short append per launch
        f.write(line + "\n")


def _read_work_s(workdir: str) -> float | None:
    """Rank 0's seconds inside the function, as its worker wrote them (profiling only)."""
    try:
        with open(os.path.join(workdir, "rank0.work"), encoding="utf-8") as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


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
        _all_connected()
        memo = sharding_memo.install()
        ready = time.monotonic()
        try:
            result: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
            if memo:  # what this rank's sharding propagation computed, for the launches after it
                sharding_memo.write_new(os.path.join(workdir, f"rank{rank}.memo"))
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


def _all_connected() -> None:
    """Return once every rank has finished gloo's connection handshake.

    ``init_process_group`` returns on a rank as soon as its own side of each pair is up; a rank
    that then exits at once (a function with no collective) can close a socket its peer is still
    reading its handshake from, and the peer fails with "Connection closed by peer". Measured
    here: 2 of 100 two-rank launches of ``os.getpid`` under a load of 2 busy processes, none of
    200 with this barrier. It costs a millisecond and has the process group's timeout.
    """
    dist.barrier()


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
    (after killing them) if they do not finish within ``timeout_s``.

    By default nothing outlives the call: the next launch starts from fresh processes. Inside
    :func:`warm_worlds` (the test suite's mode) the ranks live on and run the next launch of the
    same world size too, when ``fn`` and ``args`` pickle (:class:`WarmWorld`); a failed launch
    ends its world, and the next one starts afresh.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if _warm().enabled:
        try:
            task = pickle.dumps((fn, args))
        except Exception:  # noqa: BLE001 - a closure or a lambda: it runs in fresh forks
            task = None
        if task is not None:
            return _warm_world(world_size).run(fn, task, args, timeout_s)
    sharding_memo.load_shared()  # what sibling processes' launches computed
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
        hung: list[int] = []
        first_failure: float | None = None
        try:
            # Watched here, not with the context's join: that one terminates every other rank the
            # moment one fails, and a rank about to write its result would then have none.
            while any(p.is_alive() for p in ctx.processes):
                now = time.monotonic()
                if now > deadline or (first_failure is not None and now > first_failure + _GRACE_S):
                    hung = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
                    break
                multiprocessing.connection.wait([p.sentinel for p in ctx.processes if p.is_alive()],
                                                timeout=min(1.0, deadline - now))
                if first_failure is None and any(p.exitcode not in (None, 0) for p in ctx.processes):
                    first_failure = time.monotonic()  # the others get a short grace (see _GRACE_S)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        _record_launch(fn, world_size, time.monotonic() - launched, _read_work_s(workdir), args)
        sharding_memo.read(os.path.join(workdir, f"rank{rank}.memo") for rank in range(world_size))
        if hung and first_failure is None:  # nobody failed: they are late
            raise _timeout_error(hung, world_size, timeout_s)
        outcomes: list[tuple[str, Any]] = []
        for rank in range(world_size):
            path = os.path.join(workdir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                outcomes.append(("exited", ctx.processes[rank].exitcode))
                continue
            with open(path, "rb") as f:
                outcomes.append(pickle.load(f))
        return _results(outcomes)


def _timeout_error(hung: list[int], world_size: int, timeout_s: float) -> TimeoutError:
    done = [r for r in range(world_size) if r not in hung]
    return TimeoutError(
        f"rank(s) {', '.join(map(str, hung))} of {world_size} did not finish within "
        f"{timeout_s:.0f} s and were killed"
        + (f" (rank(s) {', '.join(map(str, done))} had finished)" if done else ""))


def _results(outcomes: list[tuple[str, Any]]) -> list[Any]:
    """The ranks' values, or :class:`WorkerError` summarising every rank that failed.

    ``outcomes[rank]`` is ``("ok", value)``, ``("error", traceback text)`` or ``("exited", exit
    code)`` (no result).
    """
    world_size = len(outcomes)
    results: list[Any] = []
    errors: list[str] = []
    summary: list[str] = []
    for rank, (status, value) in enumerate(outcomes):
        if status == "exited":
            errors.append(f"rank {rank}: exited without a result (exit code {value}: killed, "
                          f"or ended by a failing rank)")
            summary.append(f"rank {rank} exited with code {value} without a result")
            results.append(None)
        elif status == "error":
            errors.append(f"rank {rank}:\n{value}")
            summary.append(f"rank {rank} raised {_last_line(value)}")
            results.append(None)
        else:
            results.append(value)
    if errors:
        # One line first (what each failing rank did), then every failing rank's traceback.
        raise WorkerError(f"{'; '.join(summary)} (of {world_size} ranks)\n" + "\n".join(errors))
    return results


# --------------------------------------------------------------------------- warm worlds
class _WarmState:
    """This process's warm worlds (by world size) and whether launches may use them."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.enabled = False
        self.preload: tuple[str, ...] = ()
        self.worlds: dict[int, WarmWorld] = {}


_STATE = _WarmState()


def _warm() -> _WarmState:
    """This process's warm-world state. A process forked from one that has warm worlds (a replica
    group of ``tools/ft_launch``, a test's own fork) does not inherit them: their ranks answer
    their parent's pipes only. It starts with none, and with warm worlds off."""
    if _STATE.pid != os.getpid():
        for world in _STATE.worlds.values():
            world.forget()
        _STATE.__init__()  # type: ignore[misc]
    return _STATE
#: At most this many warm worlds live at once (the least recently used one is closed first).
MAX_WARM_WORLDS = 2


@contextlib.contextmanager
def warm_worlds(enabled: bool = True, preload: Sequence[str] = ()) -> Iterator[None]:
    """Within the block, :func:`run_forked` reuses long-lived ranks (:class:`WarmWorld`).

    What it buys: each rank keeps its imports and DTensor's sharding caches from one launch to
    the next (a trainer of the layout the previous launch used reuses its meshes: see
    ``distributed/mesh_reuse.py``), where a fresh fork starts cold. What it costs: a launch sees
    a process that earlier launches ran in. Each launch gets this process's environment and
    working directory as they are when it starts; the rank restores module attributes, class
    attributes of this package, logging, signal handlers and torch's global modes after each
    launch; anything else an earlier launch left behind (a registry entry, a file) is visible.
    ``enabled=False`` turns it off inside an enabling block. On leaving the outermost enabling
    block every warm world is closed. ``preload``: modules (by name) each new warm rank imports
    before its first launch, as ``multiprocessing``'s fork server preloads.
    """
    before, before_preload = _warm().enabled, _warm().preload
    _warm().enabled = enabled
    if preload:
        _warm().preload = tuple(preload)
    try:
        yield
    finally:
        _warm().enabled, _warm().preload = before, before_preload
        if not before and enabled:
            close_warm_worlds()


def close_warm_worlds() -> None:
    """Close (kill) every warm world of this process."""
    while _warm().worlds:
        _, world = _warm().worlds.popitem()
        world.close()


def warm_cpu_seconds() -> float:
    """CPU seconds the live warm worlds' ranks have used, as they reported them after each launch.

    A process's ``RUSAGE_CHILDREN`` counts a child only once it is reaped: add this to it for the
    CPU of every launch so far (a closed world's ranks are reaped, so they count there instead).
    """
    return sum(w.cpu_s for w in _warm().worlds.values())


def warm_world_pids() -> set[int]:
    """The process ids of the live warm worlds' ranks (to tell them from leaked processes)."""
    return {p.pid for w in _warm().worlds.values() for p in w.processes if p.pid is not None}


def _warm_world(world_size: int) -> WarmWorld:
    world = _warm().worlds.pop(world_size, None)
    if world is None or not world.alive():
        if world is not None:
            world.close()
        world = WarmWorld(world_size, _warm().preload)
    _warm().worlds[world_size] = world  # most recently used last
    while len(_warm().worlds) > MAX_WARM_WORLDS:
        oldest = next(iter(_warm().worlds))
        _warm().worlds.pop(oldest).close()
    return world


class WarmWorld:
    """``world_size`` forked gloo ranks that run one launch after another.

    Each rank initialises the default process group once, then, for every launch, takes the
    pickled ``(fn, args)`` with the launcher's environment and working directory, runs ``fn``,
    and sends back its result or its traceback, with the output it printed (which the launcher
    writes to its own standard output, so a test that reads the ranks' output still sees it).
    A launch that fails in any way (a rank raises, exits, outlives the timeout, or leaves the
    default process group changed) kills the whole world; the next launch forks a new one.
    """

    def __init__(self, world_size: int, preload: tuple[str, ...] = (), *, start_timeout_s: float = 300.0) -> None:
        _close_at_exit()
        for name in preload:  # here, so that every rank inherits them (and the hygiene watches them)
            try:
                importlib.import_module(name)
            except ImportError:  # e.g. a layer the stack check blocks: a launch that needs it says so
                pass
        self.world_size = world_size
        self._dir = tempfile.mkdtemp(prefix="tts-warm-")
        ctx = multiprocessing.get_context("fork")
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[Any] = []
        ends = [ctx.Pipe() for _ in range(world_size)]
        for rank, (_, child_end) in enumerate(ends):
            others = [e for r, pair in enumerate(ends) for e in pair if r != rank] + [ends[rank][0]]
            # Not daemonic: a launch may start processes of its own (a data loader, a fork server).
            p = ctx.Process(target=_warm_rank, args=(rank, world_size, self._dir, child_end, others),
                            name=f"warm-rank{rank}")
            p.start()
            self.processes.append(p)
        for parent_end, child_end in ends:
            child_end.close()
            self._conns.append(parent_end)
        self._dead = False
        #: CPU seconds its ranks reported (set-up and launches) while alive: once it is closed
        #: and its ranks reaped, the launcher's own child-process counts hold them instead.
        self.cpu_s = 0.0
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        """Wait for every rank's process group (not counted in any launch's timeout)."""
        deadline = time.monotonic() + timeout_s
        waiting = set(range(self.world_size))
        while waiting and time.monotonic() < deadline:
            watched = {self._conns[r]: r for r in waiting} | {self.processes[r].sentinel: r for r in waiting}
            for ready in multiprocessing.connection.wait(list(watched), timeout=deadline - time.monotonic()):
                rank = watched[ready]
                if rank in waiting and ready is self._conns[rank] and self._conns[rank].recv() == "ready":
                    waiting.discard(rank)
                elif rank in waiting and not self._conns[rank].poll():
                    break  # a rank died setting up
            else:
                continue
            break
        if waiting:
            outputs = []
            for rank in sorted(waiting):
                path = os.path.join(self._dir, f"rank{rank}.2")
                try:
                    with open(path, encoding="utf-8", errors="replace") as f:
                        outputs.append(f"rank {rank}:\n{f.read()}")
                except OSError:
                    pass
            self.close()
            raise WorkerError(f"rank(s) {', '.join(map(str, sorted(waiting)))} of a warm world of "
                              f"{self.world_size} did not start\n" + "\n".join(outputs))

    def alive(self) -> bool:
        return not self._dead and all(p.is_alive() for p in self.processes)

    def forget(self) -> None:
        """In a process forked from the world's owner: drop this process's copies of the pipes."""
        self._dead = True
        for conn in self._conns:
            conn.close()

    def close(self) -> None:
        """Kill the ranks and remove the world's files."""
        self._dead = True
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(timeout=10)
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _receive(self, rank: int) -> Any:
        """Rank ``rank``'s reply if one is waiting in its pipe, else None (none yet, or the rank is
        gone: its pipe at end of file)."""
        conn = self._conns[rank]
        try:
            return conn.recv() if conn.poll() else None
        except (EOFError, OSError):
            return None

    def run(self, fn: Callable[..., Any], task: bytes, args: tuple[Any, ...], timeout_s: float) -> list[Any]:
        """:func:`run_forked`'s contract, on this world's ranks (``task``: pickled ``(fn, args)``)."""
        launched = time.monotonic()
        deadline = launched + timeout_s
        message = (task, dict(os.environ), os.getcwd(), timeout_s)
        replies: dict[int, tuple[tuple[str, Any], tuple[float, float], bool, tuple[bytes, bytes]]] = {}
        exited: dict[int, int | None] = {}
        try:
            for conn in self._conns:
                conn.send(message)
        except (BrokenPipeError, OSError):
            pass  # a rank is gone: found below, by its exit code
        pending = set(range(self.world_size))
        first_failure: float | None = None
        while pending:
            now = time.monotonic()
            wait_s = deadline - now
            if first_failure is not None:  # the others may wait on the failed rank: a short grace
                wait_s = min(wait_s, first_failure + _GRACE_S - now)
            if wait_s <= 0:
                break
            watched = {self._conns[r]: r for r in pending}
            watched.update({self.processes[r].sentinel: r for r in pending})
            for ready in multiprocessing.connection.wait(list(watched), timeout=wait_s):
                rank = watched[ready]
                if rank not in pending:
                    continue
                reply = self._receive(rank)
                if reply is not None:
                    replies[rank] = reply
                    pending.discard(rank)
                    if reply[0][0] != "ok" and first_failure is None:
                        first_failure = time.monotonic()
                elif not self.processes[rank].is_alive() or ready is not self._conns[rank]:
                    # gone without a reply (its pipe at EOF, or its sentinel fired)
                    self.processes[rank].join(timeout=5)
                    exited[rank] = self.processes[rank].exitcode
                    pending.discard(rank)
                    if first_failure is None:
                        first_failure = time.monotonic()
        for _rank, (_, _, _, output) in sorted(replies.items()):
            _echo(output)
        failed = bool(pending) or bool(exited) or any(
            r[0][0] != "ok" or not r[2] for r in replies.values())
        self.cpu_s += sum(r[1][1] for r in replies.values())
        work = replies[0][1][0] if 0 in replies else None
        _record_launch(fn, self.world_size, time.monotonic() - launched, work, args, warm=True)
        if failed:
            self.close()
        if pending and first_failure is None:  # nobody failed: they are late
            raise _timeout_error(sorted(pending), self.world_size, timeout_s)
        outcomes: list[tuple[str, Any]] = []
        for rank in range(self.world_size):
            if rank in replies:
                outcome, _, healthy, _ = replies[rank]
                if outcome[0] == "ok" and not healthy:
                    outcome = ("error", "the launch left the default process group destroyed or replaced "
                                        "(a warm world's ranks keep theirs)\n")
                outcomes.append(outcome)
            else:  # exited by itself, or killed with the world after another rank failed
                code = exited.get(rank, self.processes[rank].exitcode)
                outcomes.append(("exited", code))
        return _results(outcomes)


#: After one rank of a warm world fails, how long the others get to finish before the world is
#: killed (they may be waiting in a collective on the failed rank).
_GRACE_S = 2.0


@functools.cache
def _close_at_exit() -> None:
    """Kill the warm worlds before multiprocessing's exit handler would wait for their ranks
    (registered after it, so run before it)."""
    atexit.register(close_warm_worlds)


def _echo(output: tuple[bytes, bytes]) -> None:
    """Write a rank's captured standard output and error to this process's (descriptors 1, 2)."""
    for fd, data in zip((1, 2), output, strict=True):
        if data:
            (sys.stdout if fd == 1 else sys.stderr).flush()
            os.write(fd, data)


def _warm_rank(rank: int, world_size: int, workdir: str, conn: Any, inherited: list[Any]) -> None:
    """A warm world's rank: set up once, say so, then run launches until the pipe closes."""
    for other in inherited:  # the other ranks' pipe ends: only the launcher may hold them
        other.close()
    torch.set_num_threads(1)
    out_fds = []
    for fd in (1, 2):  # what the launches print, sent back with their results
        out_fds.append(os.open(os.path.join(workdir, f"rank{rank}.{fd}"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600))
        os.dup2(out_fds[-1], fd)
    rank_env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size)}
    try:
        os.environ.update(rank_env)
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=600))
        _all_connected()
        default = dist.distributed_c10d._get_default_group()
    except BaseException:  # noqa: BLE001 - the first launch reports it
        traceback.print_exc()
        os._exit(1)
    hygiene = _Hygiene()
    conn.send("ready")
    cpu_reported = 0.0  # a forked child's counts start at zero: the first report has the set-up
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        task, env, cwd, timeout_s = message
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(rank_env)
        started = time.monotonic()
        try:
            os.chdir(cwd)
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), default)
            fn, args = pickle.loads(task)
            result: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
        except BaseException:  # noqa: BLE001 - report every failure
            result = ("error", traceback.format_exc())
        work = time.monotonic() - started
        cpu_now = _own_cpu_seconds()
        cpu, cpu_reported = cpu_now - cpu_reported, cpu_now
        healthy = dist.is_initialized() and dist.distributed_c10d._get_default_group() is default
        hygiene.restore()
        sys.stdout.flush()
        sys.stderr.flush()
        output = (_drain(out_fds[0]), _drain(out_fds[1]))
        try:
            conn.send((result, (work, cpu), healthy, output))
        except Exception:  # noqa: BLE001 - an unpicklable result
            conn.send((("error", f"rank {rank}'s result could not be sent back:\n{traceback.format_exc()}"),
                       (work, cpu), healthy, output))
        if result[0] != "ok" or not healthy:
            os._exit(1)


def _own_cpu_seconds() -> float:
    """This process's CPU seconds, with those of the children it reaped."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _drain(fd: int) -> bytes:
    """What was written to ``fd`` (a file) since the last drain; the file starts over."""
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    return b"".join(chunks)


class _Hygiene:
    """What a warm rank puts back after each launch: what a launch most often changes in-process.

    Module attributes of this package and of the test helpers loaded now
    (a launch that patches a function restores nothing if it fails); class attributes of this
    package's classes; the logging tree; signal handlers; the working directory; torch's
    deterministic, grad, anomaly and default-dtype modes; Dynamo's compiled code.
    """

    _PREFIXES = ("torchtitan_spmd",)  # not torch's: its module globals include counters (group names)

    def __init__(self) -> None:
        self.cwd = os.getcwd()
        self.modules = {name: dict(vars(mod)) for name, mod in list(sys.modules.items())
                        if mod is not None and self._watched(name, mod)}
        self.classes = {
            cls: dict(vars(cls))
            for name, mod in list(sys.modules.items()) if mod is not None and name.startswith("torchtitan_spmd")
            for cls in list(vars(mod).values())
            if isinstance(cls, type) and getattr(cls, "__module__", "") == name
        }
        self.loggers = {name: self._logger_state(lg) for name, lg in self._all_loggers().items()}
        self.signals = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1,
                                                              signal.SIGUSR2, signal.SIGALRM)}
        self.dtype = torch.get_default_dtype()

    @classmethod
    def _watched(cls, name: str, mod: Any) -> bool:
        if name.startswith(cls._PREFIXES):
            return True
        path = getattr(mod, "__file__", None) or ""
        return os.sep + "tests" + os.sep in path  # the suite's helper modules

    @staticmethod
    def _all_loggers() -> dict[str, logging.Logger]:
        found = {"": logging.getLogger()}
        for name, lg in list(logging.Logger.manager.loggerDict.items()):
            if isinstance(lg, logging.Logger):
                found[name] = lg
        return found

    @staticmethod
    def _logger_state(lg: logging.Logger) -> tuple[Any, ...]:
        return (list(lg.handlers), lg.level, lg.propagate, lg.disabled)

    def restore(self) -> None:
        os.chdir(self.cwd)
        for name, saved in self.modules.items():
            mod = sys.modules.get(name)
            if mod is None:
                continue
            now = vars(mod)
            for key, value in saved.items():
                if now.get(key, _MISSING) is not value:
                    setattr(mod, key, value)
        for cls, saved in self.classes.items():
            now = dict(vars(cls))
            for key, value in saved.items():
                if now.get(key, _MISSING) is not value:
                    setattr(cls, key, value)
            for key in now.keys() - saved.keys():
                delattr(cls, key)
        for name, lg in self._all_loggers().items():
            handlers, level, propagate, disabled = self.loggers.get(name, ([], logging.NOTSET, True, False))
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled
        for sig, handler in self.signals.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        torch.use_deterministic_algorithms(False)
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)
        torch.set_default_dtype(self.dtype)
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None:
            dynamo.reset()


_MISSING = object()


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
