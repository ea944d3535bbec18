"""Reading a DCP checkpoint folder someone else wrote: no code run, nothing outside it read,
nothing in the loading process changed, no crash, no hang.

DCP's ``FileSystemReader.read_metadata`` reads ``.metadata`` with ``pickle.load``, its
``DefaultLoadPlanner.load_bytes`` reads every non-tensor item (the step count, the
scheduler's and data loader's state, the optimizer's hyperparameters) with
``torch.load(weights_only=False)``, and its ``read_data`` opens ``folder / relative_path``
for whatever path the metadata names and reads ``length`` bytes at ``offset`` of it. A
folder can thereby run any code, read any file the loading user can (a ``..`` path, an
absolute one, a symbolic link, a ``pathlib`` path whose ``str()`` says one thing and whose
parts another), allocate any amount of memory (``/dev/zero`` with a huge length), block
forever (a FIFO) or crash the interpreter (a tuple nested a million deep as a dict key:
hashing it overflows the C stack). The per-file checksums (:mod:`.integrity`) do not help:
whoever wrote the folder wrote their record.

This module closes each (``docs/checkpoint-trust.md`` has the table of attacks):

- :class:`MetadataUnpickler` reads ``.metadata`` (a pickle decoder over its bytes, with
  its opcodes restricted): only the globals of :data:`ALLOWED_GLOBALS` resolve (anything
  else is refused *before* it is imported); a call (REDUCE, NEWOBJ) only of those; BUILD
  (which sets attributes) only on an *instance* of DCP's metadata classes, with plain
  state (never on a class, a function or a shared object: a refused file cannot leave
  ``pathlib.PurePosixPath.__truediv__`` replaced); append and set-item only on real lists
  and dicts. Then :func:`check_metadata` checks every field's type: a ``relative_path``
  must be a ``str`` plain file name (not a ``pathlib`` path).
- every pickle read is bounded: nesting at most :data:`MAX_DEPTH` deep and at most
  :data:`MAX_OPS` opcodes, so no hash or comparison of what it builds can overflow the C
  stack (:class:`MetadataUnpickler` tracks it as it builds; :func:`check_pickle_bounds`
  walks each item's ``data.pkl`` before ``torch.load``, and a trusted ``.metadata`` before
  plain ``pickle``).
- :class:`RestrictedReader` (DCP's ``FileSystemReader``) opens ``.metadata`` and every shard
  file through :func:`torchtitan_spmd._safe_files.open_inside` (a regular file of the
  folder, no link followed) and checks each item's offset and length against the opened
  file's size; an item stored with a transform (DCP's experimental compression, whose
  output no size bounds) is refused.
- :class:`RestrictedLoadPlanner` (DCP's ``DefaultLoadPlanner``) reads the non-tensor items
  with ``torch.load(weights_only=True)`` (only ``torch.save``'s zip format, bounded as
  above) and checks each against the value it replaces: the same kind (number, string,
  list of the same length, dict of the same keys ...), finite numbers.

A refusal raises :class:`RefusedCheckpointData` (or :class:`~torchtitan_spmd._safe_files.UnsafeFile`
for a file) naming the file and what is wrong; the manager turns it into one line,
``checkpoint step-N: .metadata refers to os.system, which a checkpoint may not load (<file>)``.

``checkpoint.trust_checkpoint_folder`` turns the unpickling restrictions off (plain
``pickle`` and ``weights_only=False``, DCP's own behaviour) for metadata the allow-list
misses, e.g. a newer torch's class; the caller warns, naming the folder. The file checks
and the bounds stay on (no real checkpoint trips them).

Hand-rolled because torch has no restricted reader for DCP's metadata (``weights_only``
covers ``torch.load`` only, and its allow-list lacks DCP's classes), and neither it nor
``pickle`` bounds nesting or restricts BUILD (the C unpickler's opcodes cannot be
restricted; ``docs/checkpoint-trust.md`` says why each check is there).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import pickletools
import struct
from collections import OrderedDict
from collections.abc import Mapping
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.futures import Future

from torchtitan_spmd._safe_files import (
    UnsafeFile,
    file_size,
    name_problem,
    open_inside,
    read_inside,
)

__all__ = [
    "ALLOWED_GLOBALS",
    "MAX_DEPTH",
    "MAX_METADATA_BYTES",
    "MAX_OPS",
    "MetadataUnpickler",
    "RefusedCheckpointData",
    "RestrictedLoadPlanner",
    "RestrictedReader",
    "allowed_objects",
    "check_metadata",
    "check_pickle_bounds",
    "check_torch_item",
    "read_metadata_bytes",
]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"

#: ``(module, name)`` of every global a DCP ``.metadata`` may name, besides torch's dtypes
#: (``("torch", "float32")`` ..., every ``torch.dtype`` attribute of ``torch``). Found by
#: reading what DCP pickles (``torch/distributed/checkpoint/metadata.py`` and
#: ``filesystem.py``; the same names on torch 2.11 to 2.14) and by recording every global of
#: the checkpoints the test suite writes:
#:
#: - ``Metadata`` and what it holds: ``TensorStorageMetadata`` / ``BytesStorageMetadata``
#:   per key, ``ChunkStorageMetadata`` per chunk, ``TensorProperties`` (whose state holds a
#:   ``_MEM_FORMAT_ENCODING`` and a layout, pickled as ``torch.serialization._get_layout``,
#:   a lookup by name), ``StorageMeta``; ``MetadataIndex`` keys;
#: - the file-system storage's item, ``filesystem._StorageInfo``;
#: - ``torch.Size`` (shapes and offsets);
#: - ``pathlib`` paths (``StorageMeta.checkpoint_id`` is the save's path; Python 3.13 pickles
#:   them from ``pathlib._local``);
#: - ``collections.OrderedDict`` (a planner's mappings).
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    *((_DCP_METADATA, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *((module, name) for module in ("pathlib", "pathlib._local")
      for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
})

#: The deepest nesting a pickle read here may build (a container inside a container ...,
#: 256 levels). DCP's metadata nests about 7 deep (Metadata, its dict, an entry, its chunk
#: list, a chunk, a Size, an int) and a trainer's non-tensor item about 5; a tuple nested
#: some 100,000 deep crashes the interpreter when hashed (as a dict key is).
MAX_DEPTH = 256
#: The most opcodes one pickle may hold: 50 million (each builds or references at most one
#: object). The debug model's full checkpoint's ``.metadata`` holds about 40,000.
MAX_OPS = 50_000_000
#: The largest ``.metadata`` read: 4 GiB (the debug model's is 255 KB; a 405B model's on a
#: few thousand ranks some hundreds of MB).
MAX_METADATA_BYTES = 4 << 30

_OBJECTS: dict[tuple[str, str], Any] = {}
_ALLOWED_IDS: set[int] = set()


def allowed_objects() -> dict[tuple[str, str], Any]:
    """``{(module, name): object}`` for :data:`ALLOWED_GLOBALS` that this torch and Python have,
    plus every torch dtype; built once, by import and ``getattr`` of the names above only."""
    if not _OBJECTS:
        import importlib

        for module, name in ALLOWED_GLOBALS:
            try:
                found = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):  # pathlib._local before Python 3.13
                continue
            _OBJECTS[(module, name)] = found
        for name in dir(torch):
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                _OBJECTS[("torch", name)] = value
        _ALLOWED_IDS.update(id(v) for v in _OBJECTS.values())
    return _OBJECTS


def _buildable() -> frozenset[type]:
    """The classes whose fresh instances BUILD may set the state of: DCP's metadata records."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    return frozenset({Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata, BytesStorageMetadata,
                      ChunkStorageMetadata, TensorProperties, _StorageInfo})


