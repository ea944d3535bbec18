"""The torchft Lighthouse plus N replica groups on one machine, in one command (CPU, gloo).

Upstream's recipe (``torchtitan/experiments/torchft/README.md``) is three shells: the
``torchft_lighthouse`` binary, then one ``torchrun`` per replica group. This is the same as one
command, each group its own ``torchrun`` (its own gloo world) with ``TORCHFT_LIGHTHOUSE`` pointing
at a Lighthouse this process serves on loopback::

    python -m torchtitan_spmd.tools.ft_launch --groups 2 --ranks-per-group 2 \\
        [--kill-group 1 --kill-at-step 10 --restart-at-step 20] -- \\
        --module llama3 --config llama3_debugmodel --training.steps 40 ...

Everything after ``--`` goes to ``python -m torchtitan_spmd.train`` in every group, followed by
``--fault_tolerance.enable --fault_tolerance.replica_id I --fault_tolerance.group_size N``.
``--kill-group G --kill-at-step K`` SIGKILLs group G's whole process group once another group
has logged step K (a machine lost mid-run); ``--restart-at-step R`` starts it again once a live
group has logged step R, and it heals from a live peer. Each group's output goes to
``<--log-dir>/group<I>.log``; this process prints the survivors' step lines and a summary.

The Python API (:func:`start_lighthouse`, :class:`ForkedGroup`) is what the tests use: a group
is a forked process tree running a function on its ranks (:func:`~torchtitan_spmd.launcher.run_forked`),
which a test can SIGKILL, SIGSTOP and restart.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ForkedGroup", "Lighthouse", "free_port", "main", "start_lighthouse"]

_STEP = re.compile(r"step: (\d+)\s+loss: ([0-9.eE+-]+|nan|inf)")
_GROUPS = re.compile(r"  groups: (\d+)(  \(not committed\))?$")
_HEALED = re.compile(r"healed from a live peer at its step (\d+)")


def free_port() -> int:
    """A free TCP port on loopback (for a group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lighthouse_main(conn: Any, kwargs: dict[str, Any]) -> None:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", **kwargs)
    conn.send(server.address())
    conn.recv()  # until the parent says stop (or goes away)
    server.shutdown()


class Lighthouse:
    """torchft's Lighthouse in a child process (:func:`start_lighthouse`): ``.address()``, ``.shutdown()``.

    A child, not this process: torchft's Rust runtime does not survive ``fork``, and the tests
    fork replica groups from this process (a Lighthouse served here crashed a forked group's
    manager client with a segmentation fault)."""

    def __init__(self, **kwargs: Any) -> None:
        ctx = mp.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_lighthouse_main, args=(child, kwargs), daemon=True)
        self._process.start()
        if not self._conn.poll(30):
            self._process.kill()
            raise TimeoutError("the torchft Lighthouse did not start within 30 s")
        self._address = str(self._conn.recv())

    def address(self) -> str:
        """``http://host:port`` (for ``TORCHFT_LIGHTHOUSE``)."""
        return self._address

    def shutdown(self) -> None:
        """Stop the Lighthouse and its process."""
        try:
            self._conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def start_lighthouse(min_replicas: int = 1, *, join_timeout_ms: int = 1000, quorum_tick_ms: int = 50,
                     heartbeat_timeout_ms: int = 2000) -> Lighthouse:
    """torchft's Lighthouse on loopback, in a child process. ``min_replicas``: the fewest groups of
    a quorum; ``join_timeout_ms``: how long a quorum waits for groups it has seen before going
    without them; ``heartbeat_timeout_ms``: silence after which a group is dead (a SIGSTOPped or
    killed group is left out after this). Returns a handle (``.address()``, ``.shutdown()``)."""
    return Lighthouse(min_replicas=min_replicas, join_timeout_ms=join_timeout_ms, quorum_tick_ms=quorum_tick_ms,
                      heartbeat_timeout_ms=heartbeat_timeout_ms)


def _group_main(fn: Callable[..., Any], ranks: int, args: tuple[Any, ...], lighthouse: str, out: str,
                timeout_s: float) -> None:
    os.setpgrp()  # the group's ranks share one process group: one signal reaches them all
    os.environ["TORCHFT_LIGHTHOUSE"] = lighthouse
    from torchtitan_spmd.launcher import run_forked

    try:
        result: tuple[str, Any] = ("ok", run_forked(fn, ranks, *args, timeout_s=timeout_s))
    except BaseException as err:  # noqa: BLE001 - the parent reads what happened
        result = ("error", f"{type(err).__name__}: {err}")
    with open(out + ".partial", "wb") as f:
        pickle.dump(result, f)
    os.replace(out + ".partial", out)
    os._exit(0)


