"""``JobConfig``: this library's root config, one attribute per section.

A fork may use its own root dataclass instead (embedding these sections);
``ConfigManager`` parses any dataclass root.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any

from torchtitan_spmd._errors import suggest, warn_at_user_line

# Lines marked "compat hook" call into compat/ for the legacy spellings.
from torchtitan_spmd.compat import legacy as _legacy  # compat hook

from ._section import check_value, reject_unknown_attribute
from .activation_checkpoint import (
    ActivationCheckpointing,
    SelectiveAC,
    ac_section,
    activation_checkpoint_type,
    is_ac_value,
)
from .backends import backend, backend_names
from .configs import (
    ActivationCheckpointConfig,
    CheckpointConfig,
    CommConfig,
    CompileConfig,
    DataloaderConfig,
    DebugConfig,
    JobSection,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    ProfilerConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidatorConfig,
)
from .fault_tolerance import FaultToleranceConfig
from .surface import get_surface

__all__ = ["JobConfig", "SpmdTypecheckingWarning"]


class SpmdTypecheckingWarning(UserWarning):
    """``debug.spmd_typechecking`` (or ``spmd_typechecking_steps``) was set where it has no effect."""


_SECTIONS: dict[str, type[Any]] = {
    cls.section_name: cls
    for cls in (
        JobSection,
        ModelConfig,
        OptimizerConfig,
        LRSchedulerConfig,
        TrainingConfig,
        TokenizerConfig,
        DataloaderConfig,
        ParallelismConfig,
        CheckpointConfig,
        ActivationCheckpointConfig,
        CompileConfig,
        CommConfig,
        DebugConfig,
        MetricsConfig,
        ValidatorConfig,
        ProfilerConfig,
        FaultToleranceConfig,
    )
}


def _default_activation_checkpoint() -> ActivationCheckpointConfig | ActivationCheckpointing.Config:
    """The surface's default: June's section, or upstream b5bcd76's ``SelectiveAC.Config()`` (the same policy)."""
    return SelectiveAC.Config() if get_surface().activation_checkpoint_policies else ActivationCheckpointConfig()


#: The root's own fields (upstream's ``Trainer.Config`` fields that are not sections), with
#: their types: a top-level key in a TOML file or ``from_dict``, ``--name`` on the command line.
_ROOT_FIELDS: dict[str, Any] = {"hf_assets_path": str | None}