class RefusedCheckpointData(pickle.UnpicklingError):
    """A checkpoint file that names a global a checkpoint may not load, or is not DCP's.

    The message (:attr:`what`) is ``<where> <reason>``: ``.metadata refers to os.system,
    which a checkpoint may not load``. ``where`` names the file, or an item
    (``the item 'train_state.step' in __0_0.distcp``); ``file`` is the file's name inside
    the folder ("" while not yet known); ``refused`` the global (``"os.system"``), None for a
    malformed file.
    """

    def __init__(self, where: str, reason: str, file: str, refused: str | None = None) -> None:
        super().__init__(where, reason, file, refused)
        self.where, self.reason, self.file, self.refused = where, reason, file, refused

    @property
    def what(self) -> str:
        """The one-line reason, ``<where> <reason>``."""
        return f"{self.where} {self.reason}"

    def __str__(self) -> str:
        return self.what

    def __reduce__(self) -> tuple[Any, ...]:  # DCP gathers exceptions across ranks
        return (type(self), (self.where, self.reason, self.file, self.refused))

    def in_file(self, file: str) -> RefusedCheckpointData:
        """The same refusal of an item read from ``file`` (a shard file), naming it."""
        if self.file:
            return self
        return RefusedCheckpointData(f"{self.where} in {file}", self.reason, file, self.refused)


def _may_be_newer_dcp_class(refused: str) -> bool:
    """Whether ``refused`` (``module.name``) could be a DCP metadata class a newer torch added:
    a class-like name (capitalized) of ``torch.distributed.checkpoint``. Nothing else gets the
    trust hint: a function (``torch.fx.graph_module._forward_from_src`` runs a source string)
    or any other module's name is what a payload names, not what a newer DCP pickles."""
    module, _, name = refused.rpartition(".")
    return (module == "torch.distributed.checkpoint" or module.startswith("torch.distributed.checkpoint.")) \
        and name.lstrip("_")[:1].isupper()


def _refusal(file: str, where: str, refused: str) -> RefusedCheckpointData:
    if not refused.isprintable() or len(refused) > 200:  # a crafted name: one line, bounded
        refused = repr(refused[:200])
    hint = ""
    if _may_be_newer_dcp_class(refused):
        hint = ("; if a newer torch wrote it and you trust whoever wrote the folder, "
                "--checkpoint.trust_checkpoint_folder loads it")
    return RefusedCheckpointData(where, f"refers to {refused}, which a checkpoint may not load{hint}", file, refused)


# ============================================================================ pickle bounds
_PUSH_ATOM = frozenset({
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "STRING", "BINSTRING", "SHORT_BINSTRING",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
    "BINUNICODE8", "FLOAT", "BINFLOAT", "NONE", "NEWTRUE", "NEWFALSE", "NEXT_BUFFER", "GLOBAL", "PERSID",
    "EXT1", "EXT2", "EXT4"})
_PUSH_EMPTY = frozenset({"EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"})
_FROM_MARK = frozenset({"TUPLE", "LIST", "DICT", "FROZENSET", "OBJ", "INST"})
_INTO_FROM_MARK = frozenset({"APPENDS", "SETITEMS", "ADDITEMS"})
_POPS = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "REDUCE": 2, "NEWOBJ": 2, "NEWOBJ_EX": 3, "STACK_GLOBAL": 2,
         "BINPERSID": 1}
_INTO = {"APPEND": 1, "SETITEM": 2, "BUILD": 1}
_NOTHING = frozenset({"PROTO", "FRAME", "STOP", "READONLY_BUFFER"})


class _Malformed(Exception):
    pass


