"""The job configuration: one dataclass per section, mirroring torchtitan's names.

Every section validates itself on construction (``__post_init__``), so a bad
value is rejected with a ``ValueError`` or ``TypeError`` that names the field,
the bad value and the valid choices, whether it came from Python, a TOML file,
a plain dict or the command line.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

from torchtitan_spmd._errors import stacklevel_outside_library, suggest

# Lines marked "compat hook" call into compat/ for the legacy `full_dtensor`
# spellings; deleting compat/ and those lines removes legacy support.
from torchtitan_spmd.compat import legacy as _legacy  # compat hook

SpmdBackend = Literal["default", "full_dtensor", "spmd_types"]

#: The valid values of ``parallelism.spmd_backend``, in documentation order.
SPMD_BACKENDS: tuple[str, ...] = get_args(SpmdBackend)

#: Spellings written by newer torchtitan releases, normalised on load.
#: ``"partial_dtensor"`` is upstream's later name for ``"default"``.
SPMD_BACKEND_ALIASES: dict[str, str] = {"partial_dtensor": "default"}


class SpmdTypecheckingWarning(UserWarning):
    """``debug.spmd_typechecking`` was set where it has no effect."""


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _check_value(owner: str, name: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widened to float)."""
    where = f"{owner}.{name}"
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ValueError(
                f"{where}: invalid value {value!r}; valid choices are "
                f"{', '.join(repr(c) for c in choices)}.{suggest(value, choices)}"
            )
        return value
    if origin in (typing.Union, types.UnionType):
        members = get_args(tp)
        if value is None and type(None) in members:
            return None
        errors = []
        for member in members:
            if member is type(None):
                continue
            try:
                return _check_value(owner, name, value, member)
            except (TypeError, ValueError) as err:
                errors.append(err)
        raise TypeError(
            f"{where}: expected {' or '.join(_type_name(m) for m in members)}, "
            f"got {type(value).__name__} {value!r}."
        )
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, bool):
        raise TypeError(f"{where}: expected {tp.__name__}, got bool {value!r}.")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise TypeError(f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r}.")
    return value


class _Section:
    """Shared behaviour of config sections: type validation and dict round-trips."""

    #: The section's name in TOML and on the command line, e.g. ``"parallelism"``.
    section_name: typing.ClassVar[str] = ""

    def _validate_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            object.__setattr__(
                self, f.name, _check_value(self.section_name, f.name, value, hints[f.name])
            )

    def __post_init__(self) -> None:
        self._validate_types()

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of this section's fields, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: typing.Mapping[str, Any]) -> Any:
        """Build the section from a plain mapping, rejecting unknown keys.

        Keys may use hyphens or underscores. Legacy keys are translated (with a
        ``DeprecationWarning``) by the compat layer.
        """
        if not isinstance(data, typing.Mapping):
            raise TypeError(
                f"[{cls.section_name}] must be a table/mapping, got {type(data).__name__}."
            )
        normalised = {str(k).replace("-", "_"): v for k, v in data.items()}
        normalised = _legacy.translate_legacy_section(cls.section_name, normalised)  # compat hook
        known = cls.field_names()
        for key in normalised:
            if key not in known:
                raise ValueError(
                    f"[{cls.section_name}]: unknown key {key!r}; valid keys are "
                    f"{', '.join(known)}.{suggest(key, known)}"
                )
        return cls(**normalised)

    def to_dict(self) -> dict[str, Any]:
        """This section's values as a plain dict."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]


@dataclass
class JobSection(_Section):
    """``[job]``: where the run reads its config and writes its outputs."""

    section_name: typing.ClassVar[str] = "job"

    config_file: str | None = None
    """Path of the TOML file this config was loaded from (``--job.config_file``)."""

    dump_folder: str = "./outputs"
    """Folder for logs and checkpoints."""

    description: str = "torchtitan_spmd job"
    """Free-form description printed at start-up."""


@dataclass
class ModelConfig(_Section):
    """``[model]``: which model and flavour to build."""

    section_name: typing.ClassVar[str] = "model"

    name: str = "llama3"
    """Model family, a key of the model registry (``"llama3"`` or ``"qwen3"``)."""

    flavor: str = "debugmodel"
    """Model size preset, e.g. ``"debugmodel"`` (about 6M parameters)."""


@dataclass
class OptimizerConfig(_Section):
    """``[optimizer]``: AdamW settings."""

    section_name: typing.ClassVar[str] = "optimizer"

    name: Literal["AdamW"] = "AdamW"
    """Optimizer class. Only ``"AdamW"`` is built in."""

    lr: float = 8e-4
    """Peak learning rate."""

    eps: float = 1e-8
    """AdamW epsilon."""

    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""


@dataclass
class LRSchedulerConfig(_Section):
    """``[lr_scheduler]``: linear warmup, then cosine decay."""

    section_name: typing.ClassVar[str] = "lr_scheduler"

    warmup_steps: int = 2
    """Steps of linear warmup from 0 to ``optimizer.lr``."""

    min_lr_factor: float = 0.1
    """Cosine decay ends at ``min_lr_factor * optimizer.lr``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.warmup_steps < 0:
            raise ValueError(f"lr_scheduler.warmup_steps must be >= 0, got {self.warmup_steps}.")
        if not 0.0 <= self.min_lr_factor <= 1.0:
            raise ValueError(
                f"lr_scheduler.min_lr_factor must be in [0, 1], got {self.min_lr_factor}."
            )


