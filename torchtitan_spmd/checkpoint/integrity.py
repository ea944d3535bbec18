"""Checkpoints that cannot load wrong: per-file checksums, one-line errors and save faults.

Used by :mod:`torchtitan_spmd.checkpoint.manager`; nothing here knows the trainer's state.

- **Checksums.** :class:`RecordingWriter` is DCP's ``FileSystemWriter`` that, on the rank
  that wrote them, reads back each file it wrote (after DCP's ``fsync``) and records its size
  and hash (:data:`HASH_ALGORITHM`); the coordinator adds DCP's ``.metadata``.
  :func:`gather_file_records` brings every rank's records to rank 0, which writes them into
  the completion marker (``"files"``). At load, :func:`verify_checkpoint` has each rank
  re-hash the files the rank of its number (modulo the world size) wrote, before DCP reads
  anything, and every rank learns every problem. (DCP itself checks nothing: a shard file
  with flipped tensor bytes loads wrong weights without a word. No library does this, so
  it is hand-rolled; ``zlib``/``hashlib`` do the hashing.) The marker's names are checked
  (:func:`marker_files_problem`: plain file names of the folder, whole sizes and ranks) and
  each file is opened by ``_safe_files.open_inside`` and hashed up to its opened size only:
  a link, a FIFO or ``/dev/zero`` named there is refused, not followed or read forever.
- **One-line errors.** :class:`CheckpointLoadError` (a ``ValueError``: the trainer prints it
  as ``error: ...`` and exits 2) reads ``checkpoint step-N: <what> (<file>)``;
  :func:`describe_load_failure` turns a DCP or torch exception into that ``<what>`` and
  ``<file>`` (:class:`NamingReader` names the shard file whose read failed).
  :class:`CheckpointSaveError` is a failed save: the folder, the errno and what was left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno as errno_module
import hashlib
import logging
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan_spmd._safe_files import UnsafeFile, file_size, name_problem, open_inside

from .safe_metadata import RefusedCheckpointData, RestrictedReader

__all__ = [
    "HASH_ALGORITHM",
    "CheckpointLoadError",
    "CheckpointSaveError",
    "NamingReader",
    "RecordingWriter",
    "agree_on_errors",
    "describe_load_failure",
    "failed_rank",
    "file_digest",
    "gather_file_records",
    "marker_files_problem",
    "save_failure",
    "verify_checkpoint",
]

logger = logging.getLogger("torchtitan_spmd")

#: The hash recorded for each file. crc32 measured 2-4x cheaper than blake2b here (about 0.5
#: vs 1.0 s/GiB on a quiet machine; docs/benchmarks.md); with the size it catches a file cut
#: short, any burst of flipped bits up to 32 long, and other accidental damage but for 1 in
#: 2**32. Guarding against deliberate tampering (a cryptographic hash's job) is not the aim.
#: The marker names the hash, and verification reads either.
HASH_ALGORITHM = "crc32"
_METADATA = ".metadata"
#: The completion marker's name (``checkpoint.COMPLETE_MARKER``).
COMPLETE_NAME = ".complete"
_CHUNK = 8 << 20


# ====================================================================================== hashing
class _Crc32:
    """``zlib.crc32`` behind hashlib's ``update``/``hexdigest``."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: memoryview) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


_HASHES: dict[str, Callable[[], Any]] = {"crc32": _Crc32, "blake2b": lambda: hashlib.blake2b(digest_size=16)}


