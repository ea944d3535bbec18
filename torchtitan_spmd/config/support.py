"""What this library's trainer implements: one table of the config values it does not.

Every row names a field of a torchtitan section whose feature the runtime does
not implement yet. Such a field keeps torchtitan's default silently; any other
value is rejected at setup by :func:`check_supported`, with an error naming the
field, the value and the feature. A later change enables a feature by deleting
its rows.

The check runs on any root dataclass that embeds these sections (this library's
``JobConfig`` or a fork's own), wherever they are attached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .activation_checkpoint import MemoryBudgetAC
from .configs import (
    ActivationCheckpointConfig,
    CheckpointConfig,
    CommConfig,
    DebugConfig,
    OptimizerConfig,
    ParallelismConfig,
    TrainingConfig,
)

__all__ = ["UNSUPPORTED", "UNSUPPORTED_POLICIES", "Unsupported", "check_supported"]


@dataclass(frozen=True)
class Unsupported:
    """One field whose non-default values the runtime does not implement."""

    section: type
    """The section class the field belongs to (subclasses match too)."""

    field: str
    """The field's name."""

    feature: str
    """The feature the field controls, as the error names it."""

    also_allowed: tuple[Any, ...] = ()
    """Values other than the default that the runtime does implement."""

    def default(self) -> Any:
        """The field's default in its section class."""
        f = next(f for f in dataclasses.fields(self.section) if f.name == self.field)
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return f.default


def _rows(section: type, feature: str, *fields: str) -> tuple[Unsupported, ...]:
    return tuple(Unsupported(section, name, feature) for name in fields)


#: The table. Delete a feature's rows to enable it.
UNSUPPORTED: tuple[Unsupported, ...] = (
    *_rows(TrainingConfig, "FSDP CPU offload", "enable_cpu_offload"),
    *_rows(TrainingConfig, "full bfloat16 training", "dtype"),
    *_rows(ParallelismConfig, "FSDP reshard-after-forward policies", "fsdp_reshard_after_forward"),
    *_rows(ParallelismConfig, "FSDP symmetric-memory communication", "enable_fsdp_symm_mem"),
    *_rows(TrainingConfig, "CUDA graphs (this library captures none)", "disable_cuda_graphs"),
    *_rows(ParallelismConfig, "the PTRR context-parallel load balancer", "context_parallel_ptrr_mask_key"),
    *_rows(CheckpointConfig, "loading quantized Hugging Face checkpoints (dequantized on load)",
           "initial_load_in_hf_quantized"),
    Unsupported(CheckpointConfig, "async_mode", "asynchronous checkpointing through pinned shared memory "
                "in a separate process", also_allowed=("async",)),
    Unsupported(ActivationCheckpointConfig, "mode",
                "memory-budget activation checkpointing (the compiler's min-cut recomputation)",
                also_allowed=("none", "full")),
    *_rows(ActivationCheckpointConfig, "memory-budget activation checkpointing",
           "memory_budget", "visualize_memory_budget_pareto"),
    Unsupported(OptimizerConfig, "implementation", "bfloat16 optimizer states",
                also_allowed=("for-loop", "foreach")),
    Unsupported(CommConfig, "mode", "communication through torchcomms",
                also_allowed=("fake_backend", "local_tensor")),
    *_rows(DebugConfig, "warn-only deterministic mode", "deterministic_warn_only"),
    *_rows(DebugConfig, "autograd anomaly detection", "detect_anomaly"),
    *_rows(DebugConfig, "batch-invariant mode", "batch_invariant"),
)

#: Upstream b5bcd76's activation-checkpointing policies (#3674) this runtime does not implement:
#: (policy config class, its command-line spelling, the feature).
UNSUPPORTED_POLICIES: tuple[tuple[type, str, str], ...] = (
    (MemoryBudgetAC.Config, "activation-checkpoint:memory-budget",
     "memory-budget activation checkpointing (the compiler's min-cut recomputation)"),
)

for _row in UNSUPPORTED:  # a typo in the table is a packaging error, caught on import
    if _row.field not in {f.name for f in dataclasses.fields(_row.section)}:
        raise ImportError(f"support table: {_row.section.__name__} has no field {_row.field!r}")


def _sections(obj: Any, path: str, depth: int = 0) -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every dataclass instance under ``obj``, ``obj`` included."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type) or depth > 4:
        return
    yield path, obj
    for f in dataclasses.fields(obj):
        yield from _sections(getattr(obj, f.name, None), f"{path}.{f.name}" if path else f.name, depth + 1)


def check_supported(config: Any) -> None:
    """Raise ``ValueError`` listing every config value whose feature is not implemented.

    ``config`` is a root dataclass (``JobConfig`` or a fork's own) or a single
    section. Each line of the message names the field (its path from the root),
    the value, the feature, and the default to go back to.
    """
    problems: list[str] = []
    for path, section in _sections(config, ""):
        for cls, spelled, feature in UNSUPPORTED_POLICIES:
            if isinstance(section, cls):
                problems.append(
                    f"{path or section.section_name}={cls.__qualname__}() ({spelled}): {feature} is not "
                    "implemented by torchtitan_spmd yet; use SelectiveAC.Config(), FullAC.Config() or None "
                    "(activation-checkpoint:selective, :full or :none).")
        for row in UNSUPPORTED:
            if not isinstance(section, row.section):
                continue
            value, default = getattr(section, row.field), row.default()
            if value == default or value in row.also_allowed:
                continue
            prefix = path or getattr(section, "section_name", "")  # a lone section: its own name
            where = f"{prefix}.{row.field}" if prefix else row.field
            allowed = [repr(v) for v in (default, *row.also_allowed)]
            choices = allowed[0] if len(allowed) == 1 else f"{', '.join(allowed[:-1])} or {allowed[-1]}"
            problems.append(
                f"{where}={value!r}: {row.feature} is not implemented by torchtitan_spmd yet; "
                f"use {choices}."
            )
    if problems:
        raise ValueError("unsupported config values:\n  " + "\n  ".join(problems))