class ForkedGroup:
    """One replica group as a forked process tree: ``fn(rank, ranks, *args)`` on ``ranks`` gloo
    ranks (:func:`~torchtitan_spmd.launcher.run_forked`), with ``TORCHFT_LIGHTHOUSE`` set.

    :meth:`kill` SIGKILLs the whole tree (every rank at once, as a lost machine);
    :meth:`stop` / :meth:`cont` SIGSTOP / SIGCONT it; :meth:`result` waits for the ranks' results.
    The group's temporary folder (:attr:`work_dir`, where its result is written) is removed once
    the group has ended and :meth:`result` or :meth:`kill` has seen it end.
    """

    def __init__(self, fn: Callable[..., Any], ranks: int, *args: Any, lighthouse: str,
                 timeout_s: float = 120.0) -> None:
        self.work_dir = tempfile.mkdtemp(prefix="tts-ft-")
        self._out = os.path.join(self.work_dir, "result.pkl")
        ctx = mp.get_context("fork")
        self.process = ctx.Process(target=_group_main, args=(fn, ranks, args, lighthouse, self._out, timeout_s))
        self.process.start()
        self.timeout_s = timeout_s

    def _signal(self, signum: int) -> None:
        pid = self.process.pid
        assert pid is not None
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL every process of the group."""
        self._signal(signal.SIGKILL)
        self.process.join(10)
        self._remove_work_dir()

    def _remove_work_dir(self) -> None:
        if not self.process.is_alive():
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def stop(self) -> None:
        """SIGSTOP every process of the group (a stall: no heartbeat, no answer)."""
        self._signal(signal.SIGSTOP)

    def cont(self) -> None:
        """SIGCONT the group."""
        self._signal(signal.SIGCONT)

    def result(self, timeout_s: float | None = None) -> list[Any]:
        """The ranks' results, in rank order; raises ``RuntimeError`` naming what went wrong."""
        self.process.join(timeout_s if timeout_s is not None else self.timeout_s + 10)
        if self.process.is_alive():
            self.kill()
            raise TimeoutError("replica group did not finish in time and was killed")
        try:
            if not os.path.exists(self._out):
                raise RuntimeError(f"replica group exited with code {self.process.exitcode} without a result")
            with open(self._out, "rb") as f:
                status, value = pickle.load(f)
        finally:
            self._remove_work_dir()
        if status != "ok":
            raise RuntimeError(f"replica group failed: {value}")
        return value


# --------------------------------------------------------------------------------------------
# The command line: torchrun per group.
# --------------------------------------------------------------------------------------------
def _start_group(i: int, args: argparse.Namespace, train_args: Sequence[str], env: dict[str, str],
                 log_dir: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ranks_per_group}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "torchtitan_spmd.train",
           *train_args, "--fault_tolerance.enable", f"--fault_tolerance.replica_id={i}",
           f"--fault_tolerance.group_size={args.groups}"]
    log = open(os.path.join(log_dir, f"group{i}.log"), "ab")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux ``/proc``): torchrun puts each worker in its own
    session, so a signal to torchrun's process group does not reach the ranks."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a group's torchrun and every rank under it at once (a machine lost)."""
    for pid in _descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _last_step(path: str) -> int:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            steps = [int(m.group(1)) for m in _STEP.finditer(f.read())]
    except FileNotFoundError:
        return 0
    return max(steps, default=0)


def _summary(path: str) -> str:
    """What a group's log says: its step lines by groups in the quorum, uncommitted ones, heals."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    by_groups: dict[int, int] = {}
    uncommitted = 0
    for line in lines:
        if _STEP.search(line) and (m := _GROUPS.search(line)):
            by_groups[int(m.group(1))] = by_groups.get(int(m.group(1)), 0) + 1
            uncommitted += m.group(2) is not None
    heals = [m.group(1) for line in lines if (m := _HEALED.search(line))]
    counts = ", ".join(f"{n} with {g} group(s)" for g, n in sorted(by_groups.items(), reverse=True)) or "none"
    return (f"step lines: {counts}; not committed: {uncommitted}; "
            f"healed at step(s): {', '.join(heals) if heals else 'none'}")


