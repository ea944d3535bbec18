"""Technique: checkpoints with ``torch.distributed.checkpoint`` (DCP), under every backend and layout.

:class:`CheckpointManager` follows torchtitan's ``CheckpointManager`` (a0c831c49): the
``[checkpoint]`` section's fields, folders ``step-N`` under
``job.dump_folder/checkpoint.folder``, the model's entries flattened at the top level
(so a model-only checkpoint and a full one hold the same model keys) beside
``optimizer``, ``lr_scheduler``, ``dataloader`` and ``train_state``; this library adds
``rng`` (the torch RNG state of rank 0, which every rank restores: the trainer seeds every
rank alike).

Layouts: every state goes to DCP as a DTensor of its *global* shape, so DCP reshards
between any two layouts and backends. DTensor states (``default``'s TP and FSDP
parameters, ``full_dtensor``'s everything) go as they are; a plain local shard (the
``spmd_types`` backend without FSDP, and its optimizer states) goes as the
representation's :meth:`~torchtitan_spmd.distributed.representation.TensorRepresentation.to_dtensor`
view of it, which shares its storage, so a load fills it in place. (DCP cannot take the
plain shard itself: every rank would claim the same key with another size.)

Crash safety: a save writes ``step-N.partial``, then rank 0 writes the completion marker
(``.complete``, a small JSON record) into it and renames it to ``step-N`` (an atomic rename
on POSIX file systems). A checkpoint is loaded only from a ``step-N`` folder holding both
DCP's ``.metadata`` and the marker; a ``step-N.partial`` (a save killed midway) is ignored
with a warning, and a ``step-N`` without them newer than the newest complete one (damaged, or
copied in part) stops the start instead of loading an older one. ``keep_latest_k`` deletes
only complete checkpoints older than the newest ``k``, after the new one is complete, so it
never deletes the only one.

Integrity (:mod:`.checkpoint_integrity`): the marker records every file's size and crc32,
computed by the rank that wrote the file once DCP synced it; at load every rank verifies
its share before DCP reads anything, and a mismatch stops the start with one line naming
the checkpoint, the file, what differs and the newest checkpoint that verifies (with
``--checkpoint.load_step N``); nothing older is loaded unless asked for. A marker without
checksums (an older save) loads with a warning. DCP and torch errors at load become one
line, ``checkpoint step-N: <what> (<file>)``. A save that fails on any rank (disk full, I/O
error, no permission, read-only folder) raises :class:`CheckpointSaveError` on every rank,
naming the folder and the errno, with the ``.partial`` folder removed and the previous
checkpoint untouched.

Trust (:mod:`.safe_metadata`, ``docs/checkpoint-trust.md``): loading a folder someone else
wrote runs none of its code, reads nothing outside it, changes nothing in the process and cannot
crash or hang it. Every load (resume, ``load_step``, ``initial_load_path``, seed, PP, EP) opens
each file through ``_safe_files.open_inside`` (a regular file of the folder, no link followed),
reads DCP's ``.metadata`` with a restricted decoder and the non-tensor items with
``torch.load(weights_only=True)``, bounded and checked against the states they replace (the
learning-rate schedule's fields and the step at load, :class:`_Checked`); the marker is read
by ``read_json_inside`` and type-checked (:func:`marker_problem`). Anything refused stops the
start in one line, ``checkpoint step-N: .metadata refers to os.system, which a checkpoint may
not load (<file>)``. ``checkpoint.trust_checkpoint_folder`` unpickles as DCP does, with a
warning naming the folder.

Differences from torchtitan, each deliberate: a load finds "the latest *complete*
checkpoint" (torchtitan: the latest folder with a ``.metadata``); ``initial_load_path`` is
used when the run's folder holds no complete checkpoint (torchtitan: when the folder does
not exist); resuming from a model-only checkpoint other than step 0 (a final export,
``last_save_model_only``) is an error naming the newest full one, not a missing-key error
from DCP; the model's keys and shapes are checked against the checkpoint before loading;
``async_with_pinned_mem`` and quantized Hugging Face loads are not implemented (the trainer
rejects them at setup, ``config/support.py``). Hugging Face safetensors in and out
(``initial_load_in_hf``, ``last_save_in_hf``) are ``hf_checkpoint.py``'s, hooked in here.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from torchtitan_spmd._safe_files import UnsafeFile, read_json_inside
from torchtitan_spmd.config.support import check_supported
from torchtitan_spmd.distributed.apply_plan import plain_fqn
from torchtitan_spmd.distributed.representation import StateLayout, TensorRepresentation
from torchtitan_spmd.techniques import lora
from torchtitan_spmd.tools.lr_scheduler import lr_state_problem
from torchtitan_spmd.tools.optimizer import check_same_grouping, optimizers_of

from . import hf as hf_checkpoint
from . import integrity
from .integrity import CheckpointLoadError, CheckpointSaveError
from .safe_metadata import RefusedCheckpointData, RestrictedLoadPlanner

if TYPE_CHECKING:
    from torchtitan_spmd.config import CheckpointConfig
    from torchtitan_spmd.models.state_dict_adapter import StateDictAdapter

__all__ = [
    "COMPLETE_MARKER",
    "CheckpointLoadError",
    "CheckpointSaveError",
    "CheckpointInfo",
    "CheckpointManager",
    "LOADABLE_ENTRIES",
    "find_checkpoints",
    "purge_stale",
]

logger = logging.getLogger("torchtitan_spmd")

MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE, RNG = (
    "model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
#: The top-level entries besides the model's; each can be left out with ``exclude_from_loading``.
LOADABLE_ENTRIES: tuple[str, ...] = (OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE, RNG)
#: The file whose presence makes a ``step-N`` folder a complete checkpoint (JSON inside).
COMPLETE_MARKER = integrity.COMPLETE_NAME
_DCP_METADATA = ".metadata"
_PARTIAL = ".partial"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_PARTIAL_DIR = re.compile(r"^step-(\d+)" + re.escape(_PARTIAL) + "$")
#: Bump when the layout of the entries changes incompatibly.
FORMAT_VERSION = 1


# ====================================================================================== folders
@dataclass(frozen=True)
class CheckpointInfo:
    """One complete checkpoint folder and what its marker records."""

    path: str
    step: int
    model_only: bool
    record: Mapping[str, Any] = field(default_factory=dict)


def marker_problem(record: Any) -> str | None:
    """What is wrong with a marker's JSON value ``record`` (None: nothing): it must be an
    object whose ``step``, ``world_size`` are whole numbers, ``model_only``, ``hf_export``
    booleans, ``optimizer_groups`` an object of strings, and whose file records pass
    :func:`~.integrity.marker_files_problem`."""
    if type(record) is not dict:
        return f"holds a JSON {type(record).__name__}, not an object"
    for key in ("step", "world_size"):
        if key in record and not (type(record[key]) is int and record[key] >= 0):
            return f"records {key} {str(record[key])[:40]!r}, not a whole number"
    for key in ("model_only", "hf_export"):
        if key in record and type(record[key]) is not bool:
            return f"records {key} {str(record[key])[:40]!r}, not true or false"
    groups = record.get("optimizer_groups", {})
    if type(groups) is not dict or not all(type(v) is str for v in groups.values()):
        return "records optimizer_groups that are not an object of group names"
    return integrity.marker_files_problem(record)


def _marker(path: str) -> tuple[dict[str, Any] | None, str]:
    """``(record, "")`` of the marker of ``path``, or ``(None, what is wrong)``: ``"is missing"``,
    a link, a FIFO, not valid JSON (:func:`~torchtitan_spmd._safe_files.read_json_inside`), or
    :func:`marker_problem`."""
    try:
        record = read_json_inside(path, COMPLETE_MARKER)
    except FileNotFoundError:
        return None, "is missing"
    except UnsafeFile as err:
        return None, err.what if err.name else f"cannot be read: the folder {err.what}"
    except OSError as err:
        return None, f"cannot be read ({integrity.save_failure(err)[1]})"
    problem = marker_problem(record)
    return (None, problem) if problem is not None else (record, "")


def _read_marker(path: str) -> dict[str, Any] | None:
    return _marker(path)[0]


def find_checkpoints(folder: str) -> tuple[dict[int, CheckpointInfo], list[str]]:
    """The complete checkpoints under ``folder`` by step, and the paths of the incomplete ones.

    Complete: a ``step-N`` folder holding DCP's ``.metadata`` and a readable marker.
    Incomplete: any other ``step-N`` folder, and every ``step-N.partial`` (a save that
    did not finish). A missing ``folder`` holds none.
    """
    complete: dict[int, CheckpointInfo] = {}
    incomplete: list[str] = []
    if not os.path.isdir(folder):
        return complete, incomplete
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            continue
        if _PARTIAL_DIR.match(name):
            incomplete.append(path)
            continue
        m = _STEP_DIR.match(name)
        if not m:
            continue
        record = _read_marker(path)
        if record is not None and record.get("hf_export"):
            continue  # a Hugging Face export (last_save_in_hf): model only, not resumable
        if record is None or not os.path.isfile(os.path.join(path, _DCP_METADATA)):
            incomplete.append(path)
            continue
        step = int(m.group(1))
        complete[step] = CheckpointInfo(path, step, bool(record.get("model_only", step == 0)), record)
    return complete, incomplete


def purge_stale(folder: str, keep_latest_k: int) -> list[str]:
    """Delete all but the newest ``keep_latest_k`` complete checkpoints, and unfinished saves
    older than the newest complete one; return what was deleted. ``0`` keeps everything.

    Never deletes the newest complete checkpoint (``keep_latest_k`` is 0 or >= 2).
    """
    if keep_latest_k <= 0:
        return []
    complete, incomplete = find_checkpoints(folder)
    if not complete:
        return []
    steps = sorted(complete)
    doomed = [complete[s].path for s in steps[:-keep_latest_k]]
    newest = steps[-1]
    for path in incomplete:
        m = _PARTIAL_DIR.match(os.path.basename(path))
        if m and int(m.group(1)) < newest:
            doomed.append(path)
    for path in doomed:
        logger.info(f"checkpoint: deleting {path} (keep_latest_k={keep_latest_k})")
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _publish(partial: str, final: str, record: Mapping[str, Any]) -> None:
    """Write the marker into ``partial``, then make it ``final`` with one rename (rank 0 only)."""
    tmp = os.path.join(partial, COMPLETE_MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(dict(record), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(partial, COMPLETE_MARKER))
    _fsync_dir(partial)
    old = None
    if os.path.exists(final):  # saving a step again (e.g. after resuming from an earlier one)
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(partial, final)
    _fsync_dir(os.path.dirname(final))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ====================================================================================== states
def _fqn_of_optimizer_key(key: str) -> tuple[str, str] | None:
    """``("layers.0.w1.weight", "exp_avg")`` for a flattened optimizer key ``state.<fqn>.<name>``."""
    if not key.startswith("state."):
        return None
    fqn, _, name = key[len("state."):].rpartition(".")
    return (fqn, name) if fqn else None


class _DTensorViews:
    """Swap a state dict's plain local shards for the representation's DTensor views, and back."""

    def __init__(self, representation: TensorRepresentation, layouts: Mapping[str, StateLayout]) -> None:
        self.representation = representation
        self.layouts = layouts
        self.originals: dict[str, torch.Tensor] = {}

    def wrap(self, key: str, value: Any, fqn: str, param: torch.Tensor | None) -> Any:
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or fqn not in self.layouts:
            return value
        if param is not None and tuple(value.shape) != tuple(param.shape):
            return value  # a per-parameter scalar (Adam's step): replicated
        view = self.representation.to_dtensor(value, self.layouts[fqn])
        if view is not value:
            self.originals[key] = value
        return view

    def unwrap(self, state: dict[str, Any]) -> dict[str, Any]:
        return {k: self.originals.get(k, v) for k, v in state.items()}


class _OptimizerState:
    """The optimizer's flattened state (``state.<fqn>.<name>``, ``param_groups.<fqn>.<name>``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, views: _DTensorViews) -> None:
        self.model, self.optimizer, self.views = model, optimizer, views
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        # By the names torch's state-dict helpers use (activation checkpointing's wrapper
        # looked through): a state whose parameter is not found would be laid out as if it
        # were the parameter itself (Adam's scalar step as a sharded tensor).
        params = {plain_fqn(name): p for name, p in self.model.named_parameters()}
        out = {}
        for key, value in get_optimizer_state_dict(self.model, optimizers_of(self.optimizer),
                                                   options=self.options).items():
            where = _fqn_of_optimizer_key(key)
            if where is not None and where[0] not in params:
                raise RuntimeError(f"checkpoint: optimizer state {key!r} names no parameter of the model "
                                   f"(parameters: {', '.join(sorted(params)[:3])}, ...).")
            out[key] = value if where is None else self.views.wrap(
                f"{OPTIMIZER}.{key}", value, where[0], params[where[0]])
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        plain = {k: self.views.originals.get(f"{OPTIMIZER}.{k}", v) for k, v in state.items()}
        set_optimizer_state_dict(self.model, optimizers_of(self.optimizer), plain, options=self.options)


