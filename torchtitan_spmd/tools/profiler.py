"""``[profiler]``: ``torch.profiler`` traces and CUDA memory snapshots, as upstream (a0c831c49).

The trainer enters :class:`Profiler` around its loop and calls :meth:`Profiler.step` after each
optimizer step. ``torch.profiler.schedule(wait=profile_freq - warmup - active, warmup,
active, repeat, skip_first, skip_first_wait)`` decides which steps are recorded; at the end of
each recorded window every rank writes one Chrome trace,
``job.dump_folder/save_traces_folder/iteration_<step>/rank<r>_trace.json.gz`` (upstream's
names). Outside its windows the profiler records nothing (the overhead is in
``docs/benchmarks.md``).

Memory snapshots (``enable_memory_snapshot``) need CUDA's allocator history; on CPU there is
none, and one start-up line says so. One is dumped every :func:`memory_snapshot_freq` steps:
``profiler.memory_snapshot_freq`` (upstream b5bcd76's field), else ``profile_freq`` (the cadence
before that field), independently of the trace windows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["Profiler", "memory_snapshot_freq"]

logger = logging.getLogger("torchtitan_spmd")


def memory_snapshot_freq(config: Any) -> int:
    """Steps between memory snapshots: ``config.memory_snapshot_freq``, or ``profile_freq`` when it
    is None (upstream b5bcd76's rule; a config of June's shape, without the field, is the latter)."""
    freq = getattr(config, "memory_snapshot_freq", None)
    return config.profile_freq if freq is None else freq


#: Kineto's log level that silences its lines (``USDT: profiler_start``, ``Completed Stage``, and on CPU
#: ``gpuGetDeviceCount failed``); read when the first profile starts.
_KINETO_QUIET = "6"

#: torch.profiler's warnings about settings this module chose: each window's trace is written at its
#: end (``acc_events`` off), and ``profiler_warmup=0`` is the user's to choose.
_PROFILER_CHATTER = ("Warning: Profiler clears events at the end of each cycle", "Profiler won't be using warmup")


def quiet_kineto() -> None:
    """Kineto's own lines off, unless asked for: a ``KINETO_LOG_LEVEL`` set in the environment is kept
    (then torch.profiler's warnings are shown too)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", _KINETO_QUIET)


@contextlib.contextmanager
def _no_profiler_chatter() -> Iterator[None]:
    with warnings.catch_warnings():
        if os.environ.get("KINETO_LOG_LEVEL") == _KINETO_QUIET:
            for text in _PROFILER_CHATTER:
                warnings.filterwarnings("ignore", message=re.escape(text), category=UserWarning)
        yield


class Profiler:
    """The profilers of a ``[profiler]`` section for one rank; a context manager."""

    def __init__(self, config: Any, dump_folder: str, rank: int, device_type: str, *, start_step: int = 0) -> None:
        self.config, self.rank, self.device_type = config, rank, device_type
        self.trace_dir = os.path.join(dump_folder, config.save_traces_folder)
        self.memory_dir = os.path.join(dump_folder, config.save_memory_snapshot_folder)
        self.step_num = start_step
        self._torch: Any = None
        self._memory = False
        #: Steps between memory snapshots (:func:`memory_snapshot_freq`).
        self.memory_snapshot_freq = memory_snapshot_freq(config)
        #: The traces this rank wrote, in order.
        self.traces: list[str] = []

    def __enter__(self) -> Profiler:
        cfg = self.config
        if cfg.enable_profiling:
            extra = {k: v for k, v in (("repeat", cfg.profiler_repeat), ("skip_first", cfg.profiler_skip_first),
                                       ("skip_first_wait", cfg.profiler_skip_first_wait)) if v is not None}
            if self.device_type == "cpu":
                quiet_kineto()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device_type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with _no_profiler_chatter():
                schedule = torch.profiler.schedule(
                    wait=cfg.profile_freq - cfg.profiler_active - cfg.profiler_warmup,
                    warmup=cfg.profiler_warmup, active=cfg.profiler_active, **extra)
            self._torch = torch.profiler.profile(
                activities=activities,
                schedule=schedule,
                on_trace_ready=self._write_trace, record_shapes=True)
            with _no_profiler_chatter():
                self._torch.__enter__()
            self._torch.step_num = self.step_num
            if self.rank == 0:
                logger.info(f"profiling: traces of every {cfg.profile_freq}th step window go to {self.trace_dir}")
        if cfg.enable_memory_snapshot:
            if self.device_type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=cfg.memory_snapshot_max_entries)
                self._memory = True
                if self.rank == 0:
                    logger.info(f"profiling: a memory snapshot every {self.memory_snapshot_freq} steps goes to "
                                f"{self.memory_dir}")
            elif self.rank == 0:
                logger.info("profiling: profiler.enable_memory_snapshot has no effect on CPU (memory "
                            "snapshots are CUDA allocator histories); none is written")
        return self

    def _write_trace(self, prof: Any) -> None:
        folder = os.path.join(self.trace_dir, f"iteration_{prof.step_num}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_trace.json.gz")
        prof.export_chrome_trace(path)
        self.traces.append(path)

    def snapshot_due(self, step: int) -> bool:
        """Whether a memory snapshot is dumped after ``step``: every ``memory_snapshot_freq``th step."""
        return step % self.memory_snapshot_freq == 0

    def step(self) -> None:
        """After each optimizer step: advance the schedule; dump a memory snapshot when
        :meth:`snapshot_due` (CUDA only)."""
        self.step_num += 1
        if self._torch is not None:
            with _no_profiler_chatter():
                self._torch.step()
        if self._memory and self.snapshot_due(self.step_num):
            folder = os.path.join(self.memory_dir, f"step_{self.step_num:012d}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{self.rank:06d}_step_{self.step_num}.pickle"), "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)

    def __exit__(self, *exc: Any) -> bool:
        if self._torch is not None:
            with _no_profiler_chatter():
                self._torch.__exit__(*exc)
            self._torch = None
        if self._memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._memory = False
        return False