def main(argv: Sequence[str] | None = None) -> int:
    """Start the Lighthouse and the groups; optionally kill and restart one; print a summary."""
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, train_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="python -m torchtitan_spmd.tools.ft_launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=2, help="replica groups (fault_tolerance.group_size)")
    p.add_argument("--ranks-per-group", type=int, default=1, help="ranks of each group's torchrun")
    p.add_argument("--min-replicas", type=int, default=1, help="the Lighthouse's fewest groups per quorum")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000, help="silence after which a group is dead")
    p.add_argument("--join-timeout-ms", type=int, default=10000,
                   help="how long a quorum waits for groups it knows of (upstream's README: 10000)")
    p.add_argument("--kill-group", type=int, default=None, help="SIGKILL this group ...")
    p.add_argument("--kill-at-step", type=int, default=None, help="... once another group logged this step")
    p.add_argument("--restart-at-step", type=int, default=None, help="restart it once a live group logged this step")
    p.add_argument("--log-dir", default="./outputs/ft_launch", help="group<I>.log per group")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="kill everything after this long")
    args = p.parse_args(argv)
    if args.groups < 1 or args.ranks_per_group < 1:
        p.error("--groups and --ranks-per-group must be >= 1")
    if args.kill_group is not None and not 0 <= args.kill_group < args.groups:
        p.error(f"--kill-group must be in [0, {args.groups})")
    if (args.kill_group is None) != (args.kill_at_step is None):
        p.error("--kill-group and --kill-at-step go together")
    os.makedirs(args.log_dir, exist_ok=True)
    for i in range(args.groups):
        with open(os.path.join(args.log_dir, f"group{i}.log"), "wb"):
            pass
    os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouse's Rust log: warnings only, unless asked
    lighthouse = start_lighthouse(args.min_replicas, join_timeout_ms=args.join_timeout_ms,
                                  heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse.address(), "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    print(f"ft_launch: Lighthouse at {lighthouse.address()}; {args.groups} group(s) x {args.ranks_per_group} rank(s); "
          f"logs in {args.log_dir}", flush=True)
    procs = {i: _start_group(i, args, train_args, env, args.log_dir) for i in range(args.groups)}
    killed = restarted = False
    start = time.monotonic()
    seen: dict[int, int] = {}
    first_seen: dict[tuple[int, int], float] = {}  # (group, step) -> when this process first saw its line
    status = 0
    try:
        while True:
            live = [i for i in procs if procs[i].poll() is None]
            steps = {i: _last_step(os.path.join(args.log_dir, f"group{i}.log")) for i in procs}
            now = time.monotonic() - start
            for i, s in steps.items():
                if s > seen.get(i, 0):
                    for k in range(seen.get(i, 0) + 1, s + 1):
                        first_seen.setdefault((i, k), now)
                    seen[i] = s
            others = max((s for i, s in steps.items() if i != args.kill_group), default=0)
            if args.kill_group is not None and not killed and others >= args.kill_at_step:
                _kill_tree(procs[args.kill_group])
                killed = True
                print(f"ft_launch: SIGKILLed group {args.kill_group} (a live group is at step {others})", flush=True)
            if killed and not restarted and args.restart_at_step is not None and others >= args.restart_at_step:
                procs[args.kill_group] = _start_group(args.kill_group, args, train_args, env, args.log_dir)
                restarted = True
                print(f"ft_launch: restarted group {args.kill_group} (a live group is at step {others})", flush=True)
            if not live and (not killed or restarted or args.restart_at_step is None):
                break
            if time.monotonic() - start > args.timeout_s:
                print(f"ft_launch: still running after {args.timeout_s:.0f} s; killing every group", flush=True)
                status = 1
                break
            time.sleep(0.2)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                _kill_tree(proc)
        lighthouse.shutdown()
    for i, proc in sorted(procs.items()):
        code = proc.returncode
        seen_at = sorted((k, t) for (g, k), t in first_seen.items() if g == i)
        gaps = [(t1 - t0, k1) for (_, t0), (k1, t1) in zip(seen_at, seen_at[1:], strict=False)]
        gap = (f", longest gap between step lines {max(gaps)[0]:.1f} s (before step {max(gaps)[1]}), "
               f"median {sorted(gaps)[len(gaps) // 2][0]:.1f} s" if gaps else "")
        print(f"ft_launch: group {i} exited {code}, last logged step {seen.get(i, 0)}{gap}", flush=True)
        print(f"ft_launch: group {i}: {_summary(os.path.join(args.log_dir, f'group{i}.log'))}", flush=True)
        if code != 0 and not (i == args.kill_group and not restarted):
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
