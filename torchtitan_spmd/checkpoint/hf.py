"""Technique: Hugging Face safetensors weights in and out, sharded, through DCP's HF storage classes.

- **In** (``checkpoint.initial_load_in_hf``): a transformers ``save_pretrained`` folder (one
  ``*.safetensors`` file, or several with ``model.safetensors.index.json``) is read with
  :class:`torch.distributed.checkpoint.HuggingFaceStorageReader` straight into the model's
  state dict of global-shape DTensors (the checkpoint technique's views, so every backend
  and layout): each rank reads only its shard of every tensor.
- **Out** (``checkpoint.last_save_in_hf``): the last, model-only save is written with
  :class:`~torch.distributed.checkpoint.HuggingFaceStorageWriter` (every rank its shards,
  then consolidated by DCP into full tensors, one file or the source's files), at
  ``checkpoint.export_dtype``, with a ``config.json`` and ``model.safetensors.index.json``,
  so ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` opens it as it is. The
  folder is ``step-N`` with the usual completion marker (flagged ``hf_export``: skipped when
  looking for a checkpoint to resume from).

Names, row orders and ``config.json`` come from the family's adapter
(:mod:`torchtitan_spmd.models.state_dict_adapter`). A tensor whose rows transformers orders
differently (llama3's Q/K) cannot be read as a DTensor: a rank's contiguous rows are
scattered rows of the transformers tensor. It is read as DCP's ``CheckpointableTensor``
(torch >= 2.14): one local buffer of this rank's rows in the transformers order, described
as the runs of contiguous transformers rows it holds, so DCP reads exactly those rows and
no rank holds a full copy. (Hand-rolled because upstream permutes with DTensor views, which
replicate a tensor whose heads are split across ranks.) To be written it is redistributed
to a column-sharded DTensor (each rank all rows of its columns, permuted locally): DCP's
HF writer keeps one chunk per tensor and rank in its shard files.

Needs ``safetensors`` (``pip install -e ".[hf]"``), imported on first use.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from torchtitan_spmd._errors import MissingExtraError
from torchtitan_spmd._safe_files import UnsafeFile, list_inside, open_inside
from torchtitan_spmd.models.hf_config import _CONFIG, require_safetensors

from .safe_metadata import RestrictedLoadPlanner

if TYPE_CHECKING:
    from torchtitan_spmd.models.state_dict_adapter import StateDictAdapter

__all__ = [
    "MissingExtraError",
    "load_hf",
    "safe_reader_class",
    "save_hf",
]

_INDEX = "model.safetensors.index.json"
_SUFFIX = ".safetensors"

logger = logging.getLogger("torchtitan_spmd")


# ====================================================================================== shards
def _local_box(value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]] | None:
    """(this rank's local tensor, its global offsets, its sizes), or None off the mesh."""
    if isinstance(value, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if value.device_mesh.get_coordinate() is None:
            return None
        sizes, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return value.to_local(), tuple(offsets), tuple(sizes)
    return value, (0,) * value.dim(), tuple(value.shape)


class _RowRuns:
    """This rank's rows of a tensor whose HF row order is ``our_rows[idx]``, to be read as DCP's
    ``CheckpointableTensor``: :meth:`buffer` holds them in HF order, one shard per run of
    contiguous HF rows. ``order[j]`` is the local row at buffer row ``j``."""

    def __init__(self, local: torch.Tensor, offsets: tuple[int, ...], global_shape: tuple[int, ...],
                 idx: torch.Tensor) -> None:
        self.local = local
        n_rows = local.shape[0]
        hf_row_of_ours = torch.argsort(idx)  # our global row r is HF row hf_row_of_ours[r]
        hf_rows = hf_row_of_ours[offsets[0]:offsets[0] + n_rows]
        self.order = torch.argsort(hf_rows)
        sorted_rows = hf_rows[self.order].tolist()
        starts = [j for j in range(n_rows) if j == 0 or sorted_rows[j] != sorted_rows[j - 1] + 1]
        ends = [*starts[1:], n_rows]
        rest = tuple(offsets[1:])
        self.global_shape = global_shape
        self.global_offsets = tuple((sorted_rows[s], *rest) for s in starts)
        self.local_offsets = tuple((s,) + (0,) * len(rest) for s in starts)
        self.local_sizes = tuple((e - s, *local.shape[1:]) for s, e in zip(starts, ends, strict=True))

    def buffer(self) -> torch.Tensor:
        """A fresh buffer to read into, carrying the chunk description."""
        buf = torch.empty(self.local.shape, dtype=self.local.dtype, device=self.local.device)
        for name in ("global_shape", "global_offsets", "local_offsets", "local_sizes"):
            setattr(buf, name, getattr(self, name))
        return buf

    def scatter_back(self, buf: torch.Tensor) -> None:
        """Copy a loaded buffer into the local rows."""
        self.local.index_copy_(0, self.order.to(self.local.device), buf.to(self.local.dtype))


class _GroupSlices:
    """This rank's part of a grouped tensor ``[G, ...]`` (an MoE layer's experts) whose slices
    ``tensor[g]`` are separate transformers tensors: one buffer per slice this rank holds (its
    rows and columns of that slice, DCP's ``CheckpointableTensor`` description), copied back
    after the read. A rank holding no slice of a group reads nothing of it."""

    def __init__(self, local: torch.Tensor, offsets: tuple[int, ...], global_shape: tuple[int, ...],
                 keys: tuple[str, ...]) -> None:
        self.local = local
        self.buffers: list[tuple[str, int, torch.Tensor]] = []
        for j in range(local.shape[0]):
            buf = torch.empty(local.shape[1:], dtype=local.dtype, device=local.device)
            buf.global_shape = tuple(global_shape[1:])  # type: ignore[attr-defined]
            buf.global_offsets = (tuple(offsets[1:]),)  # type: ignore[attr-defined]
            buf.local_offsets = ((0,) * (local.dim() - 1),)  # type: ignore[attr-defined]
            buf.local_sizes = (tuple(local.shape[1:]),)  # type: ignore[attr-defined]
            self.buffers.append((keys[offsets[0] + j], j, buf))

    def scatter_back(self) -> None:
        """Copy the loaded slices into the local tensor."""
        for _, j, buf in self.buffers:
            self.local[j].copy_(buf)


def _group_slices_by_columns(value: torch.Tensor, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Each slice ``value[g]`` under its name, to be written: a DTensor sharded on its last dim
    over every mesh axis (every rank holds all slices of a column range, one chunk per tensor
    and rank, as DCP's HF writer keeps them), or the plain slices of a plain tensor."""
    if not isinstance(value, DTensor):
        return dict(zip(keys, value.unbind(0), strict=True))
    from torch.distributed.tensor import Shard

    mesh, last = value.device_mesh, value.dim() - 1
    local = value.redistribute(mesh, [Shard(last)] * mesh.ndim).to_local()
    shape = value.shape[1:]
    stride = torch.empty(shape, device="meta").stride()
    return {key: DTensor.from_local(local[g], mesh, [Shard(last - 1)] * mesh.ndim, shape=shape, stride=stride)
            for g, key in enumerate(keys)}


def _hf_state(model_state: Mapping[str, Any], adapter: StateDictAdapter, *, fill: bool
              ) -> tuple[dict[str, Any], list[Callable[[], None]], set[str]]:
    """The HF-named state dict DCP reads into (``fill=False``) or writes from (``fill=True``),
    what to do after a read, and the HF names of every tensor of the model (a rank's dict may
    lack slices of a grouped tensor that it holds no part of).

    A tensor whose rows transformers orders differently goes, to be read, as this rank's
    :class:`_RowRuns` buffer; to be written, as a DTensor sharded on its columns over every
    mesh axis (every rank all the rows of a column slice, permuted locally): the HF writer
    keeps one chunk per tensor and rank in its shard files, so the runs cannot go as they are.
    A grouped tensor (:meth:`~torchtitan_spmd.models.state_dict_adapter.StateDictAdapter.hf_grouped_keys`)
    goes slice by slice: :class:`_GroupSlices` to be read, :func:`_group_slices_by_columns` to be written.
    """
    hf: dict[str, Any] = {}
    after: list[Callable[[], None]] = []
    names: set[str] = set()
    for fqn, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            continue
        grouped = adapter.hf_grouped_keys(fqn, value.shape[0])
        if grouped is not None:
            names.update(grouped)
            if fill:
                hf.update(_group_slices_by_columns(value, grouped))
                continue
            box = _local_box(value)
            if box is None:
                continue
            slices = _GroupSlices(box[0], box[1], tuple(value.shape), grouped)
            hf.update((key, buf) for key, _, buf in slices.buffers)
            after.append(slices.scatter_back)
            continue
        key = adapter.hf_key(fqn)
        if key is None:
            continue
        names.add(key)
        idx = adapter.hf_rows(fqn, value.shape[0])
        if idx is None:
            hf[key] = value
        elif fill:
            hf[key] = _rows_reordered_by_columns(value, idx)
        else:
            box = _local_box(value)
            if box is None:
                continue
            local, offsets, _ = box
            runs = _RowRuns(local, offsets, tuple(value.shape), idx)
            buf = runs.buffer()
            hf[key] = buf
            after.append(functools.partial(runs.scatter_back, buf))
    return hf, after, names


def _rows_reordered_by_columns(value: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``value[idx]`` (global rows), as a DTensor sharded on dim 1 over every mesh axis (or a
    plain tensor when ``value`` is one): no rank holds more than its share of the columns."""
    if not isinstance(value, DTensor):
        return value[idx.to(value.device)]
    from torch.distributed.tensor import Shard

    mesh = value.device_mesh
    by_columns = value.redistribute(mesh, [Shard(1)] * mesh.ndim)
    local = by_columns.to_local()
    return DTensor.from_local(local[idx.to(local.device)], mesh, by_columns.placements,
                              shape=value.shape, stride=value.stride())


def _folder_error(folder: str, hf_state: Mapping[str, Any], metadata: Mapping[str, Any],
                  names: set[str]) -> str | None:
    """The first tensor of this rank's part the folder lacks or has in another shape, or None."""
    for key, value in hf_state.items():
        saved = metadata.get(key)
        shape = tuple(getattr(value, "global_shape", None) or value.shape)
        if saved is None:
            return (f"Hugging Face folder {folder!r} has no tensor {key!r} "
                    f"(it holds {len(metadata)}, e.g. {sorted(metadata)[:3]}).")
        if tuple(saved.size) != shape:
            return (f"Hugging Face folder {folder!r}: {key!r} has shape {tuple(saved.size)} there "
                    f"and {shape} in this model.")
    missing = sorted(names - set(metadata))
    if missing:
        return (f"Hugging Face folder {folder!r} has no tensor {missing[0]!r} "
                f"(it holds {len(metadata)}, e.g. {sorted(metadata)[:3]}).")
    return None


def _check_folder(folder: str, hf_state: Mapping[str, Any], adapter: StateDictAdapter,
                  metadata: Mapping[str, Any], names: set[str]) -> None:
    """ValueError naming the first tensor the folder lacks, has in another shape, or has extra,
    raised alike on every rank.

    Under pipeline parallelism a rank's ``names`` are its stage's only: the ranks share what
    they hold (one object all-gather), so a tensor is extra when no stage holds it, and a
    rank's own error (its stage's tensor missing or of another shape) stops every rank, not
    only those of one stage while the others wait in DCP's read.
    """
    error = _folder_error(folder, hf_state, metadata, names)
    everyone: list[tuple[set[str], str | None]] = [(names, error)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [(set(), None)] * dist.get_world_size()
        dist.all_gather_object(everyone, (names, error))
    first = next((err for _, err in everyone if err is not None), None)
    if first is not None:
        raise ValueError(first)
    held = set().union(*(theirs for theirs, _ in everyone))
    extra = sorted(set(metadata) - held)
    if extra:
        raise ValueError(f"Hugging Face folder {folder!r} holds {extra[0]!r}, which this "
                         f"{adapter.model_type} model lacks ({len(extra)} such tensors).")


@functools.cache
def safe_reader_class() -> type:
    """:class:`~torch.distributed.checkpoint.HuggingFaceStorageReader` opening every file through
    :func:`~torchtitan_spmd._safe_files.open_inside` (a regular file of the folder, no link
    followed: a FIFO named ``*.safetensors`` is refused, not waited on), and checking the
    ``DCP_SHARDING_INFO`` JSON a file's header may carry (DCP's own reader indexes it
    unchecked: ``"{}"`` is a ``KeyError``). ``safetensors`` (Rust) parses each header and
    bounds every tensor by its file; it opens the already opened file (``/proc/self/fd``)."""
    from safetensors import safe_open
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    def opened(folder: str, name: str, raw: Any) -> Any:
        """``safe_open`` of the file ``raw`` (opened by ``open_inside``): through ``/proc/self/fd``,
        so the file checked is the file read (by its name where there is no ``/proc``)."""
        proc = f"/proc/self/fd/{raw.fileno()}"
        return safe_open(proc if os.path.exists(proc) else os.path.join(folder, name), framework="pt")

    class SafeHuggingFaceReader(HuggingFaceStorageReader):
        def read_metadata(self) -> Metadata:  # type: ignore[override]
            from safetensors.torch import _getdtype
            from torch.distributed.checkpoint._hf_utils import _HFStorageInfo

            folder = str(self.path)
            entries: dict[str, TensorStorageMetadata] = {}
            storage: dict[MetadataIndex, Any] = {}
            for name in (n for n in list_inside(folder) if n.endswith(_SUFFIX)):
                with open_inside(folder, name) as raw:
                    try:
                        with opened(folder, name, raw) as f:
                            keys = list(f.keys())
                            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
                            dtypes = {k: _getdtype(f.get_slice(k).get_dtype()) for k in keys}
                            extra = f.metadata() or {}
                    except Exception as err:  # noqa: BLE001 - safetensors' error types vary by version
                        raise UnsafeFile(folder, name, f"is not a safetensors file ({_line(err)})") from None
                offsets = _sharding_info(folder, name, extra.get(_SHARDING), shapes)
                for key in keys:
                    shape, offset = shapes[key], offsets.get(key, (0,) * len(shapes[key]))
                    chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(shape))
                    if key not in entries:
                        entries[key] = TensorStorageMetadata(
                            properties=TensorProperties(dtype=dtypes[key]),
                            size=torch.Size([s + o for s, o in zip(shape, offset, strict=True)]), chunks=[chunk])
                    else:
                        size = entries[key].size
                        if len(size) != len(shape):
                            raise UnsafeFile(folder, name, f"holds {key!r} with {len(shape)} dimensions, another "
                                                           f"file with {len(size)}")
                        entries[key].chunks.append(chunk)
                        entries[key].size = torch.Size([max(n, s + o) for n, s, o in zip(size, shape, offset,
                                                                                          strict=True)])
                    storage[MetadataIndex(fqn=key, offset=list(offset))] = _HFStorageInfo(
                        relative_path=name, shape=torch.Size(shape), dtype=dtypes[key])
            metadata = Metadata(state_dict_metadata=entries, storage_data=storage)  # type: ignore[arg-type]
            metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:  # noqa: D102 - HuggingFaceStorageReader's
            from torch.futures import Future

            folder = str(self.path)
            per_file: dict[str, list[Any]] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for name, items in per_file.items():
                with open_inside(folder, name) as raw, opened(folder, name, raw) as f:
                    for item in items:
                        self._process_read_request(f, item, planner)
            future: Future[None] = Future()
            future.set_result(None)
            return future

    return SafeHuggingFaceReader


_SHARDING = "DCP_SHARDING_INFO"


def _line(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())[:200]


def _sharding_info(folder: str, name: str, text: Any, shapes: Mapping[str, tuple[int, ...]]
                   ) -> dict[str, tuple[int, ...]]:
    """The offsets per tensor that a file's ``DCP_SHARDING_INFO`` (DCP's sharded HF save)
    records, checked: a JSON object with an entry of ``saved_offsets`` (whole numbers, one
    per dimension) for every tensor of the file. None recorded: ``{}``."""
    if not text:
        return {}
    def bad(what: str) -> UnsafeFile:
        return UnsafeFile(folder, name, f"has a {_SHARDING} header entry that {what}")

    try:
        info = json.loads(text) if isinstance(text, str) else None
    except RecursionError:
        raise bad("nests too deep (RecursionError)") from None
    except ValueError as err:
        raise bad(f"is not valid JSON ({_line(err)})") from None
    if not isinstance(info, dict):
        raise bad(f"is a JSON {type(info).__name__}, not an object of tensors")
    out: dict[str, tuple[int, ...]] = {}
    for key, shape in shapes.items():
        entry = info.get(key)
        offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != len(shape)
                or not all(type(o) is int and o >= 0 for o in offsets)):
            raise bad(f"has no saved_offsets for {key!r} (whole numbers, one per dimension of {shape})")
        out[key] = tuple(offsets)
    return out


@torch.no_grad()
def load_hf(model_state: dict[str, Any], folder: str, adapter: StateDictAdapter) -> None:
    """Fill ``model_state`` (our names; DTensors of global shape or full tensors) from the HF
    safetensors in ``folder``, each rank reading only its shards (every file through
    :func:`~torchtitan_spmd._safe_files.open_inside`)."""
    require_safetensors()
    if not os.path.isdir(folder) or not any(n.endswith(_SUFFIX) for n in list_inside(folder)):
        what = "does not exist" if not os.path.exists(folder) else (
            "is not a folder" if not os.path.isdir(folder) else
            f"has no {_SUFFIX} file (contents: {list_inside(folder)[:8]})")
        raise ValueError(f"checkpoint.initial_load_path={folder!r} is not a Hugging Face checkpoint: it {what}.")
    hf_state, after, names = _hf_state(model_state, adapter, fill=False)
    reader_class = safe_reader_class()
    _check_folder(folder, hf_state, adapter, reader_class(folder).read_metadata().state_dict_metadata, names)
    # the safetensors headers are JSON (no pickle); the planner reads any non-tensor item with
    # torch.load(weights_only=True) (an HF folder holds none)
    dcp.load(hf_state, storage_reader=reader_class(folder), planner=RestrictedLoadPlanner())
    for fixup in after:
        fixup()


@torch.no_grad()
def save_hf(model_state: Mapping[str, Any], folder: str, adapter: StateDictAdapter, *, dtype: str) -> None:
    """Write ``model_state`` (already in ``dtype``) to ``folder`` as HF safetensors: every rank
    its shards, consolidated into full tensors by DCP, then ``config.json`` and the index."""
    require_safetensors()
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    hf_state, _, _ = _hf_state(model_state, adapter, fill=True)
    writer = HuggingFaceStorageWriter(path=folder, fqn_to_index_mapping=adapter.fqn_to_index_mapping,
                                      save_distributed=True, enable_consolidation=True)
    dcp.save(hf_state, storage_writer=writer)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if not distributed or dist.get_rank() == 0:
        shutil.rmtree(os.path.join(folder, "sharded"), ignore_errors=True)
        _write_index(folder)
        with open(os.path.join(folder, _CONFIG), "w") as f:
            json.dump(adapter.hf_config(dtype), f, indent=2, sort_keys=True)
        logger.info(f"checkpoint: wrote Hugging Face safetensors ({dtype}) with {_CONFIG} and {_INDEX}; "
                    f"transformers.AutoModelForCausalLM.from_pretrained opens the folder")
    if distributed:
        dist.barrier()


def _write_index(folder: str) -> None:
    """``model.safetensors.index.json`` (``weight_map``: tensor -> file) over the folder's files."""
    from safetensors import safe_open

    weight_map: dict[str, str] = {}
    total = 0
    for name in sorted(n for n in os.listdir(folder) if n.endswith(_SUFFIX)):
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = name
                t = f.get_slice(key)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * torch.tensor([], dtype=_dtype(t.get_dtype())).element_size()
    with open(os.path.join(folder, _INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


def _dtype(name: str) -> torch.dtype:
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}.get(
        name, torch.float32)