@dataclass(kw_only=True)
class JobConfig:
    """The root configuration: one attribute per section, and upstream's root ``hf_assets_path``."""

    hf_assets_path: str | None = None
    """A Hugging Face assets folder (upstream's ``Trainer.Config.hf_assets_path``, a0c831c49; it was
    ``model.hf_assets_path`` before, still accepted with a ``DeprecationWarning``): its
    ``tokenizer.json`` (and ``tokenizer_config.json`` for BOS/EOS) is the tokenizer, through the
    ``tokenizers`` package (``pip install -e ".[hf]"``), and its weights the Hugging Face
    checkpoint of ``checkpoint.initial_load_in_hf``. None (this library's default; upstream's is
    ``"./tests/assets/tokenizer"``, a path inside its repository): the built-in byte tokenizer."""

    job: JobSection = field(default_factory=JobSection)
    """``[job]``: legacy TOML source and output folder."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """``[model]``: model family and size preset."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """``[optimizer]``: AdamW settings."""

    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    """``[lr_scheduler]``: warmup and decay."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    """``[training]``: the training loop."""

    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """``[tokenizer]``: upstream's (field-less) tokenizer section; the tokenizer is ``hf_assets_path``'s."""

    dataloader: DataloaderConfig = field(default_factory=DataloaderConfig)
    """``[dataloader]``: the training data."""

    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """``[parallelism]``: degrees and the SPMD backend."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """``[checkpoint]``: saving and loading."""

    # The annotation is a call, evaluated by typing.get_type_hints (tyro) only: tyro is imported then.
    activation_checkpoint: activation_checkpoint_type() = field(  # type: ignore[valid-type]
        default_factory=_default_activation_checkpoint)
    """``[activation_checkpoint]``: recomputation in backward. June's section (``mode``) or upstream
    b5bcd76's policy configs (``SelectiveAC.Config()``, ``FullAC.Config()``, ``MemoryBudgetAC.Config()``)
    or None, read back as written (:mod:`.activation_checkpoint`); the default follows the surface."""

    compile: CompileConfig = field(default_factory=CompileConfig)
    """``[compile]``: ``torch.compile``."""

    comm: CommConfig = field(default_factory=CommConfig)
    """``[comm]``: process groups and timeouts."""

    debug: DebugConfig = field(default_factory=DebugConfig)
    """``[debug]``: seeds, determinism, type checking."""

    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """``[metrics]``: logging."""

    validator: ValidatorConfig = field(default_factory=ValidatorConfig)
    """``[validator]``: evaluation during training."""

    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    """``[profiler]``: ``torch.profiler`` traces and memory snapshots."""

    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    """``[fault_tolerance]``: torchft replica groups (upstream's ``FaultTolerance``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        reject_unknown_attribute(self, name, "the root config")
        super().__setattr__(name, value)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            if name == "activation_checkpoint":
                self._check_activation_checkpoint()
            elif not isinstance(getattr(self, name), cls):
                raise TypeError(
                    f"JobConfig.{name} must be a {cls.__name__}, "
                    f"got {type(getattr(self, name)).__name__}."
                )
        self.validate()

    def validate(self) -> None:
        """Check every section's fields again, then the rules that span sections.

        Runs on construction; call again after mutating sections (the trainer does).
        """
        self._check_activation_checkpoint()
        for name in _SECTIONS:
            if getattr(self, name) is not None:  # activation_checkpoint=None: upstream b5bcd76's "none"
                getattr(self, name).check()
        _legacy.move_renamed_fields(self)  # compat hook: training.dataset* -> dataloader.*, model.hf_assets_path
        for name, tp in _ROOT_FIELDS.items():
            object.__setattr__(self, name, check_value(name, getattr(self, name), tp))
        self.dataloader.check()
        if self.debug.spmd_typechecking:
            if not backend(self.parallelism.spmd_backend).typechecking:
                checked = [name for name in backend_names() if backend(name).typechecking]
                warn_at_user_line(
                    "debug.spmd_typechecking=True has no effect with "
                    f"parallelism.spmd_backend={self.parallelism.spmd_backend!r}; "
                    f"only {' and '.join(map(repr, checked))} type-checks.",
                    SpmdTypecheckingWarning,
                )
        elif self.debug.spmd_typechecking_steps is not None:
            warn_at_user_line(
                f"debug.spmd_typechecking_steps={self.debug.spmd_typechecking_steps} has no effect "
                "without debug.spmd_typechecking=True.",
                SpmdTypecheckingWarning,
            )

    def _check_activation_checkpoint(self) -> None:
        if not is_ac_value(self.activation_checkpoint):
            raise TypeError(
                "JobConfig.activation_checkpoint must be an ActivationCheckpointConfig (June's section), "
                "SelectiveAC.Config, FullAC.Config, MemoryBudgetAC.Config or None (upstream b5bcd76's "
                f"policies), got {type(self.activation_checkpoint).__name__}.")

    @property
    def model_spec(self) -> Any:
        """Upstream's ``Trainer.Config.model_spec``: the last ``ModelSpec`` assigned (None before).

        ``job.model_spec = model_registry("debugmodel", converters=[...])`` (a family's
        ``model_registry``, as upstream's recipes write it) sets ``model.name``, ``model.flavor``
        and ``model.converters`` from the spec; those fields are what the trainer reads."""
        return self.__dict__.get("_model_spec")

    @model_spec.setter
    def model_spec(self, spec: Any) -> None:
        name, flavor = getattr(spec, "name", None), getattr(spec, "flavor", None)
        if not isinstance(name, str) or not isinstance(flavor, str):
            raise TypeError("JobConfig.model_spec: expected a ModelSpec from a family's model_registry(flavor, "
                            f"converters=[...]) (with a name and a flavor), got {spec!r}.")
        self.model.name, self.model.flavor = name, flavor
        self.model.converters = list(getattr(spec, "converters", ()))
        self.model.check()
        self.__dict__["_model_spec"] = spec

    @classmethod
    def root_fields(cls) -> tuple[str, ...]:
        """The root's own (non-section) fields: upstream's ``Trainer.Config.hf_assets_path``."""
        return tuple(_ROOT_FIELDS)

    @classmethod
    def section_types(cls) -> dict[str, type[Any]]:
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
            if name in _ROOT_FIELDS:
                sections[name] = check_value(name, table, _ROOT_FIELDS[name])
                continue
            if name not in _SECTIONS:
                raise ValueError(
                    f"unknown config section [{raw_name}]; valid sections are "
                    f"{', '.join(_SECTIONS)} (and the root field{'s' if len(_ROOT_FIELDS) > 1 else ''} "
                    f"{', '.join(_ROOT_FIELDS)}).{suggest(name, [*_SECTIONS, *_ROOT_FIELDS])}"
                )
            sections[name] = _SECTIONS[name].from_dict(table)
        return cls(**sections)

    def to_dict(self) -> dict[str, Any]:
        """The whole config as nested plain dicts (None values kept): each section's dict, and
        the root fields' values."""
        return {**{name: getattr(self, name) for name in _ROOT_FIELDS},
                **{name: getattr(self, name).to_dict() for name in _SECTIONS if name != "activation_checkpoint"},
                # one meaning whichever generation spelled it: June's section (from_dict reads it back)
                "activation_checkpoint": ac_section(self.activation_checkpoint).to_dict()}
