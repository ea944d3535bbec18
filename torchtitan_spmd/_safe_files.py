"""Opening a file of a folder someone else wrote: only a regular file, inside the folder, bounded.

Every file a checkpoint load reads from a folder it did not write (DCP's ``.metadata`` and
shard files, the ``.complete`` marker and the files it lists, a Hugging Face folder's
``*.safetensors``, ``config.json`` and ``model.safetensors.index.json``) is opened by
:func:`open_inside`, which checks the file *as it is opened*, not its name beforehand:

- the name is a ``str`` naming an entry of the folder itself: no separator (``/`` or
  ``\\``), not ``.`` or ``..``, no NUL (:func:`name_problem`). A ``pathlib`` path, whose
  ``str()`` a pickle can make say anything, is not a name;
- the folder is opened with ``O_DIRECTORY | O_NOFOLLOW`` and the file relative to it
  (``dir_fd``) with ``O_NOFOLLOW``: a symbolic link, the folder's own or a file's, is never
  followed, so the file opened is the folder's own entry;
- the entry is ``lstat``-ed first and ``fstat``-ed once open: a FIFO, a device, a socket or a
  folder is refused without being opened (opening a FIFO for reading blocks until a writer
  comes), and the open itself uses ``O_NONBLOCK``, in case the entry was swapped between the
  two; the inode must be the one ``lstat`` saw;
- the opened file's size (``fstat``) bounds what is read: :func:`read_inside` reads at most
  that many bytes and refuses a file larger than the caller's limit, and DCP's reader
  (``checkpoint/safe_metadata.py``) checks every item's offset and length against it.

A refusal is :class:`UnsafeFile` (a ``ValueError``: the trainer prints it as one ``error:``
line and exits 2) naming the file and what it is.

Hand-rolled because neither DCP nor ``safetensors`` nor ``json`` checks any of this: DCP
opens ``folder / relative_path`` (any path a pickle names, through any link), and a FIFO or
``/dev/zero`` passes every ``os.path`` check a name-based guard can make. Linux (and other
POSIX systems with ``O_NOFOLLOW`` and ``dir_fd``) only, as the rest of the library.

Hard links are not detected: a hard link inside the folder *is* the folder's entry, and
making one to a file needs access to that file (Linux's ``protected_hardlinks``).
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from typing import IO, Any

__all__ = [
    "MAX_JSON_BYTES",
    "UnsafeFile",
    "file_size",
    "list_inside",
    "name_problem",
    "open_inside",
    "read_inside",
    "read_json_inside",
]

#: The largest JSON file (marker, ``config.json``, index) read: 64 MiB. A real one is a few KB
#: (a 405B model's ``model.safetensors.index.json``: about 100 KB).
MAX_JSON_BYTES = 64 << 20

_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
    stat.S_IFLNK: "a symbolic link",
}
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOCTTY = getattr(os, "O_NOCTTY", 0)


class UnsafeFile(ValueError):
    """A file of a folder that may not be read, or that is malformed: ``<path>: <name> <what>``.

    ``folder`` is the folder, ``name`` the entry (``""``: the folder itself), ``what`` the
    reason (``is a symbolic link, ...``); :attr:`path` joins them.
    """

    def __init__(self, folder: str, name: str, what: str) -> None:
        super().__init__(folder, name, what)
        self.folder, self.name, self.what = str(folder), name, what

    @property
    def path(self) -> str:
        """The file's path (the folder's, for the folder itself or a name that is none)."""
        return os.path.join(self.folder, self.name) if self.name and not name_problem(self.name) else self.folder

    @property
    def line(self) -> str:
        """``<name> <what>`` (``the folder <what>`` for the folder itself)."""
        return f"{self.name or 'the folder'} {self.what}"

    def __str__(self) -> str:
        return f"{self.path}: {self.line}"

    def __reduce__(self) -> tuple[Any, ...]:  # DCP gathers exceptions across ranks
        return (type(self), (self.folder, self.name, self.what))


def name_problem(name: Any) -> str | None:
    """Why ``name`` is not the plain name of an entry of a folder (None: it is one).

    Only a printable ``str`` (no NUL, newline or other control character) with no ``/`` or
    ``\\``, other than ``""``, ``.`` and ``..``, is.
    """
    if type(name) is not str:  # noqa: E721 - a str subclass (or a pathlib path) can print as anything
        return f"is a {type(name).__name__}, not a file name (a str)"
    if name in ("", ".", "..") or any(c in name for c in "/\\") or not name.isprintable():
        return "is not a plain file name of the folder (no separators, no '..', no control characters)"
    return None


def _symlink_line(what: str) -> str:
    return (f"is {what}, which a checkpoint's folder may not hold (only regular files are read, and no "
            "link is followed; a Hugging Face cache snapshot links its files: copy it with `cp -rL` first)")


def _open_folder(folder: str) -> int:
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.lexists(folder):  # ELOOP, ENOTDIR
            st = os.lstat(folder)
            what = _KINDS.get(stat.S_IFMT(st.st_mode), "not a folder")
            raise UnsafeFile(folder, "", _symlink_line(what) if stat.S_ISLNK(st.st_mode)
                             else f"is {what}, not a folder") from None
        raise


def open_inside(folder: str | os.PathLike[str], name: Any) -> IO[bytes]:
    """The regular file ``name`` of ``folder``, open for reading (binary, unbuffered-safe).

    Raises :class:`UnsafeFile` when ``name`` is not a plain name, the folder or the entry is a
    symbolic link, or the entry is not a regular file; ``OSError`` (``FileNotFoundError`` ...,
    with the path) when it cannot be opened.
    """
    folder = os.fspath(folder)
    problem = name_problem(name)
    if problem is not None:
        shown = repr(name) if isinstance(name, str) else f"a {type(name).__name__}"
        raise UnsafeFile(folder, "", f"is asked for {shown}, a name that {problem}")
    dir_fd = _open_folder(folder)
    try:
        try:
            before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError as err:
            raise type(err)(err.errno, err.strerror, os.path.join(folder, name)) from None
        kind = stat.S_IFMT(before.st_mode)
        if kind != stat.S_IFREG:
            what = _KINDS.get(kind, "not a regular file")
            raise UnsafeFile(folder, name, _symlink_line(what) if kind == stat.S_IFLNK
                             else f"is {what}, not a regular file")
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC | _O_NOCTTY, dir_fd=dir_fd)
        except OSError as err:
            if err.errno == errno.ELOOP:  # swapped for a link since the lstat
                raise UnsafeFile(folder, name, _symlink_line("a symbolic link")) from None
            raise type(err)(err.errno, err.strerror, os.path.join(folder, name)) from None
    finally:
        os.close(dir_fd)
    try:
        after = os.fstat(fd)
        if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise UnsafeFile(folder, name, "changed while it was being opened (swapped for another file)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def file_size(f: IO[bytes]) -> int:
    """The size of the open file ``f`` (``fstat``)."""
    return os.fstat(f.fileno()).st_size


def read_inside(folder: str | os.PathLike[str], name: Any, max_bytes: int) -> bytes:
    """The bytes of the regular file ``name`` of ``folder`` (:func:`open_inside`), at most its
    size at opening; :class:`UnsafeFile` when it has more than ``max_bytes``."""
    with open_inside(folder, name) as f:
        size = file_size(f)
        if size > max_bytes:
            raise UnsafeFile(os.fspath(folder), name, f"has {size} bytes, more than the {max_bytes} such a file "
                                                      "may have")
        return f.read(size)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is not finite")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"{text} is not a JSON number")


def read_json_inside(folder: str | os.PathLike[str], name: Any, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON value of the file ``name`` of ``folder`` (:func:`read_inside`).

    :class:`UnsafeFile` in one line for anything that is not plain, finite JSON: a syntax
    error, bytes that are not UTF-8, ``NaN``/``Infinity``, a number too large for a float
    (``1e400``) or an int of more than Python's 4300 digits, nesting deeper than the
    interpreter's recursion limit.
    """
    data = read_inside(folder, name, max_bytes)
    try:
        return json.loads(data, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        what = "nests deeper than this reader follows (RecursionError)"
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        what = f"is not valid JSON ({' '.join(str(err).split())[:160]})"
    raise UnsafeFile(os.fspath(folder), name, what)


def list_inside(folder: str | os.PathLike[str]) -> list[str]:
    """The entry names of ``folder`` (not followed if it is a link: :class:`UnsafeFile`)."""
    folder = os.fspath(folder)
    fd = _open_folder(folder)
    try:
        return sorted(os.listdir(fd))
    finally:
        os.close(fd)
