"""Technique: activation checkpointing of every transformer block (``activation_checkpoint.*``).

Upstream's modes and names (``torchtitan.distributed.activation_checkpoint.apply_ac``):

- ``"none"``: nothing is recomputed;
- ``"full"``: each block of ``model.layers`` is wrapped in torch's non-reentrant
  ``checkpoint_wrapper``: its forward activations are dropped and recomputed in
  backward;
- ``"selective"``: per-op selective checkpointing (torch's
  ``create_selective_checkpoint_contexts``) with upstream's policy: the outputs of
  compute-intensive ops (matmuls, attention, ``aten.max``) and of the
  reduce-scatter / all-to-all collectives are saved, everything else (norms,
  activations, RoPE, all-gathers, ...) is recomputed. As upstream, every second
  matmul of a block is recomputed too, and matmuls with the weight shape of a
  Linear named in ``per_op_sac_force_recompute_mm_shapes_by_fqns`` always are.

Upstream b5bcd76's policy configs (#3674: ``SelectiveAC.Config``, ``FullAC.Config``,
``MemoryBudgetAC.Config``, None; :mod:`torchtitan_spmd.config.activation_checkpoint`, re-exported
here where upstream keeps them) are the same modes (:func:`~torchtitan_spmd.config.ac_section`).

``preserve_rng_state``, ``determinism_check``, ``early_stop`` and ``debug`` are passed
to ``torch.utils.checkpoint`` as they are. ``"memory_budget"`` (the compiler's
min-cut recomputation) is not implemented: ``check_supported`` rejects it at setup.

Blocks are wrapped after the sharding plan (its hooks live on the blocks'
submodules and run again on recompute) and before compile and FSDP, as upstream.
The wrapper inserts ``_checkpoint_wrapped_module`` into parameter names;
:func:`~torchtitan_spmd.distributed.apply_plan.resolve_state` and torch's state-dict
functions see through it. Under ``spmd_types`` the recompute runs on the thread of
the backward (autograd multithreading is off in the train context), so it sees the
forward mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan_spmd.config.activation_checkpoint import (
    ActivationCheckpointing,
    FullAC,
    MemoryBudgetAC,
    SelectiveAC,
    ac_section,
)
from torchtitan_spmd.config.support import check_supported

if TYPE_CHECKING:
    from torchtitan_spmd.config import ActivationCheckpointConfig

__all__ = ["AC_MODES", "ActivationCheckpointing", "FullAC", "MemoryBudgetAC", "SelectiveAC", "apply_ac", "save_ops",
           "selective_policy"]

#: The modes :func:`apply_ac` implements.
AC_MODES: tuple[str, ...] = ("none", "full", "selective")


def _resolve(root: Any, dotted: str) -> Any | None:
    """``root.a.b.c`` for ``dotted="a.b.c"``, or None when an op is not registered in this build."""
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def save_ops() -> set[Any]:
    """The ops whose outputs selective checkpointing saves (the rest is recomputed).

    The partitioner's compute-intensive ops (``mm``, ``addmm``, ``bmm``, the flash and
    efficient attention kernels, ...), every SDPA kernel (CPU's included), ``linear``
    (backends that do not decompose it), ``max`` (low-precision scaling) and the
    collectives whose result is costly to fetch again (reduce-scatter, all-to-all).
    Ops missing from this torch build are skipped.
    """
    from torch._functorch.partitioners import get_default_op_list

    ops: set[Any] = {op.default for op in get_default_op_list().compute_intensive_ops}
    for name in (
        "aten._scaled_dot_product_attention_math.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_fused_attention_overrideable.default",
        "aten.linear.default",
        "aten.max.default",
        "_c10d_functional.reduce_scatter_tensor.default",
        "_c10d_functional.all_to_all_single.default",
    ):
        op = _resolve(torch.ops, name)
        if op is not None:
            ops.add(op)
    return ops


def _mm_recompute_shapes(block: nn.Module, fqns: list[str], base_fqn: str) -> set[torch.Size]:
    """``(in_features, out_features)`` of every Linear whose name contains one of ``fqns``."""
    shapes: set[torch.Size] = set()
    for name, sub in block.named_modules():
        fqn = f"{base_fqn}.{name}" if name else base_fqn
        if not any(f in fqn for f in fqns):
            continue
        if not isinstance(sub, nn.Linear):
            raise ValueError(
                f"activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns={fqns!r} "
                f"matches {fqn!r}, a {type(sub).__name__}; it must name nn.Linear modules."
            )
        out_f, in_f = sub.weight.shape
        shapes.add(torch.Size((in_f, out_f)))
    return shapes


def _selective_policy(saved: set[Any], recompute_shapes: set[torch.Size]) -> Callable[..., CheckpointPolicy]:
    """Upstream's per-op policy: save ``saved`` ops, except every second matmul and forced shapes."""
    mm_ops = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if (func is torch.ops.aten._to_copy.default and "cuda" in str(args[0].device)
                and str(kwargs.get("device")) == "cpu"):
            return CheckpointPolicy.MUST_SAVE  # a device-to-host sync: never redo it
        key = "recompute" if ctx.is_recompute else "forward"
        if func in mm_ops:
            shape = args[1].shape
            if func is torch.ops.aten.linear.default:  # weight is (out, in); mm's rhs (in, out)
                shape = torch.Size((shape[1], shape[0]))
            if shape in recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            counts[key] += 1
        if func in saved:
            if func in mm_ops and counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_policy(block: nn.Module, ac: ActivationCheckpointConfig, base_fqn: str) -> Callable[..., CheckpointPolicy]:
    """A fresh per-op policy of selective AC for one forward of ``block`` (named ``base_fqn``), as
    :func:`apply_ac` gives ``create_selective_checkpoint_contexts`` (the dry run's estimate
    applies the same one: :func:`torchtitan_spmd.dry_run.activation_bytes`)."""
    shapes = _mm_recompute_shapes(block, list(ac.per_op_sac_force_recompute_mm_shapes_by_fqns), base_fqn)
    return _selective_policy(save_ops(), shapes)


def _wrap(block: nn.Module, ac: ActivationCheckpointConfig, base_fqn: str) -> nn.Module:
    kwargs: dict[str, Any] = {
        "preserve_rng_state": ac.preserve_rng_state,
        "determinism_check": ac.determinism_check,
        "early_stop": ac.early_stop,
        "debug": ac.debug,
    }
    if ac.mode == "selective":
        saved = save_ops()
        shapes = _mm_recompute_shapes(block, list(ac.per_op_sac_force_recompute_mm_shapes_by_fqns), base_fqn)
        kwargs["context_fn"] = lambda: create_selective_checkpoint_contexts(_selective_policy(saved, shapes))
    return checkpoint_wrapper(block, **kwargs)


def apply_ac(model: nn.Module, ac: ActivationCheckpointConfig | ActivationCheckpointing.Config | None) -> nn.Module:
    """Checkpoint every block of ``model.layers`` per ``ac`` (June's section, or upstream b5bcd76's
    policy config or None; in place; returns ``model``).

    Raises ``ValueError`` for a mode other than :data:`AC_MODES`, or a model without
    a ``layers`` container of blocks.
    """
    if ac is not None:
        check_supported(ac)  # the support table (memory_budget); the config rejects other modes
    ac = ac_section(ac)
    if ac.mode == "none":
        return model
    layers = getattr(model, "layers", None)
    # An empty container is a pipeline stage holding no block (e.g. the embedding alone).
    if not isinstance(layers, nn.Module):
        raise ValueError(
            f"activation_checkpoint.mode={ac.mode!r} wraps the blocks of model.layers, but "
            f"{type(model).__name__} has no such container."
        )
    for name, block in list(layers.named_children()):
        layers.register_module(name, _wrap(block, ac, f"layers.{name}"))
    return model