class _RngState:
    """The torch RNG state of rank 0 (CPU, and CUDA when it is in use); every rank restores it."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if self.device_type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state()
        if dist.is_initialized() and dist.get_world_size() > 1:
            objs = [state]
            dist.broadcast_object_list(objs, src=0)
            state = objs[0]
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and self.device_type == "cuda":
            torch.cuda.set_rng_state(state["cuda"])


class _Checked:
    """A stateful object whose loaded state is checked before it is applied: ``check(state)``
    says what is wrong with it (``(item, what)``) or None; a problem raises
    :class:`~.safe_metadata.RefusedCheckpointData` naming the item and its shard file
    (:attr:`files`: fqn -> shard file, set by the load), so a bad state stops the load, not
    the first step after it."""

    def __init__(self, entry: str, inner: Any, check: Any) -> None:
        self.entry, self.inner, self.check = entry, inner, check
        self.files: dict[str, str] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        problem = self.check(state)
        if problem is not None:
            key, what = problem
            fqn = f"{self.entry}.{key}" if key else self.entry
            file = self.files.get(fqn) or next((f for k, f in sorted(self.files.items())
                                                if k.startswith(fqn + ".")), "")
            raise RefusedCheckpointData(f"the item {fqn!r}", what, file)
        self.inner.load_state_dict(state)


class _TrainState:
    """The step count (torchtitan's ``train_state``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.step = int(state["step"])

    @staticmethod
    def problem(state: Mapping[str, Any]) -> tuple[str, str] | None:
        """``("step", what)`` when the saved step is not a whole number."""
        step = state.get("step")
        if type(step) is not int or step < 0:
            return "step", f"holds {str(step)[:40]!r}, not a step count (a whole number)"
        return None


# ====================================================================================== manager
def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


class _ModelOnlyResume(CheckpointLoadError):
    """:meth:`CheckpointManager._choose`'s refusal to resume from a model-only checkpoint, with its
    marker's ``record`` (the load first checks that the checkpoint is this model's)."""

    def __init__(self, name: str, what: str, file: str, record: dict[str, Any]) -> None:
        super().__init__(name, what, file)
        self.record = record

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.what, self.file, self.record))