def file_digest(path: str, algorithm: str | None = None) -> tuple[int, str]:
    """``(size in bytes, hex digest)`` of the file at ``path`` (read in 8 MiB chunks) with
    ``algorithm`` (default :data:`HASH_ALGORITHM`).

    Raises ``ValueError`` for an unknown ``algorithm`` (the choices: ``crc32``, ``blake2b``),
    :class:`~torchtitan_spmd._safe_files.UnsafeFile` (a ``ValueError``) when the path is a
    link or not a regular file, and ``OSError`` when the file cannot be read.
    """
    algorithm = algorithm or HASH_ALGORITHM
    if algorithm not in _HASHES:
        raise ValueError(f"unknown checkpoint hash {algorithm!r}; known: {', '.join(_HASHES)}.")
    digest, size = _HASHES[algorithm](), 0
    # opened as a file of its folder (no link followed, a regular file: a FIFO or a device
    # named here is refused, not read forever); at most the size it had when opened is read
    with open_inside(os.path.dirname(path) or ".", os.path.basename(path)) as f:
        left = file_size(f)
        buf = bytearray(max(1, min(_CHUNK, left)))
        view = memoryview(buf)
        while left > 0 and (n := f.readinto(view[:min(left, len(buf))])):
            digest.update(view[:n])
            size += n
            left -= n
    return size, digest.hexdigest()


class RecordingWriter(FileSystemWriter):
    """DCP's file-system writer (files synced), recording ``{file: (size, hash)}`` of what it wrote.

    ``written`` is filled on the rank that wrote the files, inside DCP's write phase (so a
    read error there fails the save on every rank, as a write error does); the coordinator
    adds ``.metadata`` after writing it.
    """

    def __init__(self, path: str, algorithm: str | None = None) -> None:
        super().__init__(path, sync_files=True)
        self.algorithm = algorithm or HASH_ALGORITHM
        self.written: dict[str, tuple[int, str]] = {}

    def _record(self, relative: str) -> None:
        self.written[relative] = file_digest(os.path.join(str(self.path), relative), self.algorithm)

    def write_data(self, plan: Any, planner: Any) -> Any:  # noqa: D102 - FileSystemWriter's
        with _surface_os_error():
            future = super().write_data(plan, planner)
            for relative in sorted({r.storage_data.relative_path for r in future.wait()}):
                self._record(relative)
        return future

    def finish(self, metadata: Any, results: Any) -> None:  # noqa: D102 - FileSystemWriter's
        with _surface_os_error():
            super().finish(metadata, results)
            self._record(_METADATA)


@contextlib.contextmanager
def _surface_os_error() -> Iterator[None]:
    """Re-raise an ``OSError`` that a library wrapped (``torch.save`` to a full disk raises
    ``RuntimeError("... unexpected pos ...")`` with the ``OSError`` only as its context,
    which DCP's pickling between ranks drops) as that ``OSError`` itself."""
    try:
        yield
    except OSError:
        raise
    except Exception as err:
        found: BaseException | None = err
        while found is not None and not isinstance(found, OSError):
            found = found.__cause__ or found.__context__
        if isinstance(found, OSError) and found.errno is not None:
            raise OSError(found.errno, found.strerror, found.filename) from err
        raise


def gather_file_records(written: Mapping[str, tuple[int, str]], algorithm: str, rank: int, world_size: int,
                        group: dist.ProcessGroup | None = None) -> dict[str, dict[str, Any]] | None:
    """Every rank's :attr:`RecordingWriter.written` on rank 0, as the marker's ``"files"``
    (``{file: {"size", algorithm, "rank"}}``); ``None`` on the other ranks."""
    mine = {name: (size, digest, rank) for name, (size, digest) in written.items()}
    if world_size == 1:
        everyone = [mine]
    else:
        everyone = [None] * world_size if rank == 0 else None
        dist.gather_object(mine, everyone, dst=0, group=group)
    if rank != 0:
        return None
    files: dict[str, dict[str, Any]] = {}
    for records in everyone or []:
        for name, (size, digest, writer) in (records or {}).items():
            if name in files:
                raise RuntimeError(f"checkpoint: {name} was written by ranks {files[name]['rank']} and {writer}.")
            files[name] = {"size": size, algorithm: digest, "rank": writer}
    return files


# ====================================================================================== errors
class CheckpointLoadError(ValueError):
    """A checkpoint that cannot be loaded: ``checkpoint step-N: <what> (<file>)``, one line."""

    def __init__(self, name: str, what: str, file: str) -> None:
        super().__init__(f"checkpoint {name}: {_one_line(what)} ({file})")
        self.name, self.what, self.file = name, what, file

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.what, self.file))


