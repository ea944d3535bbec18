"""Technique: process-group set-up, communication timeouts, and one-line failure reports.

- :func:`init_default_process_group`: the default group from a complete torchrun
  environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), or, when
  none of those is set, a single-process group on an in-memory store (no port, so
  any number of single-process runs can share a machine). A half-set environment
  is a ``ValueError`` naming the missing variables.
- :func:`set_pg_timeouts` (upstream's name): one timeout for *every* process group
  of this process -- the default group, every mesh axis and flattened axis
  ``ParallelDims`` created, and any other group -- not only the world group. The
  trainer applies ``comm.init_timeout_seconds`` right after building the meshes
  and ``comm.train_timeout_seconds`` after the first step, as upstream does.
- :func:`configure_flight_recorder`: torch's flight recorder (``comm.trace_buf_size``
  entries; gloo and nccl), which :func:`describe_comm_failure` reads to name the
  collective a rank was in when it timed out, and :func:`dump_flight_recorder`
  writes to ``<dump_folder>/<comm.save_traces_folder>/<prefix><rank>``.
- :func:`is_comm_failure` / :func:`describe_comm_failure`: tell a collective that
  timed out or lost its peer from any other error, and say so in one line.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torchtitan_spmd.config import CommConfig

    from .parallel_dims import ParallelDims

__all__ = [
    "TORCHRUN_VARIABLES",
    "configure_flight_recorder",
    "describe_comm_failure",
    "dump_flight_recorder",
    "init_default_process_group",
    "is_comm_failure",
    "process_groups",
    "set_pg_timeouts",
]

#: What ``init_method="env://"`` needs; torchrun sets all four.
TORCHRUN_VARIABLES: tuple[str, ...] = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_FR_BUFFER = "TORCH_FR_BUFFER_SIZE"
_FR_BUFFER_LEGACY = "TORCH_NCCL_TRACE_BUFFER_SIZE"
_FR_DUMP_FILE = "TORCH_FR_DUMP_TEMP_FILE"
_NCCL_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"


# ----------------------------------------------------------------------------- set-up
def _env_int(name: str, value: str, low: int, high: int | None = None) -> int:
    try:
        number = int(value)
    except ValueError:
        number = None  # type: ignore[assignment]
    if number is None or number < low or (high is not None and number > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"environment variable {name}={value!r} must be an integer {bound}.")
    return number


def _check_torchrun_environment() -> bool:
    """True for a complete torchrun environment, False for none; ValueError for a half-set one."""
    present = [v for v in TORCHRUN_VARIABLES if os.environ.get(v, "") != ""]
    if not present:
        return False
    missing = [v for v in TORCHRUN_VARIABLES if v not in present]
    if missing:
        raise ValueError(
            f"incomplete torchrun environment: {', '.join(present)} set but {', '.join(missing)} not; "
            f"launch with torchrun (which sets all of {', '.join(TORCHRUN_VARIABLES)}), "
            f"or unset {', '.join(present)} for a single-process run."
        )
    world = _env_int("WORLD_SIZE", os.environ["WORLD_SIZE"], 1)
    _env_int("RANK", os.environ["RANK"], 0, world - 1)
    _env_int("MASTER_PORT", os.environ["MASTER_PORT"], 1, 65535)
    return True


def init_default_process_group(backend: str, timeout: timedelta) -> None:
    """Initialise the default process group with ``backend`` and ``timeout``.

    From the torchrun environment when it is set; otherwise a one-rank group on an
    in-memory store (no port is opened for the rendezvous). Raises ``ValueError``,
    naming the variables, for a partly set or malformed torchrun environment.
    """
    if _check_torchrun_environment():
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def configure_flight_recorder(comm: CommConfig, dump_folder: str) -> None:
    """Size torch's flight recorder from ``comm.trace_buf_size`` (0: off), as upstream does.

    Must run before this process's first collective. With a buffer, NCCL dumps it on
    a timeout to ``<dump_folder>/<comm.save_traces_folder>/<comm.save_traces_file_prefix><rank>``
    (gloo ranks write the same file through :func:`dump_flight_recorder`).
    """
    _set_env(_FR_BUFFER, str(comm.trace_buf_size))
    if comm.trace_buf_size > 0:
        _set_env(_NCCL_DUMP_ON_TIMEOUT, "1")
        _set_env(_FR_DUMP_FILE, _trace_prefix(comm, dump_folder))


def _set_env(name: str, value: str) -> None:
    if os.environ.get(name, value) != value:
        warnings.warn(f"environment variable {name}={os.environ[name]} is overridden by the job config "
                      f"with {value}.", stacklevel=3)
    os.environ[name] = value


def _trace_prefix(comm: CommConfig, dump_folder: str) -> str:
    return os.path.join(dump_folder, comm.save_traces_folder, comm.save_traces_file_prefix)


# ----------------------------------------------------------------------------- timeouts
def process_groups(parallel_dims: ParallelDims | None = None) -> list[dist.ProcessGroup]:
    """Every real process group this rank belongs to: the default group first, then every
    other group torch knows of in this process (each mesh axis and flattened axis of
    ``parallel_dims`` included); fake-backend groups are left out."""
    groups: list[dist.ProcessGroup] = []

    def add(group: Any) -> None:
        if (isinstance(group, dist.ProcessGroup) and not dist.distributed_c10d._rank_not_in_group(group)
                and not any(group is g for g in groups) and _is_real(group)):
            groups.append(group)

    add(dist.distributed_c10d._get_default_group())
    for group in list(dist.distributed_c10d._world.pg_map):
        add(group)
    if parallel_dims is not None:
        for mesh in parallel_dims.get_all_one_dimensional_meshes().values():
            add(mesh.get_group())
    return groups


def _is_real(group: dist.ProcessGroup) -> bool:
    backend = str(dist.get_backend(group))
    return "fake" not in backend


_set_timeout = getattr(dist, "set_timeout", None)  # torch >= 2.14; before, the private name


def _apply_timeout(timeout: timedelta, group: dist.ProcessGroup) -> None:
    if _set_timeout is not None:
        _set_timeout(timeout, group)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def set_pg_timeouts(timeout: timedelta, parallel_dims: ParallelDims | None = None, *,
                    barrier: bool = True) -> int:
    """Set ``timeout`` on every process group of this rank (see :func:`process_groups`).

    With ``barrier`` (upstream's behaviour) every rank first meets at a barrier of the
    default group, so no rank starts collectives under a shorter timeout while a
    slower one still works under the longer one. Returns the number of groups set.
    """
    if barrier:
        if torch.cuda.is_available() and dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
            torch.cuda.synchronize()
        else:
            dist.barrier()
    groups = process_groups(parallel_dims)
    for group in groups:
        _apply_timeout(timeout, group)
    return len(groups)


# ----------------------------------------------------------------------------- failures
_TIMEOUT_RE = re.compile(r"timed out|timeout", re.I)
_PEER_LOST_RE = re.compile(r"connection (closed|reset) by peer|broken pipe|remote worker crash|"
                           r"socket closed|connection refused", re.I)


def is_comm_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective that timed out or lost a peer (not a bug in user code)."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    if not isinstance(err, RuntimeError):
        return False
    text = str(err)
    return bool(_PEER_LOST_RE.search(text)) or ("gloo" in text.lower() and bool(_TIMEOUT_RE.search(text)))


def _flight_entries() -> list[dict[str, Any]]:
    if int(os.environ.get(_FR_BUFFER, os.environ.get(_FR_BUFFER_LEGACY, "0")) or 0) <= 0:
        return []
    try:
        trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    except Exception:  # noqa: BLE001 - no recorder in this build: describe without it
        return []
    return list(trace.get("entries", []))


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch (``file:line (function)``), relative to this package."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for frame in frames:
        filename = os.path.abspath(frame.get("filename", ""))
        if filename.startswith(torch_dir) or "typing_extensions" in filename:
            continue
        shown = os.path.relpath(filename, package) if filename.startswith(package) else filename
        return f"{shown}:{frame.get('line')} ({frame.get('name')})"
    return "an unknown caller"


def _group_label(entry: dict[str, Any]) -> str:
    name, desc = (tuple(entry.get("process_group") or ("?", "")) + ("", ""))[:2]
    if desc.startswith("mesh_"):
        return f"mesh axis {desc[len('mesh_'):]!r}"
    if desc in ("", "default_pg", "undefined"):
        return "the default group" if str(name) == "0" else f"group {name}"
    return f"group {desc!r}"


def _last_collective() -> str | None:
    entries = _flight_entries()
    if not entries:
        return None
    entry = max(entries, key=lambda e: (e.get("time_created_ns") or 0, e.get("record_id") or 0))
    op = str(entry.get("profiling_name", "a collective")).split(":")[-1]
    sizes = entry.get("input_sizes")
    return (f"{op} on {_group_label(entry)} (collective #{entry.get('collective_seq_id')}, "
            f"input sizes {sizes}) called from {_where(entry.get('frames') or [])}")


def describe_comm_failure(err: BaseException, *, rank: int, when: str, timeout: tuple[str, int]) -> str:
    """One line: which rank, which collective (from the flight recorder), what happened, when.

    ``when`` says where the run was (``"in step 4"``, ``"during setup"``); ``timeout``
    is the ``(field, seconds)`` of the timeout in force.
    """
    text = str(err)
    field, seconds = timeout
    collective = _last_collective() or "a collective (comm.trace_buf_size=0: no flight recorder to name it)"
    if _PEER_LOST_RE.search(text):
        what = f"a peer rank closed the connection (it crashed or was killed) during {collective}"
    elif _TIMEOUT_RE.search(text):
        what = f"{collective} timed out after {field}={seconds} s (a peer rank stalled or died)"
    else:
        what = f"{collective} failed"
    reason = " ".join(text.split())
    reason = re.sub(r"^\[[^\]]*\]\s*", "", reason)[:200]
    return f"rank {rank}: {what} {when}: {reason}"


def dump_flight_recorder(comm: CommConfig, dump_folder: str, rank: int) -> str | None:
    """Write this rank's flight-recorder entries (a pickle, torch's format) next to NCCL's dumps.

    Returns the path, or None when the recorder is off or cannot be written.
    """
    if comm.trace_buf_size <= 0:
        return None
    path = f"{_trace_prefix(comm, dump_folder)}{rank}"
    try:
        data = torch._C._distributed_c10d._dump_fr_trace()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    except Exception:  # noqa: BLE001 - the report must not fail on its way out
        return None
    return path
