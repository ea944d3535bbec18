"""The config sections, a drop-in for ``torchtitan.config.configs``.

Training, parallelism, checkpoint, activation checkpointing, compile, comm and
debug have torchtitan's fields, types and defaults (pytorch/torchtitan at
a0c831c49, June 2026); job, model, optimizer, lr_scheduler and metrics are this
library's own. Every section is a keyword-only dataclass that tyro can parse and
that checks its values on construction (see :mod:`._section`).

Fields for features this library does not implement yet keep torchtitan's
default; :func:`torchtitan_spmd.config.support.check_supported` rejects any
other value at setup, naming the feature.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

# Lines marked "compat hook" call into compat/ for the legacy `full_dtensor`
# spellings; deleting compat/ and those lines removes legacy support.
from torchtitan_spmd.compat import legacy as _legacy  # compat hook

from . import backends as _backends
from . import converters as _converters
from . import surface as _surface
from ._section import Section, invalid_choice, reject_unknown_attribute
from .fault_tolerance import FaultToleranceConfig  # noqa: I001 - upstream [fault_tolerance], re-exported

__all__ = [
    "DATASETS",
    "SPMD_BACKENDS",
    "SPMD_BACKEND_ALIASES",
    "ActivationCheckpointConfig",
    "CheckpointConfig",
    "CommConfig",
    "CompileConfig",
    "DataloaderConfig",
    "DebugConfig",
    "FaultToleranceConfig",
    "JobSection",
    "LRSchedulerConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParamGroupConfig",
    "ParallelismConfig",
    "ProfilerConfig",
    "SpmdBackend",
    "SpmdBackendSpelling",
    "TrainingConfig",
    "ValidatorConfig",
]

SpmdBackend = Literal["default", "full_dtensor", "spmd_types"]

#: The annotation of ``parallelism.spmd_backend``: the registry's names and upstream b5bcd76's
#: ``"partial_dtensor"``. A fork at August parses its command line with upstream's own
#: ``ConfigManager`` (tyro with upstream's rules, not this library's), which reads the choices
#: from this ``Literal``: without the August spelling it rejects ``--parallelism.spmd_backend
#: partial_dtensor``. This library's own manager checks the value against the registry
#: (``manager._spmd_backend_rule``), so a backend registered later is accepted there too.
SpmdBackendSpelling = Literal["default", "partial_dtensor", "full_dtensor", "spmd_types"]

#: The built-in values of ``parallelism.spmd_backend``, in documentation order
#: (:func:`.backends.backend_names` adds any registered later).
SPMD_BACKENDS: tuple[str, ...] = get_args(SpmdBackend)

#: The valid values of ``dataloader.dataset`` (``"synthetic"``, the default, first).
DATASETS: tuple[str, ...] = ("synthetic", "c4_test", "text", "json", "parquet")

#: Spellings written by newer torchtitan releases, normalised on load
#: (the registry's table: ``"partial_dtensor"`` is upstream's later name for ``"default"``).
SPMD_BACKEND_ALIASES: dict[str, str] = _backends._ALIASES

if SPMD_BACKENDS != _backends.backend_names():  # pragma: no cover - a packaging error
    raise ImportError(f"SpmdBackend {SPMD_BACKENDS} and the registry {_backends.backend_names()} disagree.")


# --------------------------------------------------------------------------------------
# This library's own sections.
# --------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class JobSection(Section):
    """``[job]``: where a legacy TOML config came from and where outputs go."""

    section_name: typing.ClassVar[str] = "job"

    config_file: str | None = None
    """The TOML file this config was loaded from (``--job.config_file``, the pre-registry loader)."""

    dump_folder: str = "./outputs"
    """Folder for logs and other outputs of the run."""

    description: str = "torchtitan_spmd job"
    """Free-form description printed at start-up."""


@dataclass(kw_only=True)
class ModelConfig(Section):
    """``[model]``: which model family and size preset to build."""

    section_name: typing.ClassVar[str] = "model"

    name: str = "llama3"
    """Model family, e.g. ``"llama3"`` or ``"qwen3"``."""

    flavor: str = "debugmodel"
    """Size preset of the family, e.g. ``"debugmodel"``."""

    hf_assets_path: str | None = None
    """Deprecated: the root config's ``hf_assets_path`` (upstream's ``Trainer.Config.hf_assets_path``
    since a0c831c49; ``model.hf_assets_path`` before). Set, it is moved there with a
    ``DeprecationWarning``."""

    converters: list[Any] = field(default_factory=list)
    """Model converters (upstream's ``model_registry(flavor, converters=[...])``): float8 training,
    LoRA, ... as their configs (:mod:`torchtitan_spmd.config.converters`), applied in order;
    quantization before LoRA. A recipe usually sets them with ``job.model_spec = model_registry(...)``."""

    _field_checks: typing.ClassVar[dict[str, typing.Callable[[Any, str], Any]]] = {
        "converters": lambda value, where: _converters.check_converters(value, where),
    }

    def to_dict(self) -> dict[str, Any]:
        """As :meth:`Section.to_dict`, each converter a table naming its converter (read back by
        ``from_dict``)."""
        out = super().to_dict()
        out["converters"] = [_converters.converter_to_dict(c) for c in self.converters]
        return out


@dataclass(kw_only=True)
class ParamGroupConfig:
    """One parameter group of ``optimizer.param_groups`` (upstream's ``ParamGroupConfig``):
    the trainable parameters whose name matches ``pattern`` (``re.search``; the first pattern
    that matches a parameter claims it) get their own optimizer ``optimizer_name`` built with
    ``optimizer_kwargs``, which must give ``lr`` (the group's peak learning rate: the schedule
    scales it; 0 freezes the group). Nothing is inherited from the ``[optimizer]`` fields. The
    kwargs go to torch's optimizer as upstream passes them: torch's constructor judges each
    group's values when the optimizer is built (one line naming the group)."""

    pattern: str
    """A regular expression searched in each parameter's name, e.g. ``r"\\.router\\.gate\\."``."""

    optimizer_name: Literal["Adam", "AdamW"]
    """The group's optimizer: ``torch.optim.Adam`` or ``torch.optim.AdamW``."""

    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    """The optimizer's keyword arguments for this group (``lr``, ``betas``, ``eps``,
    ``weight_decay``, ...); ``lr`` is required."""

    def __setattr__(self, name: str, value: Any) -> None:
        reject_unknown_attribute(self, name, "optimizer.param_groups[...]")
        super().__setattr__(name, value)

    def check(self, where: str) -> None:
        """Raise ``ValueError``/``TypeError`` naming ``where`` (``optimizer.param_groups[i]``)."""
        if not isinstance(self.pattern, str):
            raise TypeError(f"{where}.pattern: expected str, got {type(self.pattern).__name__} {self.pattern!r}.")
        try:
            re.compile(self.pattern)
        except re.error as err:
            raise ValueError(f"{where}.pattern={self.pattern!r} is not a regular expression: {err}.") from None
        if self.optimizer_name not in get_args(OptimizerName):
            raise invalid_choice(f"{where}.optimizer_name", self.optimizer_name, get_args(OptimizerName))
        if not isinstance(self.optimizer_kwargs, dict):
            raise TypeError(f"{where}.optimizer_kwargs: expected dict, got "
                            f"{type(self.optimizer_kwargs).__name__} {self.optimizer_kwargs!r}.")
        if "lr" not in self.optimizer_kwargs:  # upstream: "Must include all required kwargs (e.g. lr)"
            raise ValueError(f"{where}.optimizer_kwargs has no 'lr': each group states its own peak learning "
                             "rate (0 freezes the group).")


#: ``optimizer.name`` and ``ParamGroupConfig.optimizer_name``: upstream's built-in optimizers.
OptimizerName = Literal["Adam", "AdamW"]


@dataclass(kw_only=True)
class OptimizerConfig(Section):
    """``[optimizer]``: the optimizer, one group (``name``, ``lr``, ``eps``, ``weight_decay``) or
    upstream's ``param_groups``."""

    section_name: typing.ClassVar[str] = "optimizer"

    name: OptimizerName = "AdamW"
    """Optimizer class without ``param_groups``: ``"AdamW"`` or ``"Adam"`` (betas 0.9, 0.95)."""

    lr: float = 8e-4
    """Peak learning rate."""

    eps: float = 1e-8
    """AdamW epsilon."""

    weight_decay: float = 0.1
    """AdamW decoupled weight decay (Adam: L2 penalty)."""

    implementation: Literal["for-loop", "foreach", "fused", "fused_opt_states_bf16"] = "fused"
    """How the optimizer updates the parameters (upstream's ``optimizer.implementation``):
    ``"fused"`` (one fused kernel per step; CPU and CUDA), ``"foreach"`` (multi-tensor
    kernels) or ``"for-loop"`` (one parameter at a time). ``"fused_opt_states_bf16"``
    (bf16 moment buffers) is upstream's too.
    Not implemented by torchtitan_spmd yet: ``"fused_opt_states_bf16"`` (a setup error)."""

    param_groups: list[ParamGroupConfig] = field(default_factory=list)
    """Upstream's per-group optimizers (:class:`ParamGroupConfig`), in order: the first
    pattern a trainable parameter matches claims it. Empty (the default): one group of every
    parameter from ``name``, ``lr``, ``eps`` and ``weight_decay``. Otherwise those four are
    unused, a pattern that claims no parameter is an error, and so is a trainable parameter
    no pattern claims (end with ``".*"`` to catch the rest). Set in a Python config or a TOML
    ``[[optimizer.param_groups]]`` table."""

    def __post_init__(self) -> None:
        if isinstance(self.param_groups, list):  # TOML and plain dicts: one table per group
            self.param_groups = [_param_group(g, f"optimizer.param_groups[{i}]")
                                 for i, g in enumerate(self.param_groups)]
        super().__post_init__()
        self._require_finite("lr", minimum=0, strict=True)
        self._require_finite("eps", minimum=0, strict=True)
        self._require_finite("weight_decay", minimum=0, strict=False)
        for i, group in enumerate(self.param_groups):
            group.check(f"optimizer.param_groups[{i}]")



def _param_group(value: Any, where: str) -> Any:
    """A ``ParamGroupConfig`` from a mapping (TOML, a plain dict), naming ``where`` on a bad key."""
    if not isinstance(value, dict):
        return value
    known = [f.name for f in dataclasses.fields(ParamGroupConfig)]
    for key in value:
        if key not in known:
            raise ValueError(f"{where}: unknown key {key!r}; valid keys are {', '.join(known)}.")
    for key in ("pattern", "optimizer_name"):
        if key not in value:
            raise ValueError(f"{where}: {key!r} is required.")
    return ParamGroupConfig(**value)


@dataclass(kw_only=True)
class LRSchedulerConfig(Section):
    """``[lr_scheduler]``: upstream's warmup-stable-decay schedule (``LRSchedulersContainer.Config``
    at a0c831c49; the formula is in :mod:`torchtitan_spmd.tools.lr_scheduler`)."""

    section_name: typing.ClassVar[str] = "lr_scheduler"

    warmup_steps: int = 200
    """Steps of linear warmup, ``(step + 1) / warmup_steps`` of the peak (shortened to the
    schedule's length, with a warning, when longer)."""

    total_steps: int | None = None
    """Steps of the schedule; None: ``training.steps``."""

    decay_ratio: float | None = None
    """The last ``decay_ratio`` of the schedule decays after a stable phase at the peak
    (warmup-stable-decay); None: the decay starts right after the warmup."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """The decay's curve: ``1 - p``, ``1 - sqrt(p)`` or ``(1 + cos(pi p)) / 2`` of its progress ``p``."""

    min_lr_factor: float = 0.0
    """The decay goes from the peak to ``min_lr_factor`` times the peak."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        self._require(self.total_steps is None or self.total_steps >= 1, "total_steps",
                      "must be >= 1, or None for training.steps")
        self._require(self.decay_ratio is None or 0.0 <= self.decay_ratio <= 1.0, "decay_ratio",
                      "must be in [0, 1], or None to decay right after the warmup")
        self._require(0.0 <= self.min_lr_factor <= 1.0, "min_lr_factor", "must be in [0, 1]")


@dataclass(kw_only=True)
class MetricsConfig(Section):
    """``[metrics]``: logging."""

    section_name: typing.ClassVar[str] = "metrics"

    log_freq: int = 1
    """Log every ``log_freq`` steps (and always the last step)."""

    enable_tensorboard: bool = False
    """Write loss, grad norm, lr, tokens/s and memory of every step as TensorBoard scalars
    (torchtitan's field; needs ``pip install -e ".[tensorboard]"``)."""

    save_tb_folder: str = "tb"
    """Folder under ``job.dump_folder`` for the TensorBoard event files (torchtitan's field);
    each run writes a ``YYYYmmdd-HHMM`` subfolder, as torchtitan."""

    save_for_all_ranks: bool = False
    """Every rank writes its own TensorBoard/W&B metrics (under ``rank_<r>``), not rank 0 alone
    (upstream's field)."""

    enable_wandb: bool = False
    """Log every logged step to Weights & Biases (upstream's field; ``pip install
    torchtitan-spmd[wandb]``). ``WANDB_MODE=offline`` writes the run under ``job.dump_folder/wandb``
    with no network; ``WANDB_PROJECT`` names the project (default ``"torchtitan"``)."""

    disable_color_printing: bool = False
    """Upstream's switch for colored log lines; this library's lines have no colors, so both
    values print the same."""

    cpu_peak_tflops: float | None = None
    """The peak TFLOP/s of one CPU rank, for MFU on CPU (this library's field); None: measured
    at start-up with a timed matmul. The start-up log says which. GPUs use a table."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(self.log_freq >= 1, "log_freq", "must be >= 1")
        self._require(self.cpu_peak_tflops is None or self.cpu_peak_tflops > 0, "cpu_peak_tflops",
                      "must be > 0, or None to measure it")
        self._require(bool(self.save_tb_folder.strip()), "save_tb_folder", "must not be empty")


@dataclass(kw_only=True)
class DataloaderConfig(Section):
    """``[dataloader]``: the training data (upstream's ``dataloader`` since a0c831c49; before, these
    were ``training.dataset`` and ``training.dataset_path``, still accepted with a warning)."""

    section_name: typing.ClassVar[str] = "dataloader"

    dataset: str = "synthetic"
    """``"synthetic"`` (this library's default: generated in code, byte-level; upstream's is a
    Hugging Face dataset name), ``"c4_test"`` (torchtitan's local test set: a folder of JSON
    lines with a ``text`` field, ``tests/assets/c4_test`` unless ``dataset_path``), or local
    files of one format read through the ``datasets`` package (``pip install
    torchtitan-spmd[hf]``) at ``dataset_path``: ``"text"`` (one document per line), ``"json"``
    (JSON lines with a ``text`` field) or ``"parquet"`` (a ``text`` column). Nothing is downloaded."""

    dataset_path: str | None = None
    """Where the dataset's files are (a file, a folder or a glob pattern); required for
    ``"text"``, ``"json"`` and ``"parquet"``, not allowed for ``"synthetic"``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dataset in ("c4", "c4_validation"):
            raise ValueError(f"dataloader.dataset={self.dataset!r} is torchtitan's download of allenai/c4; "
                             "nothing is downloaded here: use 'json' with dataloader.dataset_path on a "
                             "local copy of its JSON lines, or 'c4_test'.")
        if self.dataset not in DATASETS:
            raise invalid_choice("dataloader.dataset", self.dataset, DATASETS)
        if self.dataset == "synthetic" and self.dataset_path is not None:
            raise ValueError(f"dataloader.dataset_path={self.dataset_path!r} needs a file dataset: set "
                             f"dataloader.dataset to one of {', '.join(map(repr, DATASETS[1:]))}.")
        if self.dataset in ("text", "json", "parquet") and not self.dataset_path:
            raise ValueError(f"dataloader.dataset={self.dataset!r} needs dataloader.dataset_path "
                             "(a file, a folder or a glob pattern of local files).")


@dataclass(kw_only=True)
class TokenizerConfig(Section):
    """``[tokenizer]``: upstream's ``HuggingFaceTokenizer.Config`` (a0c831c49), which has no fields:
    the tokenizer is read from the root config's ``hf_assets_path`` (its ``tokenizer.json``, and
    ``tokenizer_config.json`` for BOS/EOS), or is the built-in byte tokenizer without one. The
    section exists so that upstream's spelling (``[tokenizer]``, ``tokenizer=...`` in a config
    function) is accepted; any key in it is an error naming the section."""

    section_name: typing.ClassVar[str] = "tokenizer"

    @classmethod
    def from_dict(cls, data: typing.Mapping[str, Any]) -> TokenizerConfig:
        """The (empty) section; a key in it is a ``ValueError`` saying where the tokenizer comes from."""
        if isinstance(data, typing.Mapping) and data:
            key = next(iter(data))
            raise ValueError(f"[tokenizer]: unknown key {key!r}; the section has no fields (upstream's "
                             "HuggingFaceTokenizer.Config): the tokenizer is hf_assets_path's tokenizer.json.")
        return typing.cast(TokenizerConfig, super().from_dict(data))


@dataclass(kw_only=True)
class ValidatorConfig(Section):
    """``[validator]``: upstream's ``Validator.Config`` (a0c831c49): an evaluation loop every
    ``freq`` steps (and at step 1), no gradients, the model in eval mode, over its own data."""

    section_name: typing.ClassVar[str] = "validator"

    enable: bool = False
    """Validate during training."""

    freq: int = 10
    """Validate at step 1 and every ``freq`` steps (upstream's ``should_validate``)."""

    steps: int = -1
    """Validation batches per validation (each a global batch of ``training.local_batch_size``
    per data-parallel rank), read from the start of the validation data at every validation
    (upstream builds its validation loader afresh in each ``validate()``), so every validation
    sees the same batches. -1 (upstream's default): one pass over a file dataset (upstream's
    ``infinite=False``), every whole global batch of it; the synthetic data is an endless
    stream, so -1 with it is a setup error when enabled."""

    dataloader: DataloaderConfig = field(default_factory=DataloaderConfig)
    """The validation data (upstream's default is ``c4_validation``, a download; here
    ``"synthetic"``: a stream of the seed + 1, held out from training's; or a file dataset)."""

    def __post_init__(self) -> None:
        if isinstance(self.dataloader, dict):
            self.dataloader = DataloaderConfig.from_dict(self.dataloader)
        super().__post_init__()
        self._require(self.freq >= 1, "freq", "must be >= 1")
        self._require(self.steps >= 1 or self.steps == -1, "steps", "must be >= 1, or -1 (the whole set)")
        self.dataloader.check()
        if self.enable and self.steps == -1 and self.dataloader.dataset == "synthetic":
            raise ValueError("validator.steps=-1 (one pass over the validation set) needs a finite dataset, and "
                             "validator.dataloader.dataset='synthetic' is an endless stream generated from the "
                             "seed: set validator.steps to the number of validation batches, or "
                             "validator.dataloader.dataset to a file dataset ('json', 'text', 'parquet', "
                             "'c4_test').")


@dataclass(kw_only=True)
class ProfilerConfig(Section):
    """``[profiler]``: upstream's ``Profiler.Config`` (a0c831c49): ``torch.profiler`` on a
    ``wait / warmup / active`` schedule of period ``profile_freq``, one Chrome trace per rank per
    window, and CUDA memory snapshots."""

    section_name: typing.ClassVar[str] = "profiler"

    enable_profiling: bool = False
    """Profile with ``torch.profiler``."""

    save_traces_folder: str = "profiling/traces"
    """Folder under ``job.dump_folder``: ``iteration_<step>/rank<r>_trace.json.gz`` per window."""

    profile_freq: int = 10
    """Steps per profiling cycle (``wait = profile_freq - warmup - active``)."""

    profiler_repeat: int | None = None
    """Cycles to profile (``torch.profiler.schedule``'s ``repeat``); None: every cycle."""

    profiler_skip_first: int | None = None
    """Steps skipped before the first cycle (``skip_first``)."""

    profiler_skip_first_wait: int | None = None
    """Skip the first cycle's wait (``skip_first_wait``)."""

    profiler_active: int = 1
    """Steps recorded per cycle."""

    profiler_warmup: int = 3
    """Warm-up steps before the recorded ones in each cycle."""

    enable_memory_snapshot: bool = False
    """Dump CUDA memory snapshots (``torch.cuda.memory._record_memory_history``); on CPU one
    start-up line says there are none."""

    memory_snapshot_freq: int | None = None
    """Upstream b5bcd76's: dump a memory snapshot every ``memory_snapshot_freq`` steps, whatever
    the trace schedule; None (the default) is ``profile_freq``, the cadence before the field."""

    save_memory_snapshot_folder: str = "profiling/memory_snapshot"
    """Folder under ``job.dump_folder`` of the snapshots."""

    memory_snapshot_max_entries: int = 1_000_000
    """Alloc/free events kept per snapshot (a ring buffer)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("profile_freq", "profiler_active"):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        self._require(self.profiler_warmup >= 0, "profiler_warmup", "must be >= 0")
        self._require(self.memory_snapshot_max_entries >= 1, "memory_snapshot_max_entries", "must be >= 1")
        self._require(self.memory_snapshot_freq is None or self.memory_snapshot_freq >= 1, "memory_snapshot_freq",
                      "must be >= 1, or None (profile_freq)")
        for name in ("profiler_repeat", "profiler_skip_first", "profiler_skip_first_wait"):
            self._require(getattr(self, name) is None or getattr(self, name) >= 0, name, "must be >= 0, or None")
        self._require(self.profile_freq >= self.profiler_warmup + self.profiler_active, "profile_freq",
                      f"must be >= profiler_warmup + profiler_active "
                      f"(= {self.profiler_warmup + self.profiler_active})")


# --------------------------------------------------------------------------------------
# torchtitan's sections.
# --------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class TrainingConfig(Section):
    """``[training]``: the training loop and its dtypes."""

    section_name: typing.ClassVar[str] = "training"

    local_batch_size: int | None = None  # resolved to an int (default 8)
    """Sequences per data-parallel rank per forward (per gradient-accumulation step); unset
    (None), 8, or ``num_tokens_per_microbatch_per_dp_rank / seq_len`` when that is set.
    Upstream June's field; August counts ``num_tokens_per_microbatch_per_dp_rank`` instead
    (``= local_batch_size * seq_len``), and either may be set."""

    global_batch_size: int | None = None  # resolved to an int (default -1)
    """Sequences per step over all ranks; unset (None) it is -1, or from ``num_tokens_per_train_step``;
    -1 means ``local_batch_size`` times the data-parallel degree. A larger value means gradient accumulation. August's
    ``num_tokens_per_train_step`` is ``global_batch_size * seq_len``."""

    seq_len: int | None = None  # resolved to an int (default 2048)
    """Tokens per sequence; unset (None), 2048 or ``max_context_length``. August's name is
    ``max_context_length``."""

    num_tokens_per_microbatch_per_dp_rank: int | None = None
    """Upstream b5bcd76's (#4121) token budget of one forward on one data-parallel rank
    (unset (None): computed, 16384 = 8 * 2048 by default): ``local_batch_size * seq_len``, the same setting counted in
    tokens; it must be a multiple of ``max_context_length`` (this library packs whole
    sequences). Pipeline parallelism: see ``docs/drop-in-august.md``."""

    num_tokens_per_train_step: int | None = None
    """Upstream b5bcd76's token budget of one optimizer step over all data-parallel ranks:
    ``global_batch_size * seq_len``. Unset (None, the default), it is computed from
    ``global_batch_size`` (-1 there gives -1 here); -1 means ``num_tokens_per_microbatch_per_dp_rank``
    times the data-parallel degree (upstream's default)."""

    max_context_length: int | None = None
    """Upstream b5bcd76's name of ``seq_len``; unset (None), ``seq_len``'s value (2048 by default)."""

    max_norm: float | int = 1.0
    """Gradient-norm clipping threshold over the global norm (0 disables clipping)."""

    steps: int = 10000
    """Number of optimizer steps."""

    enable_cpu_offload: bool = False
    """Keep parameters, gradients and optimizer state on the CPU between uses (FSDP offload).
    Not implemented by torchtitan_spmd yet: any value but the default is a setup error."""

    dtype: Literal["bfloat16", "float32"] = "float32"
    """Dtype of parameters, gradients and optimizer state: ``"float32"`` only here.
    Upstream's ``"bfloat16"`` (full bf16 training, no fp32 master copy) is
    not implemented by torchtitan_spmd yet: the trainer stops at setup naming this field. For
    bf16 compute use ``mixed_precision_param``."""

    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype of parameters under mixed precision (FSDP's ``param_dtype`` when
    parameters are sharded, ``torch.autocast`` under DDP or on one device)."""

    mixed_precision_reduce: Literal["float32"] = "float32"
    """Dtype of FSDP's gradient reductions under mixed precision."""

    disable_cuda_graphs: bool = False
    """Upstream b5bcd76's switch off CUDA-graph capture of the step. This library captures no
    CUDA graphs, so ``False`` is the only value it implements (``check_supported``).
    Not implemented by torchtitan_spmd yet: any value but the default is a setup error."""

    gc_freq: int = 50
    """Run Python's garbage collector every ``gc_freq`` steps."""

    gc_debug: bool = False
    """Collect garbage at every step to find reference cycles holding device tensors."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: ``"auto"`` picks CUDA (nccl) when available, else CPU (gloo).
    (This library's own field.)"""

    dataset: str | None = None
    """Deprecated: ``dataloader.dataset`` (torchtitan's spelling since a0c831c49). Set, it is
    moved there with a ``DeprecationWarning``."""

    dataset_path: str | None = None
    """Deprecated: ``dataloader.dataset_path``. Set, it is moved there with a ``DeprecationWarning``."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in _TOKEN_PAIRS and "_budget_sources" in self.__dict__:
            # After construction the field assigned last is its pair's source; the other follows.
            _resolve_token_budgets(self, written=name)

    def release_for_overrides(self, given: set[str]) -> None:
        """Store None in each pair's non-source member, and in the partner of each name in ``given``.

        For the config manager's copy that tyro rebuilds with overrides (see
        ``manager._release_token_partners``): the rebuilt section then sees only the members a
        fork wrote, and resolves the rest as at construction.
        """
        sources = self.__dict__.get("_budget_sources", {})
        for june, august in _PAIRS:
            source = sources.get(june, june)
            keep = {source} if not (given & {june, august}) else given & {june, august}
            for name in (june, august):
                if name not in keep:
                    object.__setattr__(self, name, None)

    def __post_init__(self) -> None:
        _resolve_token_budgets(self, written=None if "_budget_sources" not in self.__dict__ else "")
        super().__post_init__()
        for name in ("steps", "local_batch_size", "seq_len", "gc_freq"):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        self._require(
            self.global_batch_size == -1 or self.global_batch_size >= 1,
            "global_batch_size", "must be >= 1, or -1 for local_batch_size * data-parallel degree",
        )
        self._require_finite("max_norm", minimum=0, strict=False)


#: Each batch field and its upstream-August (b5bcd76, #4121) token counterpart: one setting.
_TOKEN_PAIRS: dict[str, str] = {
    "seq_len": "max_context_length",
    "local_batch_size": "num_tokens_per_microbatch_per_dp_rank",
    "global_batch_size": "num_tokens_per_train_step",
}
_TOKEN_PAIRS.update({v: k for k, v in list(_TOKEN_PAIRS.items())})
_BATCH_DEFAULTS = {"seq_len": 2048, "local_batch_size": 8, "global_batch_size": -1}


_PAIRS = (("seq_len", "max_context_length"), ("local_batch_size", "num_tokens_per_microbatch_per_dp_rank"),
          ("global_batch_size", "num_tokens_per_train_step"))


#: Upstream b5bcd76's own checks of its token fields (``TrainingConfig.__post_init__``), same words.
_AUGUST_RULES: dict[str, tuple[typing.Callable[[int], bool], str]] = {
    "num_tokens_per_microbatch_per_dp_rank": (lambda v: v > 0, "must be greater than 0"),
    "num_tokens_per_train_step": (lambda v: v == -1 or v > 0, "must be -1 or greater than 0"),
    "max_context_length": (lambda v: v > 0, "must be greater than 0"),
}


class _Derived(int):
    """A token-pair member this library filled in (a default, or computed from its partner).

    It reads as the plain int it is. At construction it gives way to a value given beside it
    for its partner: a copy of a section that passes every field back in, as tyro does with
    upstream's ``ConfigManager`` (``tyro.cli(..., default=config)`` with one member overridden
    on the command line) and as ``dataclasses.replace`` does, then means "the partner changed",
    not "the two disagree". (Found running b5bcd76's trainer on this library:
    ``--training.max_context_length 256`` over a config function that wrote 2048 was refused.)
    Two members the user gave still must agree.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return int.__repr__(self)


def _derived(value: int) -> int:
    return value if isinstance(value, _Derived) or isinstance(value, bool) else _Derived(value)


def _resolve_token_budgets(cfg: TrainingConfig, *, written: str | None) -> None:
    """Give each June batch field and its August token field one value.

    ``written`` None (construction): a pair with both members given must agree, else a
    ``ValueError`` names both; the member given is the pair's source (the June one when
    neither is, with its default). A member this library filled in (:class:`_Derived`) counts
    as given only when its partner is one too. Otherwise ``written`` (a field just assigned)
    becomes its pair's source. Each pair's other member is then computed from its source.
    """
    sources: dict[str, str] = cfg.__dict__.setdefault("_budget_sources", {})
    for name, (ok, rule) in _AUGUST_RULES.items():  # upstream b5bcd76's checks, in its words
        value = getattr(cfg, name)
        if isinstance(value, int) and not isinstance(value, (bool, _Derived)) and not ok(value):
            raise ValueError(f"training.{name} {rule}, got {value!r}.")
    for june, august in _PAIRS:
        for name in (june, august):
            value = getattr(cfg, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise TypeError(f"training.{name}: expected int, got {type(value).__name__} {value!r}.")
        if written is None:
            a, b = getattr(cfg, june), getattr(cfg, august)
            if isinstance(a, _Derived) and isinstance(b, _Derived):
                a = b = None  # both filled in before: the June default again, as at first
            elif isinstance(a, _Derived) and b is not None:
                a = None  # the partner was given: it decides
            elif isinstance(b, _Derived) and a is not None:
                b = None
            object.__setattr__(cfg, june, a)
            object.__setattr__(cfg, august, b)
            if a is not None and b is not None:
                expected = b if june == "seq_len" else _tokens_to_batch(cfg, june, august, b, a)
                if a != expected:
                    rule = ("one setting (upstream June's and August's names)" if june == "seq_len" else
                            f"one setting: {august} = {june} * seq_len (seq_len={cfg.seq_len})")
                    raise ValueError(f"training.{june}={a!r} and training.{august}={b!r} disagree; they are "
                                     f"{rule}. Set only one of them.")
            sources[june] = august if (b is not None and a is None) else june
            if a is None and b is None:
                object.__setattr__(cfg, june, _derived(_BATCH_DEFAULTS[june]))
        elif written in (june, august):
            sources[june] = written
        if sources[june] == june:
            a = getattr(cfg, june)
            object.__setattr__(cfg, august, _derived(a if june == "seq_len" or a == -1 else a * cfg.seq_len))
        else:
            b = getattr(cfg, august)
            object.__setattr__(cfg, june, _derived(b if june == "seq_len" else
                                                   _tokens_to_batch(cfg, june, august, b, None)))


def _tokens_to_batch(cfg: TrainingConfig, june: str, august: str, tokens: int, given: int | None) -> int:
    """Sequences of ``seq_len`` in an August token budget (``-1`` stays -1 for the step budget)."""
    if tokens == -1 and june == "global_batch_size":
        return -1
    if tokens <= 0:
        raise ValueError(f"training.{august} must be {'-1 or ' if june == 'global_batch_size' else ''}greater than 0, "
                         f"got {tokens!r}.")
    if tokens % cfg.seq_len:
        also = f" (training.{june}={given!r} is also set)" if given is not None else ""
        raise ValueError(f"training.{august}={tokens} is not a multiple of training.max_context_length "
                         f"(seq_len) = {cfg.seq_len}: this library packs whole sequences{also}.")
    return tokens // cfg.seq_len


_DEGREES = (
    "data_parallel_replicate_degree",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "context_parallel_degree",
    "expert_parallel_degree",
    "expert_tensor_parallel_degree",
)


@_legacy.accept_legacy_parallelism_kwargs  # compat hook
@dataclass(kw_only=True)
class ParallelismConfig(
    _legacy.LegacyParallelismMixin,  # compat hook
    Section,
):
    """``[parallelism]``: parallel degrees, their options, and the SPMD backend."""

    _field_checks: typing.ClassVar[dict[str, typing.Callable[[Any, str], Any]]] = {
        "spmd_backend": lambda value, where: _surface.check_backend_spelling(value, where),
    }

    section_name: typing.ClassVar[str] = "parallelism"

    data_parallel_replicate_degree: int = 1
    """Replicated data-parallel degree (DDP; the outer axis of HSDP when
    ``data_parallel_shard_degree > 1``). 1 disables it."""

    data_parallel_shard_degree: int = -1
    """Sharded data-parallel (FSDP) degree; -1 uses the ranks left over by the other
    degrees. Only this degree may be -1; 1 disables sharding."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """When FSDP frees gathered parameters after forward: ``"default"`` (FSDP's own
    choice), ``"always"`` or ``"never"``.
    Not implemented by torchtitan_spmd yet: any value but the default is a setup error."""

    enable_fsdp_symm_mem: bool = False
    """Use symmetric-memory communication for FSDP collectives (NVIDIA compute
    capability 9.0 or newer, or ROCm).
    Not implemented by torchtitan_spmd yet: any value but the default is a setup error."""

    tensor_parallel_degree: int = 1
    """Tensor-parallel degree (Megatron-style column/row sharding). 1 disables it."""

    disable_loss_parallel: bool = False
    """Gather the vocab-sharded logits before the loss instead of a vocab-parallel loss."""

    enable_async_tensor_parallel: bool = False
    """Overlap tensor-parallel communication with compute (needs ``compile.enable``).
    Not implemented by torchtitan_spmd yet: any value but the default is a setup error."""

    enable_sequence_parallel: bool = True
    """Shard norms and residual activations along the sequence dim when TP is on."""

    spmd_backend: SpmdBackendSpelling = field(default_factory=lambda: _surface.get_surface().default_backend)
    """How parallelism is expressed: ``"default"`` (DTensor on TP/EP axes plus FSDP2; upstream's
    August spelling ``"partial_dtensor"``), ``"full_dtensor"`` (every tensor a DTensor on the
    multi-axis mesh) or ``"spmd_types"`` (plain local tensors typed with ``spmd_types``).
    Read back as written; the default follows the fork's surface (:mod:`.surface`: ``"default"``
    under ``june``, ``"spmd_types"`` under ``august``)."""

    pipeline_parallel_degree: int = 1
    """Pipeline-parallel degree: the number of physical stages' ranks (looped schedules
    put several virtual stages on one rank). 1 disables it."""

    module_fqns_per_model_part: list[list[str]] | None = None
    """Explicit split of the model for pipelining: one list of module names per model
    chunk, e.g. ``[["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]``."""

    pipeline_parallel_first_stage_less_layers: int = 1
    """Layers fewer on the first stage, which also holds the embedding."""

    pipeline_parallel_last_stage_less_layers: int = 1
    """Layers fewer on the last stage, which also holds the output projection."""

    pipeline_parallel_layers_per_stage: int | None = None
    """Layers per (virtual) stage; None infers it from the model, schedule and degree."""

    pipeline_parallel_schedule: str = "1F1B"
    """Name of a ``torch.distributed.pipelining`` schedule, e.g. ``"1F1B"`` or ``"Interleaved1F1B"``."""

    pipeline_parallel_schedule_csv: str | None = ""
    """Path of a CSV file describing a custom pipeline schedule (one row per pp rank of compute
    actions such as ``0F1``, run by torch's ``_PipelineScheduleRuntime``); empty for none.
    ``pipeline_parallel_schedule`` still sizes and places the stages: a schedule's name, or
    ``PipelineScheduleSingle`` / ``PipelineScheduleMulti`` (one stage a rank / several)."""

    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline microbatch; ``local_batch_size`` must be a multiple of it (June's
    field; August's is ``num_pp_microbatches``, with which 1 keeps upstream's microbatch)."""

    num_pp_microbatches: int | None = field(default_factory=lambda: _surface.get_surface().num_pp_microbatches)
    """Upstream b5bcd76's (#3856, #4121) pipeline microbatches per data-parallel rank and
    gradient-accumulation iteration, each ``training.num_tokens_per_microbatch_per_dp_rank`` tokens
    (``local_batch_size`` sequences): an iteration is ``num_pp_microbatches * local_batch_size``
    sequences. The default follows the surface: upstream's ``1`` under ``august``, None under
    ``june``, where June's split holds (``local_batch_size`` sequences an iteration in microbatches
    of ``pipeline_parallel_microbatch_size``). Ignored without pipeline parallelism, as upstream.
    See ``techniques.pipeline_parallel.pipeline_rows``."""

    context_parallel_degree: int = 1
    """Context-parallel degree (sequence split across ranks inside attention). 1 disables it."""

    context_parallel_load_balancer: str | None = "headtail"
    """Context-parallel load balancing: ``"headtail"`` (SDPA), ``"ptrr"`` (FlexAttention)
    or None for none. The empty string is rejected."""

    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How context-parallel attention exchanges key/value shards (removed upstream after
    a0c831c49; kept here for June forks)."""

    context_parallel_ptrr_mask_key: str | None = None
    """Upstream b5bcd76's key of the mask the ``"ptrr"`` load balancer is built from; only
    meaningful with ``"ptrr"``, which this library does not run (None only).
    Not implemented by torchtitan_spmd yet: any value but the default is a setup error."""

    expert_parallel_degree: int = 1
    """Expert-parallel degree for MoE layers. Not a factor of the world size: it reuses
    the ranks of ``dp_shard * cp * tp``, which it must divide. 1 disables it."""

    expert_tensor_parallel_degree: int = 1
    """Tensor-parallel degree of the experts under expert parallelism: 1 or
    ``tensor_parallel_degree`` (torchtitan's rule before a0c831c49, which dropped the field);
    only 1 runs (checked at setup)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in _DEGREES:
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        self._require(
            self.data_parallel_shard_degree >= 1 or self.data_parallel_shard_degree == -1,
            "data_parallel_shard_degree", "must be >= 1, or -1 to infer it",
        )
        for name in ("pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers"):
            self._require(getattr(self, name) >= 0, name, "must be >= 0")
        self._require(self.pipeline_parallel_microbatch_size >= 1, "pipeline_parallel_microbatch_size",
                      "must be >= 1")
        self._require(
            self.pipeline_parallel_layers_per_stage is None or self.pipeline_parallel_layers_per_stage >= 1,
            "pipeline_parallel_layers_per_stage", "must be >= 1, or None to infer it",
        )
        self._require(
            self.context_parallel_load_balancer != "", "context_parallel_load_balancer",
            "cannot be the empty string (use None to disable load balancing)",
        )
        self._require(self.num_pp_microbatches is None or self.num_pp_microbatches >= 1,
                      "num_pp_microbatches", "must be >= 1, or None (not set)")
        if self.enable_fsdp_symm_mem and not _symm_mem_capable():
            raise ValueError(
                "parallelism.enable_fsdp_symm_mem=True needs a CUDA device of compute "
                "capability 9.0 or newer (or ROCm)."
            )

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "spmd_backend":
            value = _surface.check_backend_spelling(value)
            _surface.warn_backend_spelling(value)
        super().__setattr__(name, value)

    @property
    def backend_name(self) -> str:
        """The registry's name of :attr:`spmd_backend` (``"partial_dtensor"`` -> ``"default"``)."""
        return _surface.canonical_backend(self.spmd_backend)


def _symm_mem_capable() -> bool:
    import torch

    if not torch.cuda.is_available():
        return False
    return torch.version.hip is not None or torch.cuda.get_device_capability() >= (9, 0)


@dataclass(kw_only=True)
class CheckpointConfig(Section):
    """``[checkpoint]``: torchtitan's ``CheckpointManager.Config``."""

    section_name: typing.ClassVar[str] = "checkpoint"

    enable: bool = False
    """Save (and resume from) checkpoints."""

    folder: str = "checkpoint"
    """Checkpoint folder, relative to the dump folder."""

    interval: int = 500
    """Save every ``interval`` steps."""

    initial_load_path: str | None = None
    """Checkpoint to start from when the run's own folder holds none (a full path,
    including the step folder)."""

    initial_load_model_only: bool = True
    """From ``initial_load_path`` load only the model, not optimizer or scheduler state."""

    initial_load_in_hf: bool = False
    """``initial_load_path`` is a Hugging Face safetensors checkpoint (model only)."""

    initial_load_in_hf_quantized: bool = False
    """The Hugging Face checkpoint has quantized keys to dequantize on load.
    Not implemented by torchtitan_spmd yet: any value but the default is a setup error."""

    last_save_model_only: bool = True
    """The final save holds only the model (loadable with ``weights_only=True``)."""

    last_save_in_hf: bool = False
    """Write the final save as Hugging Face safetensors (needs ``last_save_model_only``)."""

    export_dtype: Literal["float16", "bfloat16", "float32"] = "float32"
    """Dtype of the final model-only save."""

    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Blocking saves (``"disabled"``), ``async_save`` on a thread (``"async"``), or a
    separate process with pinned shared memory (``"async_with_pinned_mem"``).
    Not implemented by torchtitan_spmd yet: ``"async_with_pinned_mem"`` (a setup error)."""

    keep_latest_k: int = 10
    """Keep only the newest ``k`` checkpoints (0 keeps all; 1 is not allowed)."""

    load_step: int = -1
    """Step to load; -1 loads the newest."""

    exclude_from_loading: list[str] = field(default_factory=list)
    """State keys not to load, e.g. ``optimizer,lr_scheduler`` on the command line;
    never ``model``."""

    enable_first_step_checkpoint: bool = False
    """Also save right after the first step, to check that saving works."""

    create_seed_checkpoint: bool = False
    """Initialise the unsharded model, save it as a seed checkpoint and exit (one rank)."""

    load_only: bool = False
    """Load checkpoints but never save."""

    trust_checkpoint_folder: bool = False
    """Trust whoever wrote the checkpoint folder being loaded: read its DCP ``.metadata``
    with plain ``pickle`` and its non-tensor items with ``torch.load(weights_only=False)``
    (DCP's own behaviour), so any code the files name runs. Off: both are read by restricted
    unpicklers that refuse, in one line, any global outside DCP's metadata classes (see
    ``docs/checkpoint-trust.md``). Only for metadata the allow-list misses (a newer torch's
    class) in a folder you trust; the load warns, naming the folder."""

    lora_adapters_only: bool = False
    """With a ``LoRAConverter``: checkpoints hold the model's LoRA adapters alone (with the
    optimizer and the rest of the training state), not the frozen base, which a resume takes
    again from where the run started (``initial_load_in_hf``, or the initialisation of
    ``debug.seed``; a resume onto another base is a setup error, and so is a DCP
    ``initial_load_path``, which a resume does not reload). The seed checkpoint and the
    Hugging Face export (``last_save_in_hf``, the adapters merged) hold the whole model. This
    library's field; upstream saves the whole model."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(bool(self.folder.strip()), "folder", "cannot be empty")
        self._require("\0" not in self.folder, "folder", "cannot contain a NUL character")
        self._require(
            re.fullmatch(r"step-\d+(\.partial)?", os.path.basename(os.path.normpath(self.folder))) is None,
            "folder", "cannot be named like a checkpoint (step-N or step-N.partial): checkpoints go inside it",
        )
        self._require(self.interval >= 1, "interval", "must be >= 1")
        self._require(
            self.keep_latest_k == 0 or self.keep_latest_k >= 2, "keep_latest_k",
            "must be 0 (keep all) or >= 2 (the newest may still be being written)",
        )
        self._require("model" not in self.exclude_from_loading, "exclude_from_loading",
                      "cannot contain 'model'")
        self._require(self.load_step >= -1, "load_step", "must be a step >= 0, or -1 for the newest")
        self._require(not (self.lora_adapters_only and self.initial_load_path and not self.initial_load_in_hf),
                      "lora_adapters_only", "cannot be used with a DCP initial_load_path: a resume from an "
                      "adapters-only checkpoint reloads its base only from a Hugging Face folder "
                      "(initial_load_in_hf) or the initialisation; save full checkpoints instead")


@dataclass(kw_only=True)
class ActivationCheckpointConfig(Section):
    """``[activation_checkpoint]``: recompute activations in backward to save memory."""

    section_name: typing.ClassVar[str] = "activation_checkpoint"

    mode: Literal["selective", "full", "memory_budget", "none"] = "selective"
    """Which activations to recompute: ``"selective"``, ``"full"``, ``"memory_budget"``
    (compiler-chosen) or ``"none"``.
    Not implemented by torchtitan_spmd yet: ``"memory_budget"`` (a setup error)."""

    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = field(
        default_factory=lambda: ["moe.router.gate"]
    )
    """Under per-op selective checkpointing, matmuls with the shapes of these Linear
    modules are always recomputed (any matmul of that shape, not only these modules)."""

    early_stop: bool = False
    """Stop recomputing once every needed activation has been rematerialised."""

    memory_budget: float = 0.5
    """For ``mode="memory_budget"``: 0.0 is the memory of full checkpointing, 1.0 that
    of no checkpointing.
    Not implemented by torchtitan_spmd yet: any value but the default is a setup error."""

    visualize_memory_budget_pareto: bool = False
    """Write an SVG of the runtime/memory trade-off over budgets to the dump folder.
    Not implemented by torchtitan_spmd yet: any value but the default is a setup error."""

    preserve_rng_state: bool = True
    """Stash and restore the RNG state around each checkpoint, for results identical
    to a run without checkpointing."""

    determinism_check: str = "default"
    """The determinism check of ``torch.utils.checkpoint``."""

    debug: bool = False
    """Record ``torch.utils.checkpoint`` debug information (slower)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(0.0 <= self.memory_budget <= 1.0, "memory_budget", "must be in [0, 1]")


@dataclass(kw_only=True)
class CompileConfig(Section):
    """``[compile]``: ``torch.compile``."""

    section_name: typing.ClassVar[str] = "compile"

    enable: bool = False
    """Compile the components below."""

    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile, e.g. ``model,loss``."""

    backend: str = "inductor"
    """The ``torch.compile`` backend."""

    enable_async_tensor_parallel: bool = False
    """Upstream b5bcd76's place (#4045) of ``parallelism.enable_async_tensor_parallel``: one
    setting (setting the two differently is a setup error naming both).
    Not implemented by torchtitan_spmd yet: any value but the default is a setup error."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # upstream b5bcd76's check (#4045), in its words, then the fields as set here
        if self.enable_async_tensor_parallel and not (self.enable and "model" in self.components):
            raise ValueError("Async TP requires 'model' in --compile.components and --compile.enable "
                             f"(compile.enable_async_tensor_parallel=True with compile.enable={self.enable}, "
                             f"compile.components={self.components!r}).")


#: About 31 years: far past any job, well inside what ``datetime.timedelta`` holds (larger
#: values raise OverflowError there).
_MAX_TIMEOUT_S = 10**9

#: torch.manual_seed's largest seed.
_MAX_SEED = 2**64 - 1


@dataclass(kw_only=True)
class CommConfig(Section):
    """``[comm]``: process-group set-up and communication timeouts."""

    section_name: typing.ClassVar[str] = "comm"

    init_timeout_seconds: int = 300
    """Timeout of collectives during initialisation and the first step."""

    train_timeout_seconds: int = 100
    """Timeout of collectives after the first step (usually tighter)."""

    trace_buf_size: int = 20000
    """Entries of the NCCL flight recorder's ring buffer; 0 turns it off."""

    save_traces_folder: str = "comm_traces"
    """Folder of the flight recorder's trace files."""

    save_traces_file_prefix: str = "rank_"
    """File-name prefix of the flight recorder's trace files."""

    mode: Literal["default", "fake_backend", "local_tensor", "torchcomms"] = "default"
    """``"default"`` (real communication), ``"fake_backend"`` (dry run), ``"local_tensor"``
    (one process simulating every rank) or ``"torchcomms"``. The two simulated modes take the
    world size from the environment variable ``NGPU``, as upstream's ``run_train.sh``; see
    ``docs/dry-run.md``. Not implemented by torchtitan_spmd yet: ``"torchcomms"`` (a setup error)."""

    fake_device_memory_gib: float = 80.0
    """This library's: the device memory (GiB) that ``mode="fake_backend"``'s report sets each
    rank's peak estimate against."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("init_timeout_seconds", "train_timeout_seconds"):
            self._require(1 <= getattr(self, name) <= _MAX_TIMEOUT_S, name, f"must be in [1, {_MAX_TIMEOUT_S}]")
        self._require(self.trace_buf_size >= 0, "trace_buf_size", "must be >= 0 (0 turns the recorder off)")
        self._require_finite("fake_device_memory_gib", minimum=0, strict=True)


@dataclass(kw_only=True)
class DebugConfig(Section):
    """``[debug]``: seeds, determinism and checking switches."""

    section_name: typing.ClassVar[str] = "debug"

    seed: int | None = None
    """Base random seed; None lets rank 0 pick one."""

    spmd_typechecking: bool = False
    """Type-check the forward pass with ``spmd_types``' checker. Only the ``spmd_types``
    backend is checked; under pipeline parallelism each stage's forward is checked on its own."""

    spmd_typechecking_steps: int | None = None
    """With ``spmd_typechecking``: type-check only the first N steps this process runs
    (a resumed run checks its first N again), then train unchecked; a static step's
    types do not change. None checks every step. Needs ``spmd_typechecking`` (a
    warning otherwise)."""

    deterministic: bool = False
    """Use deterministic algorithms where they exist (slower)."""

    deterministic_warn_only: bool = False
    """With ``deterministic``, warn about ops with no deterministic version instead of failing.
    Not implemented by torchtitan_spmd yet: any value but the default is a setup error."""

    moe_force_load_balance: bool = False
    """Route tokens round-robin so every expert gets the same load (MoE debugging)."""

    detect_anomaly: bool = False
    """Run autograd anomaly detection to locate NaN/Inf gradients (slow).
    Not implemented by torchtitan_spmd yet: any value but the default is a setup error."""

    batch_invariant: bool = False
    """Use batch-invariant kernels and a fixed collective reduction order.
    Not implemented by torchtitan_spmd yet: any value but the default is a setup error."""

    print_config: bool = False
    """Print the resolved config at start-up."""

    save_config_file: str | None = None
    """Save the resolved config to this file under the dump folder."""

    enable_structured_logging: bool = True
    """Write the structured per-rank trace log."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(self.seed is None or 0 <= self.seed <= _MAX_SEED, "seed",
                      "must be >= 0 and < 2**64 (torch.manual_seed's range), or None")
        self._require(self.spmd_typechecking_steps is None or self.spmd_typechecking_steps >= 1,
                      "spmd_typechecking_steps",
                      "must be >= 1 (type-check the first N steps), or None (every step)")