def check_pickle_bounds(data: bytes | bytearray | memoryview, where: str, file: str, *, kind: str = "a pickle",
                        max_depth: int = MAX_DEPTH, max_ops: int = MAX_OPS) -> None:
    """Refuse (:class:`RefusedCheckpointData`, ``<where> ...``) a pickle that would build
    anything nested deeper than ``max_depth`` or that holds more than ``max_ops`` opcodes,
    without building it.

    A walk over the opcodes (:func:`pickletools.genops`) keeping, for each object on the
    unpickler's stack and memo, the depth of what it will be. An object changed after it was
    placed inside another (appended to, set, BUILD) would deepen that other one unseen, so
    such a change that deepens it is refused (pickle writes an object whole before using it;
    only a cycle does otherwise, and DCP's data has none).
    """
    stack: list[Any] = []  # cells [depth, placed] (or the same cell twice: DUP, GET)
    marks: list[int] = []
    memo: dict[int, list[Any]] = {}

    def pop(n: int = 1) -> list[list[Any]]:
        floor = marks[-1] if marks else 0
        if len(stack) - n < floor:
            raise _Malformed("pops past a mark or an empty stack")
        items = stack[len(stack) - n:]
        del stack[len(stack) - n:]
        return items

    def pop_mark() -> list[list[Any]]:
        if not marks:
            raise _Malformed("has no mark to pop to")
        k = marks.pop()
        items = stack[k:]
        del stack[k:]
        return items

    def place(items: list[list[Any]]) -> int:
        for cell in items:
            cell[1] = True
        return max((cell[0] for cell in items), default=0)

    def push(depth: int) -> None:
        if depth > max_depth:
            raise RefusedCheckpointData(where, f"nests more than {max_depth} levels deep, more than a checkpoint "
                                               "holds (a crafted pickle: hashing it could crash the process)", file)
        stack.append([depth, False])

    def deepen(depth: int) -> None:
        if not stack or (marks and len(stack) <= marks[-1]):
            raise _Malformed("changes an object that is not there")
        cell = stack[-1]
        if depth > cell[0]:
            if cell[1]:
                raise RefusedCheckpointData(where, "changes an object after placing it inside another (a cycle, "
                                                   "which a checkpoint never holds)", file)
            if depth > max_depth:
                push(depth)  # raises
            cell[0] = depth

    ops = 0
    try:
        for opcode, arg, _ in pickletools.genops(data):
            ops += 1
            if ops > max_ops:
                raise RefusedCheckpointData(where, f"holds more than {max_ops} pickle opcodes, more than a "
                                                   "checkpoint holds", file)
            name = opcode.name
            if name in _PUSH_ATOM:
                push(0)
            elif name in _PUSH_EMPTY:
                push(1)
            elif name in _NOTHING:
                pass
            elif name == "MARK":
                marks.append(len(stack))
            elif name in _FROM_MARK:
                push(1 + place(pop_mark()))
            elif name in _POPS:
                items = pop(_POPS[name])
                push(0 if name == "STACK_GLOBAL" else 1 + place(items))
            elif name in _INTO:
                deepen(1 + place(pop(_INTO[name])))
            elif name in _INTO_FROM_MARK:
                items = pop_mark()
                deepen(1 + place(items))
            elif name == "POP":
                if marks and len(stack) == marks[-1]:
                    marks.pop()
                else:
                    pop()
            elif name == "POP_MARK":
                pop_mark()
            elif name == "DUP":
                stack.append(pop()[0])
                stack.append(stack[-1])
            elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                if not stack:
                    raise _Malformed("memoizes nothing")
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                if arg not in memo:
                    raise _Malformed(f"gets memo entry {arg}, which it never put")
                stack.append(memo[arg])
            else:
                raise _Malformed(f"uses the opcode {name}")
    except RefusedCheckpointData:
        raise
    except RecursionError:
        raise RefusedCheckpointData(where, f"cannot be read as {kind} (RecursionError)", file) from None
    except (_Malformed, ValueError, TypeError, KeyError, IndexError, OverflowError, MemoryError) as err:
        line = " ".join(str(err).split())[:160]
        raise RefusedCheckpointData(where, f"cannot be read as {kind} ({line})", file) from None