def _agreed(err: Exception) -> Exception:
    """``err``, marked as the same on every rank (rank 0's decision, broadcast): the trainer
    prints such an error once, on rank 0."""
    err.agreed = True  # type: ignore[attr-defined]
    return err


class CheckpointManager:
    """Saves and loads the trainer's state with DCP; see the module docstring.

    Args:
        config: the ``[checkpoint]`` section.
        base_folder: ``job.dump_folder``; checkpoints live in ``base_folder/config.folder``.
        model, optimizer, lr_scheduler, dataloader: what is saved (the dataloader needs
            ``state_dict``/``load_state_dict``).
        representation, state_layouts: the backend's representation and the layouts the
            plan recorded (``Trainer.state_layouts``), for the DTensor views.
        device_type: ``"cpu"`` or ``"cuda"`` (which RNG states to keep).
        record: extra facts written into each checkpoint's marker (backend, degrees, ...).
        timeout: the timeout of the process group an async save writes through.
        sd_adapter, hf_assets_path: the family's Hugging Face adapter and folder (upstream's
            names), for ``initial_load_in_hf`` and ``last_save_in_hf``.

    Raises:
        ValueError: at construction, for an ``exclude_from_loading`` entry that is not one
            of :data:`LOADABLE_ENTRIES`; ``async_mode='async_with_pinned_mem'``.
    """

    def __init__(self, config: CheckpointConfig, *, base_folder: str, model: nn.Module,
                 optimizer: torch.optim.Optimizer, lr_scheduler: Any, dataloader: Any,
                 representation: TensorRepresentation, state_layouts: Mapping[str, StateLayout],
                 device_type: str = "cpu", record: Mapping[str, Any] | None = None,
                 timeout: timedelta | None = None, sd_adapter: StateDictAdapter | None = None,
                 hf_assets_path: str | None = None, other_stage_keys: frozenset[str] = frozenset()) -> None:
        self.config = config
        #: Under pipeline parallelism: the model keys the other stages hold (a checkpoint has
        #: them, this rank's part does not).
        self.other_stage_keys = other_stage_keys
        self.sd_adapter, self.hf_assets_path = sd_adapter, hf_assets_path
        self.enable = config.enable
        self.folder = os.path.join(base_folder, config.folder)
        self.model = model
        self.views = _DTensorViews(representation, state_layouts)
        self.train_state = _TrainState()
        self.states: dict[str, Any] = {
            OPTIMIZER: _OptimizerState(model, optimizer, self.views),
            LR_SCHEDULER: _Checked(LR_SCHEDULER, lr_scheduler, lambda state: lr_state_problem(lr_scheduler, state)),
            DATALOADER: dataloader,
            TRAIN_STATE: _Checked(TRAIN_STATE, self.train_state, _TrainState.problem),
            RNG: _RngState(device_type),
        }
        self.record = dict(record or {})
        unknown = [e for e in config.exclude_from_loading if e not in LOADABLE_ENTRIES]
        if unknown:
            raise ValueError(f"checkpoint.exclude_from_loading: unknown {unknown}; the entries are "
                             f"{', '.join(map(repr, LOADABLE_ENTRIES))} (the model is always loaded).")
        check_supported(config)  # the support table: async_mode, quantized Hugging Face loads
        #: LoRA's adapter entries (``layers.0.attention.wq.lora_a``, ...); empty without LoRA.
        self.adapter_keys = frozenset(f"{fqn}.{a}" for fqn in lora.lora_scalings(model) for a in lora.ADAPTERS)
        if config.lora_adapters_only and config.enable and not self.adapter_keys:
            raise ValueError("checkpoint.lora_adapters_only: the model has no LoRA adapters "
                             "(add LoRAConverter to model.converters, or leave it False).")
        self.async_mode = config.async_mode
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._async_pg: dist.ProcessGroup | None = None
        self._finisher: ThreadPoolExecutor | None = None
        self.save_future: Future[None] | None = None
        #: What the last :meth:`load` did: ``{"path", "step", "model_only", "ignored", "seconds"}``
        #: (None: nothing was loaded).
        self.loaded: dict[str, Any] | None = None
        if self.enable and self.async_mode == "async" and not config.load_only:
            if self.world_size > 1:  # DCP's collectives from the writer thread need their own group
                self._async_pg = dist.new_group(backend="gloo", timeout=timeout)
            self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")

    # ------------------------------------------------------------------ state dicts
    def _model_state(self, part: str = "all") -> dict[str, Any]:
        """The model's entries, flat (``tok_embeddings.weight``, ...), as DTensors of global shape:
        all of them, LoRA's ``"adapters"`` alone, or the ``"base"`` without them."""
        state = get_model_state_dict(self.model)
        if part != "all":
            state = {k: v for k, v in state.items() if (k in self.adapter_keys) == (part == "adapters")}
        return {k: self.views.wrap(k, v, k, None) for k, v in state.items()}

    def _states(self, model_only: bool, exclude: tuple[str, ...] = (), part: str = "all") -> dict[str, Any]:
        self.views.originals.clear()
        states = self._model_state(part)
        if not model_only:
            states.update({k: v for k, v in self.states.items() if k not in exclude})
        return states

    # ------------------------------------------------------------------ save
    def _should_save(self, step: int, last_step: bool) -> bool:
        if not self.enable or self.config.load_only:
            return False
        if step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or step % self.config.interval == 0

    @torch.no_grad()
    def save(self, step: int, *, last_step: bool = False) -> bool:
        """Save after optimizer step ``step`` if the interval (or the last step) says so.

        The last step's save is model-only in ``export_dtype`` when ``last_save_model_only``
        (torchtitan's default), and always synchronous. Returns whether a save started.
        Raises :class:`CheckpointSaveError` on every rank when this save (or the background
        one before it) failed on any rank.
        """
        if not self._should_save(step, last_step):
            return False
        model_only = last_step and self.config.last_save_model_only
        self._save(step, model_only=model_only, use_async=not last_step and self.async_mode == "async")
        return True

    def save_seed(self) -> None:
        """``create_seed_checkpoint``: the model only, as ``step-0`` (one process, no parallelism)."""
        if self.world_size != 1:
            raise ValueError(f"checkpoint.create_seed_checkpoint needs one process (no parallelism); "
                             f"this run has {self.world_size}.")
        if not self.enable:
            raise ValueError("checkpoint.create_seed_checkpoint needs checkpoint.enable.")
        self._save(0, model_only=True, use_async=False)

    def _save(self, step: int, *, model_only: bool, use_async: bool) -> None:
        self.wait()
        begin = time.monotonic()
        final = os.path.join(self.folder, f"step-{step}")
        partial = final + _PARTIAL
        error: BaseException | None = None
        if self.rank == 0:
            try:
                os.makedirs(self.folder, exist_ok=True)
                shutil.rmtree(partial, ignore_errors=True)  # an earlier save of this step that died
            except OSError as err:
                error = err
        self._stop_if_failed(step, partial, error)  # also the barrier before DCP's collectives
        self.train_state.step = step
        hf_export = model_only and step != 0 and self.config.last_save_in_hf
        # LoRA's adapters alone (not a seed checkpoint, not the Hugging Face export, which merges them)
        adapters_only = self.config.lora_adapters_only and step != 0 and not hf_export
        states = self._states(model_only, part="adapters" if adapters_only else "all")
        if hf_export:  # LoRA: the adapters merged into the weights
            states = lora.merged_state_dict(states, lora.lora_scalings(self.model))
        if model_only:
            dtype = getattr(torch, self.config.export_dtype)
            states = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                      for k, v in states.items()}
        record = {**self.record, "step": step, "model_only": model_only, "format": FORMAT_VERSION,
                  "world_size": self.world_size, "torch": torch.__version__,
                  "export_dtype": self.config.export_dtype if model_only else None,
                  **({"lora_adapters_only": True, "lora_base": self._base_source()} if adapters_only else {})}
        if model_only and step != 0 and self.config.last_save_in_hf and self.sd_adapter is not None:
            try:
                hf_checkpoint.save_hf(states, partial, self.sd_adapter, dtype=self.config.export_dtype)
            except OSError as err:
                error = err
            self._stop_if_failed(step, partial, error)
            self._finish(None, None, step, partial, final, {**record, "hf_export": True}, begin, None)
            return
        writer = integrity.RecordingWriter(partial)
        if use_async:
            written = None
            try:
                written = dcp.async_save(states, storage_writer=writer, checkpoint_id=partial,
                                         process_group=self._async_pg)
            except (Exception, CheckpointException) as err:  # noqa: BLE001 - reported in one line below
                error = err
            self._stop_if_failed(step, partial, error)
            assert self._finisher is not None and written is not None
            self.save_future = self._finisher.submit(self._finish, writer, written, step, partial, final, record,
                                                     begin, self._async_pg)
            logger.info(f"checkpoint: staged step {step} in {time.monotonic() - begin:.2f}s; writing in the background")
            return
        try:
            dcp.save(states, storage_writer=writer, checkpoint_id=partial)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - reported in one line below
            error = err
        self._stop_if_failed(step, partial, error)
        # every rank returns once the checkpoint is visible (the last agreement in _finish)
        self._finish(writer, None, step, partial, final, record, begin, None)

    def _finish(self, writer: integrity.RecordingWriter | None, written: Future[Any] | None, step: int, partial: str,
                final: str, record: Mapping[str, Any], begin: float, group: dist.ProcessGroup | None) -> None:
        """Collect the file records on rank 0, which publishes; every rank learns the outcome.

        The marker is written only after DCP's save returned on every rank (each rank's
        files written, synced and hashed; ``.metadata`` written and synced by the coordinator).
        """
        error: BaseException | None = None
        try:
            if written is not None:
                written.result()  # DCP's coordinator wrote .metadata after every rank's data
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - reported in one line below
            error = err
        self._stop_if_failed(step, partial, error, group)
        checksums: dict[str, Any] = {}
        if writer is not None:  # a DCP save (a Hugging Face export is not resumable: no checksums)
            try:  # a collective: every rank joins; only rank 0 can raise (two ranks claiming one file)
                checksums = {"hash": writer.algorithm, "files": integrity.gather_file_records(
                    writer.written, writer.algorithm, self.rank, self.world_size, group)}
            except RuntimeError as err:
                error = err
        if self.rank == 0 and error is None:
            try:
                _publish(partial, final, {**record, **checksums})
                purge_stale(self.folder, self.config.keep_latest_k)
            except OSError as err:
                error = err
        self._stop_if_failed(step, partial, error, group)
        if self.rank == 0:
            logger.info(f"checkpoint: saved {final} ({'model only' if record['model_only'] else 'full'}) "
                        f"in {time.monotonic() - begin:.2f}s")

    def _stop_if_failed(self, step: int, partial: str, error: BaseException | None,
                        group: dist.ProcessGroup | None = None) -> None:
        """Every rank learns whether any rank's part of the save of ``step`` failed; if one did,
        rank 0 removes ``partial`` and every rank raises :class:`CheckpointSaveError`: one line
        naming the folder, the errno, what was left, and the newest complete checkpoint."""
        mine = None if error is None else (integrity.failed_rank(error, self.rank), integrity.save_failure(error)[1])
        failures = integrity.agree_on_errors(mine, self.rank, self.world_size, group)
        if not failures:
            return
        left = [""]
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            left[0] = ("removed" if not os.path.exists(partial)
                       else "could not be removed: it stays, never loaded (no marker)")
        if self.world_size > 1:
            dist.broadcast_object_list(left, src=0, group=group)
        failed_rank, what = failures[0][1]
        newest = integrity.newest_complete(find_checkpoints(self.folder)[0])
        raise CheckpointSaveError(
            f"checkpoint: saving step-{step} into {self.folder} failed on rank {failed_rank}: {what}; "
            f"{os.path.basename(partial)} {left[0]}; the newest complete checkpoint, {newest}, is untouched")

    def wait(self) -> None:
        """Block until a background save (``async_mode='async'``) is complete and visible."""
        future, self.save_future = self.save_future, None
        if future is not None:
            future.result()

    # ------------------------------------------------------------------ load
    def _choose(self, load_step: int) -> tuple[str, int, bool, list[str], dict[str, Any]] | None:
        """(path, step, model_only, ignored folders, marker record) of what to load, or None: start fresh."""
        cfg = self.config
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise ValueError(f"checkpoint folder {self.folder!r} (job.dump_folder/checkpoint.folder) is not a folder.")
        complete, incomplete = find_checkpoints(self.folder)
        for path in incomplete:
            logger.warning(f"checkpoint: ignoring {path}: not a complete checkpoint (no {COMPLETE_MARKER} "
                           "marker or no DCP .metadata; a save that did not finish?)")
        if load_step != -1:
            if load_step not in complete:
                have = ", ".join(f"step-{s}" for s in sorted(complete)) or "none"
                raise ValueError(f"checkpoint.load_step={load_step}: no complete checkpoint step-{load_step} in "
                                 f"{self.folder!r}; complete ones: {have}"
                                 + (f"; ignored as incomplete: {', '.join(map(os.path.basename, incomplete))}"
                                    if incomplete else "") + ".")
            info = complete[load_step]
        elif complete:
            info = complete[max(complete)]
            if cfg.initial_load_path:
                logger.warning(f"checkpoint: {self.folder} holds checkpoints, so checkpoint.initial_load_path "
                               f"{cfg.initial_load_path!r} is ignored.")
        elif cfg.initial_load_in_hf and (cfg.initial_load_path or self.hf_assets_path):
            return cfg.initial_load_path or self.hf_assets_path, 0, True, incomplete, {}
        elif cfg.initial_load_path:
            path = cfg.initial_load_path
            if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, _DCP_METADATA)):
                what = "does not exist" if not os.path.exists(path) else (
                    "is not a folder" if not os.path.isdir(path) else
                    f"has no DCP {_DCP_METADATA} file (contents: {sorted(os.listdir(path))[:8]})")
                raise ValueError(f"checkpoint.initial_load_path={path!r} is not a checkpoint: it {what}. "
                                 "Give the step folder a checkpoint save wrote, e.g. .../checkpoint/step-0.")
            record, problem = _marker(path)
            if record is None and problem != "is missing":  # a DCP folder without a marker loads unverified
                raise CheckpointLoadError(os.path.basename(os.path.normpath(path)),
                                          f"its {COMPLETE_MARKER} marker {problem}", os.path.join(path, COMPLETE_MARKER))
            record = record or {}
            saved_model_only = bool(record.get("model_only", False))
            if saved_model_only and not cfg.initial_load_model_only:
                raise ValueError(f"checkpoint.initial_load_path={path!r} holds only the model; "
                                 "checkpoint.initial_load_model_only=False needs a full checkpoint.")
            return (path, int(record.get("step", 0)), cfg.initial_load_model_only or saved_model_only, incomplete,
                    record)
        else:
            return None
        if info.model_only and info.step != 0:
            full = [s for s, i in complete.items() if not i.model_only]
            hint = (f"pass --checkpoint.load_step {max(full)} (the newest full checkpoint) to resume from it"
                    if full else "no full checkpoint is there to resume from")
            raise _ModelOnlyResume(
                f"step-{info.step}", f"holds only the model (the last save of a run with "
                f"checkpoint.last_save_model_only=True), so training cannot resume from it: {hint}, "
                "or save full last checkpoints with --checkpoint.no-last_save_model_only; to start a new run "
                f"from scratch instead, give another --job.dump_folder or remove {self.folder}", info.path,
                dict(info.record))
        return info.path, info.step, info.model_only, incomplete, dict(info.record)

    def _fallbacks(self, chosen: str | None) -> list[tuple[int, str, dict[str, Any]]]:
        """The other checkpoints a run could resume from, newest first: ``(step, path, record)``."""
        complete, _ = find_checkpoints(self.folder)
        return [(s, i.path, dict(i.record)) for s, i in sorted(complete.items(), reverse=True)
                if i.path != chosen and (not i.model_only or s == 0)]

    def _verify(self, path: str, record: Mapping[str, Any], fallbacks: list[tuple[int, str, dict[str, Any]]]) -> None:
        """Every rank verifies its share of the files of ``path`` before DCP reads anything.

        A mismatch raises :class:`CheckpointLoadError` naming the file, what differs and the
        newest other checkpoint that verifies with the flag that loads it; never loads another.
        A checkpoint without checksums (saved before they were recorded) loads with a warning.
        """
        name = os.path.basename(os.path.normpath(path))
        problems = integrity.verify_checkpoint(path, record, self.rank, self.world_size)
        if problems is None:
            if self.rank == 0:
                logger.warning(f"checkpoint {name}: its {COMPLETE_MARKER} records no checksums (saved before "
                               f"they were recorded), so it loads unverified ({path})")
            return
        if not problems:
            return
        file, what = problems[0]
        more = f" (and {len(problems) - 1} more file(s) differ)" if len(problems) > 1 else ""
        raise CheckpointLoadError(name, f"{file} {what}{more}; {self._newest_good(fallbacks)}",
                                  os.path.join(path, file))

    def _newest_good(self, fallbacks: list[tuple[int, str, dict[str, Any]]]) -> str:
        """Which of ``fallbacks`` (newest first) verifies, and the flag that loads it (every rank
        verifies its share of each in turn, until one verifies)."""
        for step, other, other_record in fallbacks:
            checked = integrity.verify_checkpoint(other, other_record, self.rank, self.world_size)
            if checked is None:
                return (f"the newest other checkpoint is step-{step}, saved without checksums: "
                        f"--checkpoint.load_step {step} loads it unverified")
            if not checked:
                return f"the newest checkpoint that verifies is step-{step}: load it with --checkpoint.load_step {step}"
        return "no other checkpoint verifies"

    def _damaged_newer(self, chosen_step: int | None) -> tuple[str, str, str] | None:
        """``(name, what, file)`` of a published ``step-N`` folder newer than ``chosen_step`` that is
        not a complete checkpoint (a save renames its folder only once complete, so this one was
        damaged or copied in part): loading an older one instead would be a silent fallback."""
        _, incomplete = find_checkpoints(self.folder)
        damaged = sorted((int(m.group(1)), p) for p in incomplete if (m := _STEP_DIR.match(os.path.basename(p))))
        if not damaged or (chosen_step is not None and damaged[-1][0] <= chosen_step):
            return None
        step, path = damaged[-1]
        marker, metadata = os.path.join(path, COMPLETE_MARKER), os.path.join(path, _DCP_METADATA)
        if not os.path.exists(marker):
            what, file = (f"no {COMPLETE_MARKER} marker: not a save that finished here (a folder copied in part?)",
                          marker)
        elif _read_marker(path) is None:
            what, file = f"its {COMPLETE_MARKER} marker {_marker(path)[1]}", marker
        else:
            what, file = f"no DCP {_DCP_METADATA} file", metadata
        return f"step-{step}", what, file

    def _check_against(self, path: str, metadata: Mapping[str, Any], states: Mapping[str, Any],
                       record: Mapping[str, Any]) -> None:
        """Raise :class:`CheckpointLoadError` naming the first key whose shape differs from the
        checkpoint's (``metadata``: its DCP metadata by key), or a model key either side lacks, with
        the model the checkpoint's marker ``record`` names and how to start afresh.

        Every rank compares its own part (under pipeline parallelism each stage holds other keys)
        and every rank learns every rank's finding (one object all-gather): the error is agreed,
        printed once by rank 0, naming the ranks that found it when not all did."""
        try:
            self._compare(metadata, states)
            mine: str | None = None
        except ValueError as err:
            mine = str(err)
        found = [mine]
        if self.world_size > 1:
            found = [None] * self.world_size
            dist.all_gather_object(found, mine)
        ranks = [r for r, what in enumerate(found) if what is not None]
        if not ranks:
            return
        what = found[ranks[0]]
        if len(ranks) < len(found):
            what = what.rstrip(".") + f" (found on rank(s) {', '.join(map(str, ranks))} of {len(found)})"
        if what.startswith("saved from another model"):  # not a missing optimizer/... entry
            what = self._another_model(what.rstrip("."), path, record)
        raise _agreed(CheckpointLoadError(os.path.basename(os.path.normpath(path)), what, path))

    def _another_model(self, what: str, path: str, record: Mapping[str, Any]) -> str:
        """``what`` (a model mismatch) with the model the checkpoint's marker ``record`` names and
        how to start afresh."""
        saved_model, this_model = record.get("model"), self.record.get("model")
        if isinstance(saved_model, str) and saved_model and this_model:
            what += (f"; its marker records the model {saved_model!r}, this run's is {this_model!r}"
                     if saved_model != this_model else f"; its marker records the model {saved_model!r}, "
                     "this run's too: a flavour changed since it was saved?")
        if os.path.dirname(os.path.normpath(path)) == os.path.normpath(self.folder):
            what += (f"; to start afresh, give another --job.dump_folder or remove {self.folder}, or resume "
                     f"with the model that saved it")
        else:
            what += "; give checkpoint.initial_load_path a checkpoint of this model"
        return what

    def _compare(self, metadata: Mapping[str, Any], states: Mapping[str, Any]) -> None:
        model = {k: v for k, v in states.items() if k not in self.states}
        saved_model = {k for k in metadata if k.split(".", 1)[0] not in self.states}
        for key, value in model.items():
            saved = metadata.get(key)
            if saved is None:
                raise ValueError(f"saved from another model: it has no {key!r} "
                                 f"(it holds {len(saved_model)} model tensors, e.g. {sorted(saved_model)[:3]}).")
            if isinstance(saved, TensorStorageMetadata) and tuple(saved.size) != _shape(value):
                raise ValueError(f"saved from another model: {key!r} has shape "
                                 f"{tuple(saved.size)} there and {_shape(value)} in this model.")
        extra = sorted(saved_model - set(model) - self.other_stage_keys)
        if extra:
            raise ValueError(f"saved from another model: it holds {extra[0]!r}, "
                             f"which this model lacks ({len(extra)} such keys).")
        for entry in (k for k in states if k in self.states):
            if not any(k == entry or k.startswith(entry + ".") for k in metadata):
                raise ValueError(f"it has no {entry!r} entry; leave it out with "
                                 f"--checkpoint.exclude_from_loading {entry}.")

    @torch.no_grad()
    def load(self, step: int = -1) -> int:
        """Load the latest complete checkpoint (or ``step``), else ``initial_load_path``.

        Returns the step to continue after (0: from the start, also after a model-only
        load). Raises ``ValueError`` for a missing step or a folder that is not a checkpoint,
        and :class:`CheckpointLoadError` (one line, ``checkpoint step-N: <what> (<file>)``) for
        a file that does not match its checksum, a newer ``step-N`` that is not complete, a
        checkpoint of another model (naming the first mismatched key and both shapes), a
        model-only checkpoint to resume from, or any DCP or torch error while reading.
        """
        if not self.enable:
            return 0
        choice: list[Any] = [None]
        if self.rank == 0:
            try:
                chosen = self._choose(step)
                mine = chosen is not None and os.path.dirname(chosen[0]) == self.folder  # not initial_load_path
                damaged = self._damaged_newer(chosen[1] if mine else None) if step == -1 else None
                fallbacks = self._fallbacks(chosen[0] if chosen is not None and damaged is None else None)
                choice[0] = ("ok", (chosen, fallbacks, damaged))
            except _ModelOnlyResume as refused:  # unless it was saved by another model: see below
                choice[0] = ("model_only", (str(refused), refused.file, refused.record))
            except ValueError as err:
                choice[0] = ("error", str(err))
            except OSError as err:  # the folder cannot be listed or read
                choice[0] = ("error", f"checkpoint folder {self.folder!r}: {integrity.save_failure(err)[1]}")
        if self.world_size > 1:  # one decision for every rank
            dist.broadcast_object_list(choice, src=0)
        status, value = choice[0]
        if status == "model_only":
            self._refuse_model_only(*value)
        if status == "error":
            raise _agreed(ValueError(value))
        chosen, fallbacks, damaged = value
        if damaged is not None:
            name, what, file = damaged
            raise _agreed(CheckpointLoadError(name, f"{what}; {self._newest_good(fallbacks)}", file))
        if chosen is None:
            return 0
        path, saved_step, model_only, ignored, record = chosen
        begin = time.monotonic()
        name = os.path.basename(os.path.normpath(path))
        exclude = tuple(self.config.exclude_from_loading)
        if self._hf_source() == path:
            self._load_hf_base(path)  # an HF folder holds no adapters: they keep their initialisation
            return self._loaded({}, path, saved_step, model_only, ignored, begin)
        adapters_only = bool(record.get("lora_adapters_only", False))
        if adapters_only:
            self._check_base(name, record)
            source = self._hf_source()
            if source is not None:  # the frozen base first, from where the run started
                self._load_hf_base(source)
        states = self._states(model_only, exclude, part="adapters" if adapters_only else "all")
        self._verify(path, record, fallbacks)
        if OPTIMIZER in states and "optimizer_groups" in record:  # the param groups it was saved with
            try:
                check_same_grouping(record["optimizer_groups"], self.record.get("optimizer_groups", {}),
                                    f"checkpoint {name}")
            except ValueError as err:
                raise ValueError(str(err)) from None
        trust = self._trust(path)
        try:  # every rank reads it (restricted: nothing it names runs) before DCP does
            whole = integrity.NamingReader(path, trust_folder=trust).read_metadata()
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - one line naming the file
            what, file = integrity.describe_load_failure(err, path)
            raise CheckpointLoadError(name, what, file if file != path else os.path.join(path, _DCP_METADATA)) from None
        metadata = whole.state_dict_metadata
        files = {index.fqn: info.relative_path for index, info in (whole.storage_data or {}).items()
                 if isinstance(getattr(info, "relative_path", None), str)}
        for entry in (LR_SCHEDULER, TRAIN_STATE):
            if isinstance(states.get(entry), _Checked):
                states[entry].files = files
        rng = states.get(RNG)
        if rng is not None:  # the CUDA state only where the checkpoint has it (a CPU save loads on CUDA)
            states[RNG] = _FilteredRng(rng, {k.split(".", 1)[1] for k in metadata if k.startswith(RNG + ".")})
        self._check_against(path, metadata, states, record)
        try:
            dcp.load(states, storage_reader=integrity.NamingReader(path, trust_folder=trust), checkpoint_id=path,
                     planner=RestrictedLoadPlanner(trust_folder=trust))
        except CheckpointException as err:  # raised on every rank alike: they can look for a good one together
            what, file = integrity.describe_load_failure(err, path)
            raise CheckpointLoadError(name, f"{what}; {self._newest_good(fallbacks)}", file) from None
        except Exception as err:  # noqa: BLE001 - one line naming the file
            raise CheckpointLoadError(name, *integrity.describe_load_failure(err, path)) from None
        return self._loaded(states, path, saved_step, model_only, ignored, begin)

    def _refuse_model_only(self, message: str, path: str, record: Mapping[str, Any]) -> None:
        """Refuse to resume from the model-only checkpoint ``path`` (``message``, agreed), unless it
        was saved by another model: then the shape check's error (:meth:`_check_against`), which
        says what a ``--checkpoint.load_step`` of that run's full checkpoints would meet next."""
        try:
            metadata = integrity.NamingReader(path, trust_folder=False).read_metadata().state_dict_metadata
        except (Exception, CheckpointException):  # noqa: BLE001 - unreadable: the refusal stands
            metadata = None
        ok = [metadata is not None]
        if self.world_size > 1:  # every rank reads it alike; act together
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, ok[0])
            ok = everyone
        if all(ok):
            self._check_against(path, metadata, self._states(True), record)
        raise _agreed(ValueError(message))

    def _hf_source(self) -> str | None:
        """The Hugging Face folder the run starts from (``initial_load_in_hf``), or None."""
        cfg = self.config
        return (cfg.initial_load_path or self.hf_assets_path) if cfg.initial_load_in_hf else None

    def _base_source(self) -> str:
        """Where this run's frozen base comes from, as an adapters-only checkpoint records it."""
        if self._hf_source() is not None:
            return f"Hugging Face {os.path.abspath(str(self._hf_source()))}"
        if self.config.initial_load_path:  # with lora_adapters_only a setup error (CheckpointConfig)
            return f"checkpoint {os.path.abspath(self.config.initial_load_path)}"
        return f"initialisation, debug.seed {self.record.get('seed')}"

    def _check_base(self, name: str, record: Mapping[str, Any]) -> None:
        """An adapters-only checkpoint loads onto the base it was trained on, from the same source."""
        if not self.adapter_keys:
            raise ValueError(f"checkpoint {name} holds LoRA's adapters only (checkpoint.lora_adapters_only), "
                             "and this model has none: add the run's LoRAConverter to model.converters.")
        want, have = record.get("lora_base"), self._base_source()
        if want != have:
            raise ValueError(f"checkpoint {name} holds LoRA's adapters only, trained on the base from {want}; "
                             f"this run's base comes from {have}: start it from the same base "
                             "(checkpoint.initial_load_path, initial_load_in_hf, debug.seed).")

    def _load_hf_base(self, path: str) -> None:
        """The model's entries but LoRA's adapters from the Hugging Face folder ``path``, into the model."""
        assert self.sd_adapter is not None, "initial_load_in_hf needs the family's sd_adapter"
        name = os.path.basename(os.path.normpath(path))
        states = self._states(True, part="base")
        try:
            hf_checkpoint.load_hf(states, path, self.sd_adapter)
        except ValueError:  # one line already (a missing tensor, a link, a malformed header)
            raise
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - one line naming the file
            raise CheckpointLoadError(name, *integrity.describe_load_failure(err, path)) from None
        self._set_model(states, path)

    def _set_model(self, states: dict[str, Any], path: str) -> None:
        """Set the model from the model entries of ``states`` (all of them, or only its base or adapters)."""
        model_state = {k: v for k, v in states.items() if k not in self.states}
        if not model_state:
            return
        partial = self.adapter_keys and set(model_state) != set(get_model_state_dict(self.model))
        try:
            set_model_state_dict(self.model, self.views.unwrap(model_state),
                                 options=StateDictOptions(strict=not partial))
        except Exception as err:  # noqa: BLE001 - one line naming the file
            raise CheckpointLoadError(os.path.basename(os.path.normpath(path)),
                                      *integrity.describe_load_failure(err, path)) from None
        self.views.originals.clear()

    def _trust(self, path: str) -> bool:
        """``checkpoint.trust_checkpoint_folder``, with its warning naming the folder ``path``."""
        if not self.config.trust_checkpoint_folder:
            return False
        if self.rank == 0:
            logger.warning(f"checkpoint: checkpoint.trust_checkpoint_folder is set, so {path} is read with plain "
                           "pickle (.metadata) and torch.load(weights_only=False) (its non-tensor items): any code "
                           "its files name runs here. Load only a folder whose every writer you trust.")
        return True

    def _loaded(self, states: dict[str, Any], path: str, saved_step: int, model_only: bool,
                ignored: list[str], begin: float) -> int:
        """Set the model from the loaded ``states``; record and log the load; the step to continue after."""
        exclude = tuple(self.config.exclude_from_loading)
        self._set_model(states, path)
        resumed = 0 if model_only or TRAIN_STATE in exclude else self.train_state.step
        seconds = time.monotonic() - begin
        self.loaded = {"path": path, "step": saved_step, "model_only": model_only, "ignored": ignored,
                       "seconds": seconds}
        if self.rank == 0:
            logger.info(f"checkpoint: loaded {path} ({'model only' if model_only else 'full'}) in "
                        f"{seconds:.2f}s; training continues after step {resumed}")
        return resumed

    def close(self) -> None:
        """Wait for a background save, then release the writer thread and its process group."""
        try:
            self.wait()
        finally:
            if self._finisher is not None:
                self._finisher.shutdown(wait=True)
                self._finisher = None
            if self._async_pg is not None and dist.is_initialized():
                dist.destroy_process_group(self._async_pg)
                self._async_pg = None


class _FilteredRng:
    """:class:`_RngState` restricted to the entries a checkpoint has."""

    def __init__(self, rng: _RngState, keys: set[str]) -> None:
        self.rng, self.keys = rng, keys

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.rng.state_dict().items() if k in self.keys}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.rng.load_state_dict(state)
