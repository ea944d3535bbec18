"""Upstream b5bcd76's activation-checkpointing policies (#3674) as config, over June's section.

At a0c831c49 (June) activation checkpointing is one section, ``[activation_checkpoint]``, whose
``mode`` picks the policy (:class:`~.configs.ActivationCheckpointConfig`). At b5bcd76 (August)
the root's ``activation_checkpoint`` field holds one policy's config, a union that tyro parses
as subcommands:

=================================  ================================  ==========================
August (Python)                    August (command line)             June's ``mode``
=================================  ================================  ==========================
``SelectiveAC.Config(...)``        ``activation-checkpoint:selective``  ``"selective"``
``FullAC.Config(...)``             ``activation-checkpoint:full``       ``"full"``
``MemoryBudgetAC.Config(...)``     ``activation-checkpoint:memory-budget``  ``"memory_budget"``
``None``                           ``activation-checkpoint:none``       ``"none"``
=================================  ================================  ==========================

Both spellings are accepted and read back as written (``isinstance(cfg.activation_checkpoint,
FullAC.Config)`` in an August fork, ``cfg.activation_checkpoint.mode == "full"`` in a June one);
the runtime reads one meaning, :func:`ac_section`. Here a policy is only its ``Config``: this
library's trainer applies it (upstream's ``Config.build(...).apply(model)`` is not provided).
``SelectiveAC.Config.force_recompute_mm_shapes_by_fqns`` is June's
``per_op_sac_force_recompute_mm_shapes_by_fqns``; June's ``early_stop`` is always False upstream.
``MemoryBudgetAC`` is not implemented by this library (a setup error naming it, as June's
``mode="memory_budget"``).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._section import Section
from .configs import ActivationCheckpointConfig

__all__ = [
    "ActivationCheckpointing",
    "FullAC",
    "MemoryBudgetAC",
    "SelectiveAC",
    "ac_section",
    "activation_checkpoint_type",
    "is_ac_value",
    "policy_classes",
]


class ActivationCheckpointing:
    """Upstream b5bcd76's base of the policies; here each policy is its nested ``Config``."""

    @dataclass(kw_only=True)
    class Config(Section):
        """Fields every policy has (upstream's ``ActivationCheckpointing.Config``)."""

        section_name: ClassVar[str] = "activation_checkpoint"
        #: June's ``activation_checkpoint.mode`` of this policy.
        policy_mode: ClassVar[str] = ""
        #: Upstream's tyro subcommand: ``activation-checkpoint:<subcommand>``.
        subcommand: ClassVar[str] = ""

        preserve_rng_state: bool = True
        """Stash and restore the RNG state around each checkpoint, for results identical to a run
        without checkpointing."""

        determinism_check: str = "default"
        """The determinism check of ``torch.utils.checkpoint``."""

        debug: bool = False
        """Record ``torch.utils.checkpoint`` debug information (slower)."""

        @property
        def mode(self) -> str:
            """June's ``mode`` of this policy (read only: the policy is the config's class)."""
            return self.policy_mode

        @mode.setter
        def mode(self, value: Any) -> None:
            raise TypeError(
                f"activation_checkpoint is {type(self).__qualname__} (upstream b5bcd76's policy class), "
                f"whose mode is {self.policy_mode!r}; to change the policy assign another one "
                "(SelectiveAC.Config(), FullAC.Config() or None), or June's "
                f"ActivationCheckpointConfig(mode={value!r}).")

        def _section_fields(self) -> dict[str, Any]:
            return {}

        def to_section(self) -> ActivationCheckpointConfig:
            """The same setting in June's section (what the runtime reads)."""
            return ActivationCheckpointConfig(mode=self.policy_mode,  # type: ignore[arg-type]
                                              preserve_rng_state=self.preserve_rng_state,
                                              determinism_check=self.determinism_check, debug=self.debug,
                                              **self._section_fields())


class FullAC(ActivationCheckpointing):
    """Recompute each whole transformer block in backward (June's ``mode="full"``)."""

    @dataclass(kw_only=True)
    class Config(ActivationCheckpointing.Config):
        """Upstream's ``FullAC.Config``: the common fields only."""

        policy_mode: ClassVar[str] = "full"
        subcommand: ClassVar[str] = "full"


