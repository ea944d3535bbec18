"""Technique: FSDP2 (``fully_shard``) on what the representation says to shard.

Each module matching the plan's ``fsdp_units`` is one FSDP unit, then the root.
Gradients are summed across the data-parallel ranks, never averaged: the loss
technique makes every rank's loss its share of the global mean (upstream also
disables FSDP's gradient division and scales by the global token count). Gloo has
no ``PREMUL_SUM``, so reductions are forced to plain sums.

Mixed precision is FSDP2's ``MixedPrecisionPolicy`` (``training.mixed_precision_param``
/ ``mixed_precision_reduce``), under every representation: parameters are gathered
in the compute dtype, gradients reduced in the reduce dtype, and the sharded
parameters, their gradients and the optimizer state stay float32. Without data
parallelism there is no FSDP; the trainer then computes in the same dtype under
``torch.autocast`` (:func:`~torchtitan_spmd.distributed.utils.maybe_enable_amp`).
Under gradient accumulation :func:`set_gradient_sync` turns the reduction off for
all but the last microbatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from torchtitan_spmd.distributed.plan import ShardingPlan
from torchtitan_spmd.distributed.representation import FsdpSpec, TensorRepresentation

from .expert_parallel import expert_modules

__all__ = ["apply_fsdp", "clear_dtensor_sharding_caches", "set_gradient_sync"]


def clear_dtensor_sharding_caches() -> None:
    """Forget DTensor's cached sharding propagations (the Python and the C++ cache).

    They key on mesh *equality*: with a second, equal mesh in the process (another
    trainer, a benchmark, a notebook) they hand back the first mesh object, and
    ``fully_shard(dp_mesh_dims=...)`` then fails with "different mesh objects".
    """
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()


def _shard(units: Sequence[nn.Module], spec: FsdpSpec, *, param_dtype: torch.dtype,
           reduce_dtype: torch.dtype, reshard_after_forward: bool | None) -> None:
    """``fully_shard`` each of ``units`` in order over ``spec``'s mesh, gradients summed
    (never divided) and reduced as plain sums (gloo has no ``PREMUL_SUM``)."""
    kwargs: dict[str, Any] = {
        "mesh": spec.mesh, "reshard_after_forward": reshard_after_forward,
        # forward inputs are not cast, as upstream: the model casts what it needs
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                          cast_forward_inputs=False),
    }
    if spec.dp_mesh_dims is not None:
        clear_dtensor_sharding_caches()  # an earlier, equal mesh must not leak in
        kwargs["dp_mesh_dims"] = spec.dp_mesh_dims
    for unit in units:
        fully_shard(unit, **kwargs)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]


def apply_fsdp(model: nn.Module, plan: ShardingPlan, representation: TensorRepresentation, *,
               param_dtype: torch.dtype = torch.float32,
               reduce_dtype: torch.dtype = torch.float32,
               reshard_after_forward: bool | None = None,
               roots: Sequence[nn.Module] | None = None) -> nn.Module:
    """Shard ``model``'s parameters with FSDP2 as the representation says; no-op without DP.

    1. With expert parallelism, every expert module (:func:`expert_modules`) over the
       representation's expert FSDP mesh (``representation.expert_fsdp_spec()``: ``efsdp``,
       with ``dp_replicate`` for HSDP), first: the blocks' units then leave the expert
       weights to them.
    2. Each module matching the plan's ``fsdp_units``, then the ``roots``, over
       ``representation.fsdp_spec()``.

    ``reshard_after_forward``: ``fully_shard``'s (None: its default); False under pipeline
    parallelism, as upstream (a stage's parameters stay gathered between its microbatches'
    forwards and backwards). ``roots``: the FSDP roots after the units (default ``[model]``;
    under a looped pipeline schedule, the rank's stage modules).

    ``param_dtype``/``reduce_dtype``: the ``MixedPrecisionPolicy`` of every unit, experts included.
    """
    policy = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype,
              "reshard_after_forward": reshard_after_forward}
    expert_spec = representation.expert_fsdp_spec()
    if expert_spec is not None:
        _shard([m for _, m in expert_modules(model)], expert_spec, **policy)
    spec = representation.fsdp_spec()
    if spec is not None:
        _shard([*plan.fsdp_unit_modules(model), *(roots if roots is not None else [model])], spec, **policy)
    return model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduces gradients across the data-parallel ranks.

    Off for every microbatch but the last of a step: FSDP then accumulates the
    unsharded gradients locally (in the reduce dtype) and reduces them once. No-op
    without FSDP.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
