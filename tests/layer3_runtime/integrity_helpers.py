"""Helpers for the checkpoint-integrity tests: the trainer's exit paths (``run_job``) on forked
gloo ranks, with faults injected into DCP's storage writer, signals, and damaged files.

Every job is the 2-rank FSDP 2 tiny model of ``checkpoint_helpers`` (fp32, deterministic).
Faults are plain data (pickled into the forked ranks):

- ``("oserror", rank, step, errno)``: that rank's DCP ``write_data`` for ``step-<step>``
  writes its file, then raises ``OSError(errno)`` (a disk that filled up, an I/O error);
- ``("signal", rank, step, signum)``: it sends itself ``signum`` there instead, mid-save;
- ``("signal_in_step", rank, step, signum)``: it sends itself ``signum`` during training step
  ``step`` (between saves);
- ``("remount_ro", rank, step, mountpoint)``: it remounts ``mountpoint`` read-only during
  training step ``step``;
- ``("log_fsync", rank, path)``: every ``os.fsync`` (after it returns) appends
  ``"<rank> <file>"`` to ``path``;
- ``("log_digest", rank, path)``: every checksum computed appends ``"<rank> <file>"``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
from typing import Any

from checkpoint_helpers import ck_config
from parity_helpers import warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

WORLD = 2


def cfg(root: str, **checkpoint: Any) -> JobConfig:
    """The 2-rank job (steps 5, a save every 2) into ``root``; ``steps=`` overrides the steps."""
    steps = checkpoint.pop("steps", 5)
    return ck_config("default", "fsdp2", root, steps=steps, interval=2, **checkpoint)


def _append(path: str, line: str) -> None:
    with open(path, "a") as f:  # O_APPEND: the ranks' lines interleave whole
        f.write(line + "\n")


def arm(rank: int, faults: list[tuple[Any, ...]]) -> None:
    """Install this rank's ``faults`` (see the module docstring) in this forked process."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    import torchtitan_spmd.checkpoint.integrity as integrity
    from torchtitan_spmd.train import Trainer

    for fault in faults:
        kind, who = fault[0], fault[1]
        if who != rank:
            continue
        if kind in ("oserror", "signal"):
            _, _, step, code = fault
            original = FileSystemWriter.write_data

            def write_data(self: Any, plan: Any, planner: Any, _o: Any = original, _s: int = step,
                           _k: str = kind, _c: int = code) -> Any:
                future = _o(self, plan, planner)
                if os.path.basename(str(self.path)) == f"step-{_s}.partial":
                    if _k == "signal":
                        os.kill(os.getpid(), _c)
                    else:
                        raise OSError(_c, os.strerror(_c), str(self.path))
                return future

            FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
        elif kind in ("signal_in_step", "remount_ro"):
            _, _, step, arg = fault
            original_step = Trainer.step

            def step_fn(self: Any, n: int, _o: Any = original_step, _s: int = step, _k: str = kind,
                        _a: Any = arg) -> Any:
                if n == _s:
                    if _k == "signal_in_step":
                        os.kill(os.getpid(), _a)
                    else:
                        subprocess.run(["mount", "-o", "remount,ro", _a], check=True)
                return _o(self, n)

            Trainer.step = step_fn  # type: ignore[method-assign]
        elif kind == "log_fsync":
            log, fsync = fault[2], os.fsync

            def logged_fsync(fd: int, _f: Any = fsync, _log: str = log) -> None:
                _f(fd)
                _append(_log, f"{rank} {os.readlink(f'/proc/self/fd/{fd}')}")

            os.fsync = logged_fsync  # type: ignore[assignment]
        elif kind == "log_digest":
            log, digest = fault[2], integrity.file_digest

            def logged_digest(path: str, *args: Any, _d: Any = digest, _log: str = log) -> Any:
                _append(_log, f"{rank} {path}")
                return _d(path, *args)

            integrity.file_digest = logged_digest  # type: ignore[assignment]
        else:
            raise ValueError(kind)


@contextlib.contextmanager
def captured() -> Any:
    """``(stderr, log records)`` of the block: what ``run_job`` prints and the library logs."""
    logger = logging.getLogger("torchtitan_spmd")
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            yield err, records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def job(config: JobConfig) -> dict[str, Any]:
    """This rank's ``run_job(config)``: exit status, stderr lines, log lines."""
    from torchtitan_spmd.train import run_job

    with captured() as (err, log):
        status = run_job(config)
    return {"status": status, "stderr": err.getvalue().splitlines(), "log": list(log)}


def start(config: JobConfig) -> dict[str, Any]:
    """This rank's start from ``config`` (the Trainer built, not run): what it loaded, or the error."""
    from torchtitan_spmd.train import Trainer

    with captured() as (_, log):
        try:
            trainer = Trainer(config)
        except ValueError as err:
            return {"error": str(err), "log": list(log)}
        try:
            return {"loaded": trainer.checkpointer.loaded, "start_step": trainer.start_step, "log": list(log)}
        finally:
            trainer.close()


def _jobs(rank: int, world: int, cases: list[tuple[str, JobConfig, list[tuple[Any, ...]], JobConfig | None]]
          ) -> dict[str, dict[str, Any]]:
    """Each case (name, config, faults, config of the next start): its job, then the next start."""
    out = {}
    for name, config, faults, then in cases:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        import torchtitan_spmd.checkpoint.integrity as integrity
        from torchtitan_spmd.train import Trainer

        saved = (FileSystemWriter.write_data, Trainer.step, os.fsync, integrity.file_digest)
        arm(rank, faults)
        try:
            out[name] = job(config)
        finally:
            FileSystemWriter.write_data, Trainer.step, os.fsync, integrity.file_digest = saved  # type: ignore[method-assign]
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        if then is not None:
            out[name]["next"] = start(then)
    return out


def run_jobs(cases: list[tuple[str, JobConfig, list[tuple[Any, ...]], JobConfig | None]]) -> list[dict[str, Any]]:
    """:func:`_jobs` on the 2 forked ranks: each rank's results by case."""
    warm_parent()
    import torch.distributed.checkpoint  # noqa: F401  (import once, before forking)

    return run_forked(_jobs, WORLD, cases, timeout_s=300)


def _starts(rank: int, world: int, cases: list[tuple[str, str, JobConfig, list[tuple[Any, ...]]]]
            ) -> dict[str, Any]:
    out = {}
    for name, mode, config, faults in cases:
        import torchtitan_spmd.checkpoint.integrity as integrity

        saved = integrity.file_digest
        arm(rank, faults)
        try:
            out[name] = job(config) if mode == "job" else start(config)
        finally:
            integrity.file_digest = saved  # type: ignore[assignment]
    return out


def run_starts(cases: list[tuple[str, str, JobConfig, list[tuple[Any, ...]]]]) -> list[dict[str, Any]]:
    """Each case ``(name, "job" | "start", config, faults)`` on the 2 forked ranks, in turn:
    :func:`job` (exit status and lines) or :func:`start` (what loaded); each rank's results by case."""
    warm_parent()
    import torch.distributed.checkpoint  # noqa: F401

    return run_forked(_starts, WORLD, cases, timeout_s=300)