@dataclass
class TrainingConfig(_Section):
    """``[training]``: the training loop."""

    section_name: typing.ClassVar[str] = "training"

    steps: int = 10
    """Number of optimizer steps."""

    local_batch_size: int = 4
    """Sequences per data-parallel rank per step."""

    seq_len: int = 256
    """Tokens per sequence."""

    max_norm: float = 1.0
    """Gradient-norm clipping threshold over the global norm (0 disables clipping)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: ``"auto"`` picks CUDA (nccl) when available, else CPU (gloo)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("steps", "local_batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"training.{name} must be >= 1, got {getattr(self, name)}.")
        if self.max_norm < 0:
            raise ValueError(f"training.max_norm must be >= 0, got {self.max_norm}.")


@_legacy.accept_legacy_parallelism_kwargs  # compat hook
@dataclass
class ParallelismConfig(
    _legacy.LegacyParallelismMixin,  # compat hook
    _Section,
):
    """``[parallelism]``: parallel degrees and the SPMD backend."""

    section_name: typing.ClassVar[str] = "parallelism"

    data_parallel_replicate_degree: int = 1
    """Replicated data-parallel degree (the outer, DDP-like axis of HSDP)."""

    data_parallel_shard_degree: int = -1
    """Sharded data-parallel (FSDP) degree. -1 infers it from the world size and the other degrees."""

    context_parallel_degree: int = 1
    """Context-parallel degree (sequence split across ranks in attention)."""

    tensor_parallel_degree: int = 1
    """Tensor-parallel degree (Megatron-style column/row sharding)."""

    pipeline_parallel_degree: int = 1
    """Pipeline-parallel degree."""

    expert_parallel_degree: int = 1
    """Expert-parallel degree for MoE layers; reuses the ranks of dp_shard*cp*tp."""

    enable_sequence_parallel: bool = True
    """Shard norms and residual activations along the sequence dim when TP is on."""

    disable_loss_parallel: bool = False
    """Gather the vocab-sharded logits before the loss instead of a vocab-parallel loss."""

    spmd_backend: SpmdBackend = "default"
    """How parallelism is expressed: ``"default"`` (DTensor on TP/EP axes plus FSDP2),
    ``"full_dtensor"`` (every tensor a DTensor on the multi-axis mesh) or
    ``"spmd_types"`` (plain local tensors typed with ``spmd_types``)."""

    def __post_init__(self) -> None:
        if isinstance(self.spmd_backend, str):
            self.spmd_backend = SPMD_BACKEND_ALIASES.get(self.spmd_backend, self.spmd_backend)  # type: ignore[assignment]
        super().__post_init__()
        for name in (
            "data_parallel_replicate_degree",
            "context_parallel_degree",
            "tensor_parallel_degree",
            "pipeline_parallel_degree",
            "expert_parallel_degree",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"parallelism.{name} must be >= 1, got {getattr(self, name)}.")
        if self.data_parallel_shard_degree < 1 and self.data_parallel_shard_degree != -1:
            raise ValueError(
                "parallelism.data_parallel_shard_degree must be >= 1, or -1 to infer it, "
                f"got {self.data_parallel_shard_degree}."
            )

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "spmd_backend" and isinstance(value, str):
            value = SPMD_BACKEND_ALIASES.get(value, value)
            _check_value(self.section_name, name, value, SpmdBackend)
        super().__setattr__(name, value)


@dataclass
class DebugConfig(_Section):
    """``[debug]``: reproducibility and checking switches."""

    section_name: typing.ClassVar[str] = "debug"

    seed: int | None = None
    """Random seed for weight initialisation and data order. None picks 0."""

    deterministic: bool = False
    """Use deterministic algorithms (``torch.use_deterministic_algorithms``)."""

    spmd_typechecking: bool = False
    """Type-check the forward pass with ``spmd_types``' checker.
    Only the ``spmd_types`` backend is checked; incompatible with pipeline parallelism."""


@dataclass
class MetricsConfig(_Section):
    """``[metrics]``: logging."""

    section_name: typing.ClassVar[str] = "metrics"

    log_freq: int = 1
    """Log every ``log_freq`` steps (and always the last step)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.log_freq < 1:
            raise ValueError(f"metrics.log_freq must be >= 1, got {self.log_freq}.")


