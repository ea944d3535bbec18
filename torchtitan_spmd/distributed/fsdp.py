"""Technique: FSDP2 (``fully_shard``) on what the representation says to shard.

Each module matching the plan's ``fsdp_units`` is one FSDP unit, then the root.
Gradients are summed across the data-parallel ranks, never averaged: the loss
technique makes every rank's loss its share of the global mean (upstream also
disables FSDP's gradient division and scales by the global token count). Gloo has
no ``PREMUL_SUM``, so reductions are forced to plain sums.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from .plan import ShardingPlan
from .representation import TensorRepresentation

__all__ = ["apply_fsdp", "clear_dtensor_sharding_caches"]


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


def apply_fsdp(model: nn.Module, plan: ShardingPlan, representation: TensorRepresentation) -> nn.Module:
    """Shard ``model``'s parameters with FSDP2 per ``representation.fsdp_spec()``; no-op without DP."""
    spec = representation.fsdp_spec()
    if spec is None:
        return model
    kwargs: dict[str, Any] = {"mesh": spec.mesh}
    if spec.dp_mesh_dims is not None:
        clear_dtensor_sharding_caches()  # an earlier, equal mesh must not leak in
        kwargs["dp_mesh_dims"] = spec.dp_mesh_dims
    units = [*plan.fsdp_unit_modules(model), model]
    for unit in units:
        fully_shard(unit, **kwargs)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    return model
