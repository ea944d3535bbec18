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

Async tensor parallelism (``parallelism.enable_async_tensor_parallel``, upstream #4045; its
August place ``compile.enable_async_tensor_parallel``): on CUDA, wired as upstream wires it
(:func:`maybe_enable_async_tp`): symmetric memory on the TP group and inductor's micro-pipeline TP
pass (``torch._inductor.config._micro_pipeline_tp``), which rewrites the compiled blocks'
all-gather + matmul and matmul + reduce-scatter pairs into overlapped ones. June's field needs
the blocks compiled, as upstream's ``maybe_enable_async_tp``. The dry run
(``comm.mode="fake_backend"``) accepts it (the bytes do not change); a real run off CUDA refuses
it in one line (:func:`validate_async_tp`): there is no symmetric memory to run it on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

if TYPE_CHECKING:
    from torchtitan_spmd.config import CompileConfig, JobConfig
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims
    from torchtitan_spmd.distributed.representation import TensorRepresentation

__all__ = ["COMPILE_COMPONENTS", "apply_compile", "async_tp_field", "maybe_compile_loss", "maybe_enable_async_tp",
           "validate_async_tp", "validate_compile"]

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


def async_tp_field(job_config: JobConfig) -> str | None:
    """The field that turns async tensor parallelism on (June's ``parallelism.`` or August's
    ``compile.enable_async_tensor_parallel``), or None when it is off."""
    for section in ("parallelism", "compile"):
        if getattr(getattr(job_config, section), "enable_async_tensor_parallel", False):
            return f"{section}.enable_async_tensor_parallel"
    return None


def validate_async_tp(job_config: JobConfig, device_type: str) -> None:
    """Raise ``ValueError`` at setup for async TP that cannot run: June's field without the blocks
    compiled (upstream's "Async TP requires 'model' in --compile.components and --compile.enable"),
    and a real run off CUDA. The dry run (``comm.mode="fake_backend"``) accepts it."""
    field = async_tp_field(job_config)
    if field is None:
        return
    cfg = job_config.compile
    if job_config.parallelism.enable_async_tensor_parallel and not (cfg.enable and "model" in cfg.components):
        raise ValueError("parallelism.enable_async_tensor_parallel=True requires compile.enable=True with 'model' "
                         f"in compile.components (got enable={cfg.enable}, components={list(cfg.components)!r}): "
                         "inductor's micro-pipeline TP pass rewrites the compiled blocks, as upstream.")
    if job_config.comm.mode == "fake_backend" or device_type == "cuda":
        return
    raise ValueError(f"{field}=True needs CUDA: async tensor parallelism overlaps the TP collectives through "
                     f"symmetric memory, which this {device_type} run does not have; "
                     f"set --{field.replace('_', '-').replace('.enable-', '.no-enable-')} to run it without.")


def maybe_enable_async_tp(job_config: JobConfig, parallel_dims: ParallelDims, device_type: str) -> bool:
    """On CUDA with async TP on and a ``tp`` axis: symmetric memory on the TP group and inductor's
    micro-pipeline TP pass on, as upstream (b5bcd76 ``_maybe_enable_async_tp``); returns whether it
    did. Before the blocks are compiled (the pass runs when they first are)."""
    if async_tp_field(job_config) is None or not parallel_dims.tp_enabled or device_type != "cuda":
        return False
    import warnings  # noqa: PLC0415

    import torch._inductor.config  # noqa: PLC0415
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group  # noqa: PLC0415

    with warnings.catch_warnings():  # deprecated in newer torch, which registers the group itself
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(parallel_dims.get_mesh("tp").get_group().group_name)
    torch._inductor.config._micro_pipeline_tp = True
    return True
