"""Technique: ``torch.compile`` of each transformer block and of the loss (``compile.*``).

As upstream (``torchtitan.distributed.compile.apply_compile``): with
``compile.enable`` and ``"model"`` in ``compile.components``, every block of
``model.layers`` is compiled in place (``block.compile(backend=..., fullgraph=True)``),
after activation checkpointing and before FSDP, so the repeated block compiles once
and the plan's boundary collectives are traced with it; with ``"loss"``, the loss
function is wrapped in ``torch.compile`` (not ``fullgraph``, as upstream).

Setup errors (:func:`validate_compile`): an unknown component, an unknown backend,
and type checking (``debug.spmd_typechecking`` under ``spmd_types``) together with
compile: the checker propagates types op by op in Python, which Dynamo does not
trace; check the model eagerly, then compile it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

if TYPE_CHECKING:
    from torchtitan_spmd.config import CompileConfig, JobConfig
    from torchtitan_spmd.distributed.representation import TensorRepresentation

__all__ = ["COMPILE_COMPONENTS", "apply_compile", "maybe_compile_loss", "validate_compile"]

#: What ``compile.components`` may name.
COMPILE_COMPONENTS: tuple[str, ...] = ("model", "loss")

F = TypeVar("F", bound=Callable[..., Any])


def _available_backends() -> list[str]:
    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def validate_compile(job_config: JobConfig, representation: TensorRepresentation) -> None:
    """Raise ``ValueError`` at setup for a compile config that cannot run. No-op when compile is off."""
    cfg = job_config.compile
    if not cfg.enable:
        return
    unknown = [c for c in cfg.components if c not in COMPILE_COMPONENTS]
    if unknown:
        raise ValueError(
            f"compile.components={list(cfg.components)!r}: unknown {', '.join(map(repr, unknown))}; "
            f"valid components are {', '.join(map(repr, COMPILE_COMPONENTS))}."
        )
    backends = _available_backends()
    if cfg.backend not in backends:
        raise ValueError(
            f"compile.backend={cfg.backend!r} is not a torch.compile backend of this torch "
            f"({torch.__version__}); available: {', '.join(backends)}."
        )
    if job_config.debug.spmd_typechecking and representation.supports_typechecking:
        raise ValueError(
            "debug.spmd_typechecking=True cannot be combined with compile.enable=True: the "
            "spmd_types checker runs op by op in Python, which torch.compile does not trace. "
            "Type-check an eager run (--compile.no-enable), then compile without the checker."
        )


def apply_compile(model: nn.Module, compile_config: CompileConfig, *, fullgraph: bool = True) -> nn.Module:
    """Compile every block of ``model.layers`` in place (``fullgraph=True``); returns ``model``.

    ``fullgraph=False`` under expert parallelism: the experts are their own FSDP units inside
    the block (``fsdp.apply_fsdp`` shards the experts first), and FSDP's hooks are ``torch._dynamo.disable``d
    (measured, torch 2.14: ``Unsupported: Call to torch._dynamo.disable()`` with fullgraph), so
    Dynamo breaks the graph around them and around the exchange's data-dependent splits."""
    layers = getattr(model, "layers", None)
    # An empty container is a pipeline stage holding no block (e.g. the embedding alone).
    if not isinstance(layers, nn.Module):
        raise ValueError(
            f"compile.components includes 'model': compile wraps the blocks of model.layers, but "
            f"{type(model).__name__} has no such container."
        )
    _dynamo_config()
    for block in layers.children():
        block.compile(backend=compile_config.backend, fullgraph=fullgraph)
    return model


def _dynamo_config() -> None:
    """Upstream's Dynamo settings for compiled training (process-wide, as upstream sets them).

    Scalars read back from tensors (the vocab-parallel loss's chunk size) stay in the
    graph, and forward side effects are not replayed on activation-checkpoint recompute.
    """
    torch._dynamo.config.capture_scalar_outputs = True
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):  # newer torch
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def maybe_compile_loss(loss_fn: F, compile_config: CompileConfig) -> F:
    """``loss_fn`` compiled with ``compile.backend`` when compile is on for ``"loss"``, else itself."""
    if compile_config.enable and "loss" in compile_config.components:
        return torch.compile(loss_fn, backend=compile_config.backend)  # type: ignore[return-value]
    return loss_fn