class CheckpointSaveError(ValueError):
    """A save that failed (disk full, I/O error, no permission): one line naming the folder,
    the errno and what was left. The trainer prints it as ``error: ...`` and exits 2."""


class _FileReadError(Exception):
    """A shard file's read failed at load (raised by :class:`NamingReader`, named by file)."""

    def __init__(self, file: str, what: str) -> None:
        super().__init__(file, what)
        self.file, self.what = file, what


class NamingReader(RestrictedReader):
    """DCP's file-system reader, reading one shard file at a time so that a failure names it.

    A :class:`~.safe_metadata.RestrictedReader`: ``.metadata`` is read without running
    anything it names (``trust_folder=True``: with plain ``pickle``).
    """

    def read_data(self, plan: Any, planner: Any) -> Any:  # noqa: D102 - FileSystemReader's
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        if not per_file:
            return super().read_data(plan, planner)
        for relative, items in per_file.items():
            try:
                future = super().read_data(dataclasses.replace(plan, items=items), planner)
                future.wait()
            except RefusedCheckpointData as err:  # a non-tensor item naming a global it may not
                raise err.in_file(relative) from None
            except UnsafeFile:  # a link, a FIFO, a device: named by the file already
                raise
            except Exception as err:  # noqa: BLE001 - torch's reader raises anything; name the file
                raise _FileReadError(relative, _what(err)) from err
        return future


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _what(err: BaseException) -> str:
    text = _one_line(str(err))
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _innermost(err: BaseException) -> BaseException:
    """The first rank's original exception inside DCP's ``CheckpointException``."""
    while isinstance(err, CheckpointException) and err.failures:
        first = err.failures[min(err.failures)]
        err = first[0] if isinstance(first, tuple) else first
    return err


def describe_load_failure(err: BaseException, path: str) -> tuple[str, str]:
    """``(what, file)`` of a DCP or torch exception raised while loading the checkpoint ``path``."""
    inner = _innermost(err)
    if isinstance(inner, RefusedCheckpointData):
        return inner.what, os.path.join(path, inner.file) if inner.file else path
    if isinstance(inner, UnsafeFile):
        return inner.line, inner.path
    if isinstance(inner, _FileReadError):
        return f"reading it failed: {inner.what}", os.path.join(path, inner.file)
    if isinstance(inner, OSError) and inner.filename:
        return _what(inner), str(inner.filename)
    return _what(inner), path


def failed_rank(err: BaseException, rank: int) -> int:
    """The rank where ``err`` happened: the first failed rank DCP reports, else ``rank``."""
    if isinstance(err, CheckpointException) and err.failures:
        return min(err.failures)
    return rank


def save_failure(err: BaseException) -> tuple[int | None, str]:
    """``(errno, one-line description)`` of an exception raised by a save (DCP's wrapped ones too)."""
    inner = _innermost(err)
    found = inner
    while found is not None and not isinstance(found, OSError):  # an OSError a library wrapped
        found = found.__cause__ or found.__context__
    if isinstance(found, OSError) and found.errno is not None:
        code = errno_module.errorcode.get(found.errno, str(found.errno))
        where = f" ({found.filename})" if found.filename else ""
        return found.errno, f"[Errno {found.errno} {code}] {found.strerror or os.strerror(found.errno)}{where}"
    return None, _what(inner)


def agree_on_errors(error: Any, rank: int, world_size: int,
                    group: dist.ProcessGroup | None = None) -> list[tuple[int, Any]]:
    """Every rank's error (None: none) in rank order, known to every rank: ``[(rank, error)]``."""
    if world_size == 1:
        return [(0, error)] if error is not None else []
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, error, group=group)
    return [(r, e) for r, e in enumerate(everyone) if e is not None]