# ============================================================================ .metadata
def _what_object(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"the function {getattr(obj, '__module__', '?')}.{obj.__qualname__}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__} object"


class _Truncated(Exception):
    pass


class MetadataUnpickler:
    """A pickle decoder restricted to what DCP's ``.metadata`` is made of (protocols 2 to 5),
    bounding what it builds as it goes.

    - a global resolves only through :meth:`find_class` (:func:`allowed_objects`); any other
      raises :class:`RefusedCheckpointData` before it is imported or called;
    - REDUCE, NEWOBJ and NEWOBJ_EX call only those objects; persistent ids, INST, OBJ, the
      extension registry (EXT*), out-of-band buffers and protocol 0's text opcodes are
      refused (DCP's metadata uses none);
    - BUILD only on an instance whose exact class is one of DCP's metadata records, with a
      dict of identifier keys as state (``TensorProperties``: the tuple its own
      ``__setstate__`` takes): never on a class, a function, an enum member, a dtype or a
      path, so nothing outside the objects being built can change;
    - APPEND(S) only on a ``list``, SETITEM(S) only on a ``dict`` or ``OrderedDict``,
      ADDITEMS only on a ``set``;
    - nothing nests deeper than :data:`MAX_DEPTH` (every object's depth is tracked as it is
      built, as :func:`check_pickle_bounds` does; an object deepened after it was placed
      inside another is refused), and at most :data:`MAX_OPS` opcodes are read.

    Hand-written over the bytes (not ``pickle``'s C unpickler, whose opcodes cannot be
    restricted, nor its pure-Python one, which is some 3 times slower): about 10 times
    plain pickle's time on DCP's metadata (docs/benchmarks.md).

    Args:
        stream: the file's bytes, or a binary stream holding them.
        file: the file's name, for the messages.
    """

    def __init__(self, stream: IO[bytes] | bytes | bytearray, file: str = ".metadata") -> None:
        self.data = bytes(stream) if isinstance(stream, (bytes, bytearray, memoryview)) else stream.read()
        self.file = file
        allowed_objects()
        self._buildable = _buildable()

    def find_class(self, module: str, name: str) -> Any:
        """The allowed object ``module.name``; :class:`RefusedCheckpointData` for any other."""
        found = allowed_objects().get((module, name))
        if found is None:
            raise _refusal(self.file, self.file, f"{module}.{name}")
        return found

    def _refuse(self, what: str) -> RefusedCheckpointData:
        return RefusedCheckpointData(self.file, f"{what}, which a checkpoint may not do", self.file)

    def _too_deep(self) -> RefusedCheckpointData:
        return RefusedCheckpointData(self.file, f"nests more than {MAX_DEPTH} levels deep, more than a checkpoint "
                                                "holds (a crafted pickle: hashing it could crash the process)",
                                     self.file)

    def load(self) -> Any:  # noqa: C901, PLR0912, PLR0915 - one opcode loop, as pickle's own
        """The object the bytes hold (see the class docstring for what is refused)."""
        data, file = self.data, self.file
        end = len(data)
        unpack_from = struct.unpack_from
        allowed_ids, buildable = _ALLOWED_IDS, self._buildable
        stack: list[Any] = []
        cells: list[list[Any]] = []  # per stack entry: [depth, placed inside another]
        marks: list[int] = []
        memo: dict[int, Any] = {}
        memo_cells: dict[int, list[Any]] = {}
        atom, empty = [0, True], [1, True]  # shared: never changed (nothing adds to an int or a ())
        too_deep = MAX_DEPTH
        i = ops = 0
        count = end > MAX_OPS  # (each opcode is at least a byte: a shorter pickle cannot hold more)
        malformed = pickle.UnpicklingError
        try:
            while True:
                op = data[i]  # (IndexError past the end: truncated)
                i += 1
                if count:
                    ops += 1
                    if ops > MAX_OPS:
                        raise RefusedCheckpointData(file, f"holds more than {MAX_OPS} pickle opcodes, more than a "
                                                          "checkpoint holds", file)
                if op == 0x94:  # MEMOIZE
                    n = len(memo)
                    memo[n] = stack[-1]  # (IndexError on an empty stack)
                    memo_cells[n] = cells[-1]
                elif op == 0x6A or op == 0x68:  # LONG_BINGET, BINGET
                    if op == 0x68:
                        n = data[i]
                        i += 1
                    else:
                        n = unpack_from("<I", data, i)[0]
                        i += 4
                    stack.append(memo[n])
                    cells.append(memo_cells[n])
                elif op == 0x29:  # EMPTY_TUPLE
                    stack.append(())
                    cells.append(empty)
                elif op == 0x81:  # NEWOBJ
                    if len(stack) - 2 < (marks[-1] if marks else 0):
                        raise malformed("NEWOBJ past a mark")
                    args = stack.pop()
                    cls = stack.pop()
                    acell = cells.pop()
                    ccell = cells.pop()
                    if id(cls) not in allowed_ids or not isinstance(cls, type) or type(args) is not tuple:
                        raise self._refuse(f"creates {_what_object(cls)} (NEWOBJ)")
                    acell[1] = ccell[1] = True
                    depth = 1 + max(acell[0], ccell[0])
                    if depth > too_deep:
                        raise self._too_deep()
                    stack.append(cls.__new__(cls, *args))
                    cells.append([depth, False])
                elif op == 0x8C:  # SHORT_BINUNICODE
                    n = data[i] + i + 1
                    if n > end:
                        raise _Truncated()
                    stack.append(str(data[i + 1:n], "utf-8", "surrogatepass"))
                    cells.append(atom)
                    i = n
                elif op == 0x28:  # MARK
                    marks.append(len(stack))
                elif op == 0x62:  # BUILD
                    if len(stack) - 2 < (marks[-1] if marks else 0):
                        raise malformed("BUILD past a mark")
                    state = stack.pop()
                    scell = cells.pop()
                    inst = stack[-1]
                    cls = type(inst)
                    if cls not in buildable:
                        raise self._refuse(f"sets attributes (BUILD) on {_what_object(inst)}")
                    self._deepen(cells[-1], scell)
                    setstate = cls.__dict__.get("__setstate__")
                    if setstate is not None:
                        if type(state) is not tuple:
                            raise self._refuse(f"sets a {cls.__name__}'s state from a {type(state).__name__} (BUILD)")
                        setstate(inst, state)
                    elif type(state) is not dict or not all(
                            type(k) is str and k.isidentifier() and not k.startswith("__") for k in state):
                        raise self._refuse(f"sets a {cls.__name__}'s attributes from other than a dict of plain "
                                           "names (BUILD)")
                    else:
                        inst.__dict__.update(state)
                elif op == 0x7D or op == 0x5D or op == 0x8F:  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
                    stack.append({} if op == 0x7D else [] if op == 0x5D else set())
                    cells.append([1, False])
                elif op == 0x75 or op == 0x65 or op == 0x90:  # SETITEMS, APPENDS, ADDITEMS
                    if not marks:
                        raise malformed("no mark to pop to")
                    k = marks.pop()
                    items, its = stack[k:], cells[k:]
                    del stack[k:], cells[k:]
                    if len(stack) <= (marks[-1] if marks else 0):
                        raise malformed("adds items to nothing")
                    obj = stack[-1]
                    want = (dict, OrderedDict) if op == 0x75 else (list,) if op == 0x65 else (set,)
                    if type(obj) not in want:
                        raise self._refuse(f"adds items ({pickletools.code2op[chr(op)].name}) to {_what_object(obj)}")
                    self._deepen(cells[-1], *its)
                    if op == 0x75:
                        if len(items) % 2:
                            raise malformed("SETITEMS of an odd number of items")
                        for k in range(0, len(items), 2):
                            obj[items[k]] = items[k + 1]
                    elif op == 0x65:
                        obj.extend(items)
                    else:
                        obj.update(items)
                elif op == 0x85 or op == 0x86 or op == 0x87:  # TUPLE1, TUPLE2, TUPLE3
                    n = op - 0x84
                    if len(stack) - n < (marks[-1] if marks else 0):
                        raise malformed("TUPLE past a mark")
                    items, its = tuple(stack[-n:]), cells[-n:]
                    del stack[-n:], cells[-n:]
                    depth = 1
                    for cell in its:
                        cell[1] = True
                        if cell[0] >= depth:
                            depth = cell[0] + 1
                    if depth > too_deep:
                        raise self._too_deep()
                    stack.append(items)
                    cells.append([depth, True] if depth > 1 else empty)
                elif op == 0x4D or op == 0x4A or op == 0x4B:  # BININT2, BININT, BININT1
                    if op == 0x4B:
                        stack.append(data[i])
                        i += 1
                    elif op == 0x4D:
                        stack.append(unpack_from("<H", data, i)[0])
                        i += 2
                    else:
                        stack.append(unpack_from("<i", data, i)[0])
                        i += 4
                    cells.append(atom)
                elif op == 0x52:  # REDUCE
                    if len(stack) - 2 < (marks[-1] if marks else 0):
                        raise malformed("REDUCE past a mark")
                    args = stack.pop()
                    func = stack.pop()
                    acell = cells.pop()
                    fcell = cells.pop()
                    if id(func) not in allowed_ids:
                        raise self._refuse(f"calls {_what_object(func)} (REDUCE)")
                    if type(args) is not tuple:
                        raise malformed("REDUCE's arguments are not a tuple")
                    acell[1] = fcell[1] = True
                    depth = 1 + max(acell[0], fcell[0])
                    if depth > too_deep:
                        raise self._too_deep()
                    stack.append(func(*args))
                    cells.append([depth, False])
                elif op == 0x4E:  # NONE
                    stack.append(None)
                    cells.append(atom)
                elif op == 0x88 or op == 0x89:  # NEWTRUE, NEWFALSE
                    stack.append(op == 0x88)
                    cells.append(atom)
                else:
                    i = self._rare(op, i, stack, cells, marks, memo, memo_cells)
                    if i < 0:
                        if len(stack) != 1 or marks:
                            raise malformed("STOP with other than one object left")
                        return stack[0]
        except (_Truncated, IndexError, struct.error):
            raise pickle.UnpicklingError("the pickle ends before its STOP, or pops from an empty stack") from None
        except KeyError as err:
            raise pickle.UnpicklingError(f"gets memo entry {err}, which it never put") from None

    def _deepen(self, cell: list[Any], *children: list[Any]) -> None:
        """Mark ``children`` placed inside the object of ``cell`` and deepen it (refused when
        it was itself placed inside another already, or grows too deep)."""
        depth = 0
        for child in children:
            child[1] = True
            if child[0] > depth:
                depth = child[0]
        depth += 1
        if depth > cell[0]:
            if cell[1]:
                raise RefusedCheckpointData(self.file, "changes an object after placing it inside another (a "
                                                       "cycle, which a checkpoint never holds)", self.file)
            if depth > MAX_DEPTH:
                raise self._too_deep()
            cell[0] = depth

    def _rare(self, op: int, i: int, stack: list[Any], cells: list[list[Any]], marks: list[int],
              memo: dict[int, Any], memo_cells: dict[int, list[Any]]) -> int:
        """The opcodes DCP's metadata rarely or never uses; the next position (-1: STOP)."""
        data, file, end = self.data, self.file, len(self.data)
        unpack_from = struct.unpack_from
        malformed = pickle.UnpicklingError

        def take(n: int) -> bytes:
            nonlocal i
            if n < 0 or i + n > end:
                raise _Truncated()
            i += n
            return data[i - n:i]

        def line() -> bytes:
            nonlocal i
            nl = data.find(b"\n", i)
            if nl < 0:
                raise _Truncated()
            text, i = data[i:nl], nl + 1
            return text

        def pop1() -> tuple[Any, list[Any]]:
            if len(stack) <= (marks[-1] if marks else 0):
                raise malformed("pops past a mark or an empty stack")
            return stack.pop(), cells.pop()

        def pop_mark() -> tuple[list[Any], list[list[Any]]]:
            if not marks:
                raise malformed("no mark to pop to")
            k = marks.pop()
            items, its = stack[k:], cells[k:]
            del stack[k:], cells[k:]
            return items, its

        def push(obj: Any, its: list[list[Any]]) -> None:
            depth = 1
            for cell in its:
                cell[1] = True
                depth = max(depth, cell[0] + 1)
            if depth > MAX_DEPTH:
                raise self._too_deep()
            stack.append(obj)
            cells.append([depth, False])

        def atom(obj: Any) -> None:
            stack.append(obj)
            cells.append([0, True])

        if op == 0x2E:  # STOP
            return -1
        if op == 0x80:  # PROTO
            take(1)
        elif op == 0x95:  # FRAME (a length hint: the bytes are all here)
            take(8)
        elif op == 0x93 or op == 0x63:  # STACK_GLOBAL, GLOBAL
            if op == 0x93:
                name, _ = pop1()
                module, _ = pop1()
                if type(name) is not str or type(module) is not str:
                    raise malformed("STACK_GLOBAL with a name that is not a str")
            else:
                module, name = str(line(), "utf-8"), str(line(), "utf-8")
            atom(self.find_class(module, name))
        elif op == 0x8A or op == 0x8B:  # LONG1, LONG4
            n = take(1)[0] if op == 0x8A else unpack_from("<i", take(4))[0]
            atom(int.from_bytes(take(n), "little", signed=True))
        elif op == 0x47:  # BINFLOAT
            atom(unpack_from(">d", take(8))[0])
        elif op == 0x58 or op == 0x8D:  # BINUNICODE, BINUNICODE8
            n = unpack_from("<I", take(4))[0] if op == 0x58 else unpack_from("<Q", take(8))[0]
            atom(str(take(n), "utf-8", "surrogatepass"))
        elif op in (0x43, 0x42, 0x8E, 0x96):  # SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8
            n = take(1)[0] if op == 0x43 else unpack_from("<I" if op == 0x42 else "<Q", take(4 if op == 0x42 else 8))[0]
            raw = take(n)
            atom(bytearray(raw) if op == 0x96 else raw)
        elif op == 0x55 or op == 0x54:  # SHORT_BINSTRING, BINSTRING (protocol 2's str)
            n = take(1)[0] if op == 0x55 else unpack_from("<i", take(4))[0]
            atom(str(take(n), "ascii"))
        elif op == 0x74 or op == 0x6C or op == 0x91:  # TUPLE, LIST, FROZENSET
            items, its = pop_mark()
            push(tuple(items) if op == 0x74 else items if op == 0x6C else frozenset(items), its)
        elif op == 0x64:  # DICT
            items, its = pop_mark()
            if len(items) % 2:
                raise malformed("DICT of an odd number of items")
            push({items[k]: items[k + 1] for k in range(0, len(items), 2)}, its)
        elif op == 0x73 or op == 0x61:  # SETITEM, APPEND
            value, vcell = pop1()
            key, kcell = pop1() if op == 0x73 else (None, [0, True])
            if len(stack) <= (marks[-1] if marks else 0):
                raise malformed("adds an item to nothing")
            obj = stack[-1]
            if type(obj) not in ((dict, OrderedDict) if op == 0x73 else (list,)):
                raise self._refuse(f"adds items ({'SETITEM' if op == 0x73 else 'APPEND'}) to {_what_object(obj)}")
            self._deepen(cells[-1], kcell, vcell)
            if op == 0x73:
                obj[key] = value
            else:
                obj.append(value)
        elif op == 0x92:  # NEWOBJ_EX
            kwargs, kcell = pop1()
            args, acell = pop1()
            cls, ccell = pop1()
            if (id(cls) not in _ALLOWED_IDS or not isinstance(cls, type) or type(args) is not tuple
                    or type(kwargs) is not dict):
                raise self._refuse(f"creates {_what_object(cls)} (NEWOBJ_EX)")
            push(cls.__new__(cls, *args, **kwargs), [kcell, acell, ccell])
        elif op == 0x30:  # POP
            if marks and len(stack) == marks[-1]:
                marks.pop()
            else:
                pop1()
        elif op == 0x31:  # POP_MARK
            pop_mark()
        elif op == 0x32:  # DUP
            if len(stack) <= (marks[-1] if marks else 0):
                raise malformed("DUP of nothing")
            stack.append(stack[-1])
            cells.append(cells[-1])
        elif op in (0x71, 0x72, 0x70):  # BINPUT, LONG_BINPUT, PUT
            n = take(1)[0] if op == 0x71 else unpack_from("<I", take(4))[0] if op == 0x72 else int(line())
            memo[n] = stack[-1]  # (IndexError on an empty stack)
            memo_cells[n] = cells[-1]
        elif op == 0x67:  # GET (text index)
            n = int(line())
            stack.append(memo[n])
            cells.append(memo_cells[n])
        elif op in (0x50, 0x51):  # PERSID, BINPERSID
            raise RefusedCheckpointData(file, "holds a persistent id, which DCP's metadata never does", file)
        else:
            shown = pickletools.code2op.get(chr(op))
            raise RefusedCheckpointData(file, f"uses the pickle opcode {shown.name if shown else hex(op)}, "
                                              "which DCP's metadata never does", file)
        return i


def _is_int(value: Any, minimum: int | None = 0) -> bool:
    return type(value) is int and (minimum is None or value >= minimum)


def _is_size(value: Any) -> bool:
    return type(value) in (torch.Size, tuple, list) and all(_is_int(v) for v in value)


def check_metadata(metadata: Any, file: str) -> Metadata:
    """``metadata`` if it is DCP's ``Metadata`` with every field of the type DCP writes; else
    :class:`RefusedCheckpointData` naming the first field that is not. Every storage entry
    names a shard file by a ``str`` plain file name (:func:`~torchtitan_spmd._safe_files.name_problem`):
    a ``pathlib`` path, a ``..`` or an absolute path is refused."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    def bad(what: str) -> RefusedCheckpointData:
        return RefusedCheckpointData(file, f"is not DCP metadata: {what}", file)

    if type(metadata) is not Metadata:
        raise bad(f"it holds a {type(metadata).__name__}, not a Metadata")
    entries = getattr(metadata, "state_dict_metadata", None)
    if type(entries) not in (dict, OrderedDict):
        raise bad("its state_dict_metadata is not a dict")
    for key, entry in entries.items():
        if type(key) is not str:
            raise bad(f"a key of its state_dict_metadata is a {type(key).__name__}, not a str")
        if type(entry) is TensorStorageMetadata:
            props, size, chunks = (getattr(entry, n, None) for n in ("properties", "size", "chunks"))
            if type(props) is not TensorProperties or not isinstance(getattr(props, "dtype", None), torch.dtype):
                raise bad(f"the tensor {key!r} has no dtype")
            if not _is_size(size) or type(chunks) is not list:
                raise bad(f"the tensor {key!r} has no size or chunk list")
            for chunk in chunks:
                offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
                if (type(chunk) is not ChunkStorageMetadata or not _is_size(offsets) or not _is_size(sizes)
                        or len(offsets) != len(size) or len(sizes) != len(size)
                        or any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True))):
                    raise bad(f"a chunk of the tensor {key!r} is not a chunk of its shape {tuple(size)}")
        elif type(entry) is not BytesStorageMetadata:
            raise bad(f"the entry {key!r} is a {type(entry).__name__}")
    storage = getattr(metadata, "storage_data", None)
    if storage is not None:
        if type(storage) not in (dict, OrderedDict):
            raise bad("its storage_data is not a dict")
        for index, info in storage.items():
            fqn = getattr(index, "fqn", None)
            if (type(index) is not MetadataIndex or type(fqn) is not str
                    or not (index.offset is None or _is_size(index.offset))
                    or not (index.index is None or _is_int(index.index))):
                raise bad(f"a storage key is a {type(index).__name__}, not a MetadataIndex")
            if type(info) is not _StorageInfo:
                raise bad(f"the item {fqn!r} is stored as a {type(info).__name__}")
            relative = getattr(info, "relative_path", None)
            problem = name_problem(relative)
            if problem is not None:
                if type(relative) is str:
                    raise bad(f"the item {fqn!r} is stored in {relative!r}, outside the checkpoint's folder")
                raise bad(f"the item {fqn!r} is stored in a {type(relative).__name__} (which can print as any "
                          "path), not the str name of a file of the checkpoint's folder")
            if not _is_int(getattr(info, "offset", None)) or not _is_int(getattr(info, "length", None)):
                raise bad(f"the item {fqn!r} has no whole, non-negative offset and length")
            transforms = getattr(info, "transform_descriptors", None)
            if transforms is not None and (type(transforms) not in (list, tuple)
                                           or not all(type(t) is str for t in transforms)):
                raise bad(f"the item {fqn!r} has transforms that are not a list of names")
    planner = getattr(metadata, "planner_data", None)
    if planner is not None and type(planner) not in (dict, OrderedDict):
        raise bad("its planner_data is not a dict")
    for value in (planner or {}).values():
        if type(value) not in (tuple, list) or not all(type(v) in (str, int) for v in value):
            raise bad("its planner_data holds something other than key paths")
    meta = getattr(metadata, "storage_meta", None)
    if meta is not None and type(meta) is not StorageMeta:
        raise bad(f"its storage_meta is a {type(meta).__name__}")
    version = getattr(metadata, "version", None)
    if version is not None and type(version) is not str:
        raise bad("its version is not a str")
    return metadata


_check_shape = check_metadata  # the name of the first round


def read_metadata_bytes(data: bytes | IO[bytes], file: str = ".metadata", *, trust: bool = False) -> Metadata:
    """DCP's ``Metadata`` from the bytes (or stream) of ``file``, bounded by
    :func:`check_pickle_bounds`, read by :class:`MetadataUnpickler` and checked by
    :func:`check_metadata` (``trust``: plain ``pickle``, which runs whatever the file names)."""
    if not isinstance(data, (bytes, bytearray)):
        data = data.read()
    if trust:  # bounded first: plain pickle crashes on a deep enough dict key
        check_pickle_bounds(data, file, file, kind="DCP metadata")
        return pickle.loads(data)  # noqa: S301 - the user said they trust the folder
    try:
        metadata = MetadataUnpickler(data, file).load()
    except RefusedCheckpointData:
        raise
    except RecursionError:
        raise RefusedCheckpointData(file, "cannot be read as DCP metadata (RecursionError)", file) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            OverflowError, RuntimeError, MemoryError) as err:
        line = " ".join(f"{type(err).__name__}: {err}".split())[:200]
        raise RefusedCheckpointData(file, f"cannot be read as DCP metadata ({line})", file) from None
    return check_metadata(metadata, file)


# ============================================================================ items
class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of the open file ``f`` as a seekable stream (DCP's
    own view mis-seeks from the end, which a zip reader does)."""

    def __init__(self, f: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        if base + pos < 0:
            raise OSError(22, "seek before the start of the item")
        self.pos = base + pos
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        if n == 0:
            return 0
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(b)[:n]) or 0
        self.pos += got
        return got


def check_torch_item(stream: IO[bytes], where: str, file: str = "") -> None:
    """Refuse an item that is not ``torch.save``'s zip format (DCP writes no other; the legacy
    format's several pickles are not checked here), or whose ``data.pkl`` (as torch's own zip
    reader finds it) fails :func:`check_pickle_bounds`. ``stream`` is left at its start."""
    start = stream.tell()
    if stream.read(4) != b"PK\x03\x04":
        stream.seek(start)
        raise RefusedCheckpointData(where, "is not in torch.save's zip format, the only one DCP writes", file)
    stream.seek(start)
    try:
        reader = torch._C.PyTorchFileReader(stream)  # noqa: SLF001 - torch.load's own reader
        data = reader.get_record("data.pkl")
    except (RuntimeError, ValueError, OSError) as err:
        stream.seek(start)
        line = " ".join(str(err).split())[:160]
        raise RefusedCheckpointData(where, f"cannot be read as a torch.save zip ({line})", file) from None
    stream.seek(start)
    check_pickle_bounds(data, where, file)


_MISSING = object()


def _kind_problem(template: Any, value: Any, depth: int = 0) -> str | None:
    """Why ``value`` (an item read) cannot stand where ``template`` (the value it replaces)
    stands: None when it is of the same kind (numbers for numbers, finite; a string for a
    string; a list or tuple of the same length; a dict of the same keys; ... element by
    element). A ``None`` template takes anything."""
    if template is None or depth > MAX_DEPTH:
        return None
    if isinstance(template, bool):
        return None if isinstance(value, bool) else f"a {type(value).__name__} where a bool belongs"
    if isinstance(template, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"a {type(value).__name__} where a number belongs"
        if isinstance(value, float) and not math.isfinite(value):
            return f"the number {value}, which is not finite"
        return None
    if isinstance(template, str):
        return None if isinstance(value, str) else f"a {type(value).__name__} where a string belongs"
    if isinstance(template, torch.Tensor):
        return None if isinstance(value, torch.Tensor) else f"a {type(value).__name__} where a tensor belongs"
    if isinstance(template, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(template):
            shown = f"{len(value)} items" if isinstance(value, (list, tuple)) else f"a {type(value).__name__}"
            return f"{shown} where a list of {len(template)} belongs"
        for t, v in zip(template, value, strict=True):
            problem = _kind_problem(t, v, depth + 1)
            if problem is not None:
                return problem
        return None
    if isinstance(template, Mapping):
        if not isinstance(value, Mapping):
            return f"a {type(value).__name__} where a dict belongs"
        if set(value) != set(template):
            missing, extra = sorted(map(str, set(template) - set(value))), sorted(map(str, set(value) - set(template)))
            return (f"a dict with keys {extra[:3]} it should not have" if extra
                    else f"a dict lacking the keys {missing[:3]}")
        for k, t in template.items():
            problem = _kind_problem(t, value[k], depth + 1)
            if problem is not None:
                return f"{problem} (at {k!r})"
        return None
    return None if type(value) is type(template) else f"a {type(value).__name__} where a {type(template).__name__} belongs"


class RestrictedReader(FileSystemReader):
    """DCP's file-system reader that runs no code from the folder and reads nothing outside it.

    ``.metadata`` and every shard file are opened by
    :func:`~torchtitan_spmd._safe_files.open_inside`; ``.metadata`` is read by
    :func:`read_metadata_bytes`; each item's offset and length must lie inside its opened
    file; a tensor item's ``data.pkl`` is bounded (:func:`check_torch_item`) before
    ``torch.load(weights_only=True)`` reads it (DCP's own call).

    Args:
        path: the checkpoint folder.
        trust_folder: read ``.metadata`` with plain ``pickle`` (``checkpoint.trust_checkpoint_folder``).
    """

    def __init__(self, path: str | os.PathLike[str], *, trust_folder: bool = False, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.trust_folder = trust_folder

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:  # noqa: D102 - FileSystemReader's
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        data = read_inside(str(self.path), name, MAX_METADATA_BYTES)
        metadata = read_metadata_bytes(data, name, trust=self.trust_folder)
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's own read_metadata
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Future[None]:  # noqa: D102 - FileSystemReader's
        from torch.distributed._shard._utils import narrow_tensor_by_index
        from torch.distributed.checkpoint.planner import LoadItemType

        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            relative = self.storage_data[item.storage_index].relative_path
            problem = name_problem(relative)
            if problem is not None:  # check_metadata refused it already; a caller's own storage_data
                raise UnsafeFile(str(self.path), "", f"names a shard file that {problem}")
            per_file.setdefault(relative, []).append(item)
        for relative, items in per_file.items():
            with open_inside(str(self.path), relative) as f:
                size = file_size(f)
                for item in items:
                    info = self.storage_data[item.storage_index]
                    where = f"the item {item.storage_index.fqn!r} in {relative}"
                    offset, length = info.offset, info.length
                    if not (_is_int(offset) and _is_int(length) and offset + length <= size):
                        raise RefusedCheckpointData(where, f"lies at bytes {offset}..{offset}+{length} of a file of "
                                                           f"{size} bytes", relative)
                    if info.transform_descriptors and not self.trust_folder:
                        raise RefusedCheckpointData(where, f"is stored with the transforms {info.transform_descriptors} "
                                                           "(DCP's experimental compression, whose output no size "
                                                           "bounds), which this library does not read from a folder "
                                                           "it does not trust", relative)
                    stream: IO[bytes] = _Window(f, offset, length)  # type: ignore[assignment]
                    if info.transform_descriptors:
                        stream = self.transforms.transform_load_stream(item, info.transform_descriptors, stream)
                        stream = io.BytesIO(stream.read())
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, io.BytesIO(stream.read()))
                        continue
                    check_torch_item(stream, where, relative)
                    tensor = torch.load(stream, map_location="cpu", weights_only=True)
                    if not isinstance(tensor, torch.Tensor):
                        raise RefusedCheckpointData(where, f"holds a {type(tensor).__name__}, not a tensor", relative)
                    tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != tensor.size():
                        raise RefusedCheckpointData(where, f"has shape {tuple(tensor.size())}, not "
                                                           f"{tuple(target.size())}", relative)
                    target.copy_(tensor)
                    planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future


class RestrictedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner reading non-tensor items with ``torch.load(weights_only=True)``,
    each bounded (:func:`check_torch_item`) and of the kind of the value it replaces.

    Args:
        trust_folder: DCP's ``weights_only=False`` (``checkpoint.trust_checkpoint_folder``).
    """

    def __init__(self, *args: Any, trust_folder: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trust_folder = trust_folder

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:  # noqa: D102 - DefaultLoadPlanner's
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        where = f"the item {fqn!r}"
        check_torch_item(value, where)
        try:
            obj = torch.load(value, weights_only=not self.trust_folder)
        except pickle.UnpicklingError as err:
            raise _refused_item(fqn, err) from None
        except RecursionError:
            raise RefusedCheckpointData(where, "cannot be read (RecursionError)", "") from None
        if not self.trust_folder:
            template = (self.state_dict or {}).get(fqn, _MISSING)
            problem = None if template is _MISSING else _kind_problem(template, obj)
            if problem is not None:
                raise RefusedCheckpointData(where, f"holds {problem}", "")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _refused_item(fqn: str, err: BaseException) -> RefusedCheckpointData:
    """torch's weights-only refusal of item ``fqn`` as :class:`RefusedCheckpointData` naming the global."""
    import re

    text = str(err)
    # torch's wording: "Unsupported global: GLOBAL m.n was not an allowed global by default",
    # "Trying to load unsupported GLOBAL m.n whose module m is blocked"
    found = re.search(r"GLOBAL ([A-Za-z_][\w.]*)", text)
    where = f"the item {fqn!r}"
    if found:
        return _refusal("", where, found.group(1))
    line = " ".join(text.split())[:200]
    return RefusedCheckpointData(where, f"cannot be read with torch.load(weights_only=True): {line}", "")