@dataclass
class CommConfig(_Section):
    """``[comm]``: process-group set-up."""

    section_name: typing.ClassVar[str] = "comm"

    init_timeout_seconds: int = 300
    """Timeout for process-group initialisation and the start-up config check."""


_SECTIONS: dict[str, type[_Section]] = {
    cls.section_name: cls
    for cls in (
        JobSection,
        ModelConfig,
        OptimizerConfig,
        LRSchedulerConfig,
        TrainingConfig,
        ParallelismConfig,
        DebugConfig,
        MetricsConfig,
        CommConfig,
    )
}


@dataclass
class JobConfig:
    """The root configuration: one attribute per section."""

    job: JobSection = field(default_factory=JobSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    comm: CommConfig = field(default_factory=CommConfig)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(
                    f"JobConfig.{name} must be a {cls.__name__}, "
                    f"got {type(getattr(self, name)).__name__}."
                )
        self.validate()

    def validate(self) -> None:
        """Check rules that span sections. Call again after mutating sections."""
        if self.debug.spmd_typechecking:
            if self.parallelism.pipeline_parallel_degree > 1:
                raise ValueError(
                    "debug.spmd_typechecking=True is not supported with "
                    f"parallelism.pipeline_parallel_degree={self.parallelism.pipeline_parallel_degree}; "
                    "set pipeline_parallel_degree=1 or turn spmd_typechecking off."
                )
            if self.parallelism.spmd_backend != "spmd_types":
                warnings.warn(
                    "debug.spmd_typechecking=True has no effect with "
                    f"parallelism.spmd_backend={self.parallelism.spmd_backend!r}; "
                    "only the 'spmd_types' backend is type-checked.",
                    SpmdTypecheckingWarning,
                    stacklevel=stacklevel_outside_library(),
                )

    @classmethod
    def section_types(cls) -> dict[str, type[_Section]]:
        """Map of section name to its dataclass."""
        return dict(_SECTIONS)

    @classmethod
    def from_dict(cls, data: typing.Mapping[str, Any]) -> JobConfig:
        """Build a config from nested plain dicts (``{"parallelism": {...}, ...}``).

        Unknown sections or keys raise ``ValueError`` with a close-match suggestion.
        """
        if not isinstance(data, typing.Mapping):
            raise TypeError(f"JobConfig.from_dict expects a mapping, got {type(data).__name__}.")
        sections: dict[str, Any] = {}
        for raw_name, table in data.items():
            name = str(raw_name).replace("-", "_")
            if name not in _SECTIONS:
                raise ValueError(
                    f"unknown config section [{raw_name}]; valid sections are "
                    f"{', '.join(_SECTIONS)}.{suggest(name, _SECTIONS)}"
                )
            sections[name] = _SECTIONS[name].from_dict(table)
        return cls(**sections)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The whole config as nested plain dicts (None values kept)."""
        return {name: getattr(self, name).to_dict() for name in _SECTIONS}
