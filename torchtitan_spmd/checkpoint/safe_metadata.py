"""Reading a DCP checkpoint without running its author's code.

DCP's ``FileSystemReader.read_metadata`` reads ``.metadata`` with ``pickle.load``, and its
``DefaultLoadPlanner.load_bytes`` reads every non-tensor item (the step count, the
scheduler's and data loader's state, the optimizer's hyperparameters) with
``torch.load(weights_only=False)``: a checkpoint folder can run any code on the machine that
loads it, before a single check. The per-file checksums (:mod:`.integrity`) do not help: the
record of them sits in the same folder, so whoever wrote the folder wrote the record.

This module closes both:

- :class:`RestrictedReader` (DCP's ``FileSystemReader``) reads ``.metadata`` with
  :class:`MetadataUnpickler`, which resolves only the globals of :data:`ALLOWED_GLOBALS`
  (what DCP's metadata consists of; anything else is refused *before* it is resolved, so
  nothing it names is imported or called), then checks the result's shape: a
  ``Metadata`` whose every storage entry names a plain file inside the folder.
- :class:`RestrictedLoadPlanner` (DCP's ``DefaultLoadPlanner``) reads the non-tensor items
  with ``torch.load(weights_only=True)``, torch's own restricted unpickler. (Tensors were
  already read that way by DCP.)

A refusal raises :class:`RefusedCheckpointData` naming the file and the global; the manager
turns it into one line, ``checkpoint step-N: .metadata refers to os.system, which a
checkpoint may not load (<file>)``.

``checkpoint.trust_checkpoint_folder`` turns both off (plain ``pickle`` and
``weights_only=False``, DCP's own behaviour) for metadata the allow-list misses, e.g. a
newer torch's class; the caller warns, naming the folder.

Hand-rolled because torch has no restricted reader for DCP's metadata (``weights_only``
covers ``torch.load`` only, and its allow-list lacks DCP's classes); ``pickle.Unpickler``'s
``find_class`` hook does the restricting.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "ALLOWED_GLOBALS",
    "MetadataUnpickler",
    "RefusedCheckpointData",
    "RestrictedLoadPlanner",
    "RestrictedReader",
    "allowed_objects",
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

_OBJECTS: dict[tuple[str, str], Any] = {}


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
    return _OBJECTS


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


def _refusal(file: str, where: str, refused: str) -> RefusedCheckpointData:
    hint = ""
    if refused.split(".", 1)[0] == "torch":  # likely a newer torch's class the allow-list lacks
        hint = ("; if a newer torch wrote it and you trust whoever wrote the folder, "
                "--checkpoint.trust_checkpoint_folder loads it")
    return RefusedCheckpointData(where, f"refers to {refused}, which a checkpoint may not load{hint}", file, refused)


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` resolving only :func:`allowed_objects`; any other global raises
    :class:`RefusedCheckpointData` before it is imported or called."""

    def __init__(self, stream: IO[bytes], file: str = ".metadata") -> None:
        super().__init__(stream)
        self.file = file

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102 - pickle.Unpickler's
        found = allowed_objects().get((module, name))
        if found is None:
            raise _refusal(self.file, self.file, f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:  # noqa: D102 - pickle.Unpickler's
        raise RefusedCheckpointData(self.file, "holds a persistent id, which DCP's metadata never does", self.file)


def _check_shape(metadata: Any, file: str) -> Metadata:
    """``metadata`` if it is DCP's ``Metadata`` whose storage entries name plain files of the folder."""
    def bad(what: str) -> RefusedCheckpointData:
        return RefusedCheckpointData(file, f"is not DCP metadata: {what}", file)

    if not isinstance(metadata, Metadata):
        raise bad(f"it holds a {type(metadata).__name__}, not a Metadata")
    if not isinstance(metadata.state_dict_metadata, Mapping):
        raise bad("its state_dict_metadata is not a mapping")
    storage = metadata.storage_data
    if isinstance(storage, Mapping):
        for index, info in storage.items():
            relative = getattr(info, "relative_path", None)
            if relative is None:
                continue
            relative = str(relative)
            if (not relative or os.path.isabs(relative) or os.sep in relative or "/" in relative
                    or relative in (".", "..")):
                raise bad(f"the item {getattr(index, 'fqn', index)!r} is stored in {relative!r}, "
                          "outside the checkpoint's folder")
    return metadata


def read_metadata_bytes(data: bytes | IO[bytes], file: str = ".metadata", *, trust: bool = False) -> Metadata:
    """DCP's ``Metadata`` from the bytes (or stream) of ``file``, read by :class:`MetadataUnpickler`
    (``trust``: plain ``pickle``, which runs whatever the file names)."""
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    if trust:
        return pickle.load(stream)  # noqa: S301 - the user said they trust the folder
    try:
        metadata = MetadataUnpickler(stream, file).load()
    except RefusedCheckpointData:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as err:
        line = " ".join(f"{type(err).__name__}: {err}".split())[:200]
        raise RefusedCheckpointData(file, f"cannot be read as DCP metadata ({line})", file) from None
    return _check_shape(metadata, file)


class RestrictedReader(FileSystemReader):
    """DCP's file-system reader whose ``read_metadata`` runs no code from the folder.

    Args:
        path: the checkpoint folder.
        trust_folder: read with plain ``pickle`` (``checkpoint.trust_checkpoint_folder``).
    """

    def __init__(self, path: str | os.PathLike[str], *, trust_folder: bool = False, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.trust_folder = trust_folder

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:  # noqa: D102 - FileSystemReader's
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_metadata_bytes(stream.read(), name, trust=self.trust_folder)
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's own read_metadata
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class RestrictedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner reading non-tensor items with ``torch.load(weights_only=True)``.

    Args:
        trust_folder: DCP's ``weights_only=False`` (``checkpoint.trust_checkpoint_folder``).
    """

    def __init__(self, *args: Any, trust_folder: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trust_folder = trust_folder

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:  # noqa: D102 - DefaultLoadPlanner's
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=not self.trust_folder)
        except pickle.UnpicklingError as err:
            raise _refused_item(fqn, err) from None
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