# ====================================================================================== verify
def _check_file(path: str, name: str, want: Mapping[str, Any], algorithm: str) -> str | None:
    if name_problem(name) is not None:  # the marker's check refused it already
        return f"{name_problem(name)}"
    full = os.path.join(path, name)
    try:
        with open_inside(path, name) as f:
            size = file_size(f)
    except FileNotFoundError:
        return "is missing"
    except UnsafeFile as err:
        return err.what
    except OSError as err:
        return f"cannot be read ({_what(err)})"
    if size != want.get("size"):
        return f"has {size} bytes, its record {want.get('size')} (cut short or overwritten?)"
    try:
        read, digest = file_digest(full, algorithm)
    except UnsafeFile as err:
        return err.what
    except OSError as err:
        return f"cannot be read ({_what(err)})"
    if read != size:
        return f"changed size while it was read ({size} bytes, then {read})"
    if digest != want.get(algorithm):
        return f"has {algorithm} {digest}, its record {want.get(algorithm)} (same size: bytes changed)"
    return None


def local_problems(path: str, record: Mapping[str, Any], rank: int, world_size: int) -> list[tuple[str, str]] | None:
    """This rank's share of the check of checkpoint ``path`` against its marker ``record``:
    ``[(file, what differs)]`` for the files written by the ranks ``rank (mod world_size)``.
    ``None``: the marker records no checksums (a checkpoint from before they existed)."""
    files = record.get("files")
    if files is None:
        return None
    algorithm = record.get("hash", HASH_ALGORITHM)
    problem = marker_files_problem(record)
    if problem is not None:
        return [(COMPLETE_NAME, problem)] if rank == 0 else []
    problems = []
    for name in sorted(files):
        want = files[name]
        if want.get("rank", 0) % world_size != rank:
            continue
        problem = _check_file(path, name, want, algorithm)
        if problem is not None:
            problems.append((name, problem))
    return problems



def _whole(value: Any) -> bool:
    return type(value) is int and value >= 0


def marker_files_problem(record: Mapping[str, Any]) -> str | None:
    """What is wrong with the marker ``record``'s file records (``"hash"``, ``"files"``), as
    ``its file records ...``; None: nothing (or none recorded). Each name must be a plain file
    name of the folder (a ``str``, no separator, no ``..``), each record a size and a rank
    (whole numbers) and the hash (a string)."""
    files = record.get("files")
    if files is None:
        return None
    algorithm = record.get("hash", HASH_ALGORITHM)
    if type(algorithm) is not str or algorithm not in _HASHES:
        return f"names the hash {str(algorithm)[:40]!r}; known: {', '.join(_HASHES)}"
    if type(files) is not dict or _METADATA not in files:
        return f"has malformed file records (a {type(files).__name__}, without {_METADATA})"
    for name, want in files.items():
        problem = name_problem(name)
        if problem is not None:
            return f"lists {str(name)[:80]!r} among its files, which {problem}"
        if type(want) is not dict:
            return f"records {name} as a {type(want).__name__}, not a size, rank and {algorithm}"
        for key in ("size", "rank"):
            if key in want or key == "size":
                if not _whole(want.get(key)):
                    return f"records {key} {str(want.get(key))[:40]!r} for {name}, not a whole number"
        if type(want.get(algorithm)) is not str:
            return f"records no {algorithm} string for {name}"
    return None


def verify_checkpoint(path: str, record: Mapping[str, Any], rank: int, world_size: int,
                      group: dist.ProcessGroup | None = None) -> list[tuple[str, str]] | None:
    """Verify checkpoint ``path`` on every rank together (each its share, see
    :func:`local_problems`); every rank returns every problem, ``[(file, what)]`` sorted by
    file, or ``None`` when the checkpoint records no checksums."""
    mine = local_problems(path, record, rank, world_size)
    if world_size == 1:
        return mine
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    if everyone[0] is None:
        return None
    return sorted(p for problems in everyone for p in (problems or []))


def newest_complete(names: Iterable[int]) -> str:
    """``"step-N"`` of the largest step, or ``"none"``."""
    steps = sorted(names)
    return f"step-{steps[-1]}" if steps else "none"