class SelectiveAC(ActivationCheckpointing):
    """Per-op selective checkpointing (June's ``mode="selective"``)."""

    @dataclass(kw_only=True)
    class Config(ActivationCheckpointing.Config):
        """Upstream's ``SelectiveAC.Config``."""

        policy_mode: ClassVar[str] = "selective"
        subcommand: ClassVar[str] = "selective"

        force_recompute_mm_shapes_by_fqns: list[str] = field(default_factory=lambda: ["moe.router.gate"])
        """Matmuls with the shapes of these Linear modules are always recomputed (any matmul of that
        shape); June's ``per_op_sac_force_recompute_mm_shapes_by_fqns``."""

        def _section_fields(self) -> dict[str, Any]:
            return {"per_op_sac_force_recompute_mm_shapes_by_fqns": list(self.force_recompute_mm_shapes_by_fqns)}


class MemoryBudgetAC(ActivationCheckpointing):
    """The compiler's memory-budget recomputation (June's ``mode="memory_budget"``): not
    implemented by this library (``check_supported`` names it)."""

    @dataclass(kw_only=True)
    class Config(ActivationCheckpointing.Config):
        """Upstream's ``MemoryBudgetAC.Config``."""

        policy_mode: ClassVar[str] = "memory_budget"
        subcommand: ClassVar[str] = "memory-budget"

        memory_budget: float = 0.5
        """0.0 is the memory of full checkpointing, 1.0 that of none."""

        visualize_memory_budget_pareto: bool = False
        """Write an SVG of the runtime/memory trade-off over budgets to the dump folder."""

        def __post_init__(self) -> None:
            super().__post_init__()
            self._require(0.0 <= self.memory_budget <= 1.0, "memory_budget", "must be in [0, 1]")

        def _section_fields(self) -> dict[str, Any]:
            return {"memory_budget": self.memory_budget,
                    "visualize_memory_budget_pareto": self.visualize_memory_budget_pareto}


def policy_classes() -> tuple[type[ActivationCheckpointing.Config], ...]:
    """Upstream's policy configs, in the order of its union."""
    return (SelectiveAC.Config, FullAC.Config, MemoryBudgetAC.Config)


def is_ac_value(value: Any) -> bool:
    """Whether ``value`` is a valid ``activation_checkpoint``: June's section, a policy config or None."""
    return value is None or isinstance(value, ActivationCheckpointConfig | ActivationCheckpointing.Config)


def ac_section(value: Any) -> ActivationCheckpointConfig:
    """The runtime's one reading of ``activation_checkpoint``, whichever generation spelled it:
    June's section as it is, a policy's :meth:`~ActivationCheckpointing.Config.to_section`, None
    as ``mode="none"``."""
    if isinstance(value, ActivationCheckpointConfig):
        return value
    if isinstance(value, ActivationCheckpointing.Config):
        return value.to_section()
    if value is None:
        return ActivationCheckpointConfig(mode="none")
    raise TypeError("activation_checkpoint: expected ActivationCheckpointConfig (June's section), "
                    "SelectiveAC.Config, FullAC.Config, MemoryBudgetAC.Config or None (upstream b5bcd76's "
                    f"policies), got {type(value).__name__} {value!r}.")


def _subcommand(name: str) -> Any:
    try:
        import tyro
    except ImportError:  # the sections work without tyro; only the command line needs the names
        return f"subcommand:{name}"
    return tyro.conf.subcommand(name)


def activation_checkpoint_type(*, june: bool = True) -> Any:
    """The annotation of a root's ``activation_checkpoint``: upstream b5bcd76's union of policy configs
    and None, each named as upstream's tyro subcommand, with June's section first
    (``activation-checkpoint:mode``, which this library's ``ConfigManager`` selects by itself for
    ``--activation_checkpoint.mode`` and June's other fields). ``june=False``: upstream's union alone
    (``ActivationCheckpointingConfig``). tyro is imported here, on first use, not with the config."""
    members: list[Any] = [typing.Annotated[ActivationCheckpointConfig, _subcommand("mode")]] if june else []
    members += [typing.Annotated[cls, _subcommand(cls.subcommand)] for cls in policy_classes()]
    members.append(typing.Annotated[None, _subcommand("none")])
    return typing.Union[tuple(members)]  # noqa: UP007 - built from a list


def __getattr__(name: str) -> Any:
    if name == "ActivationCheckpointingConfig":  # upstream's name of its union (b5bcd76)
        value = activation_checkpoint_type(june=False)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
