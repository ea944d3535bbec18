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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from torchtitan_spmd.distributed.mesh_reuse import (
    clear_dtensor_sharding_caches,  # re-exported (its old home)
)
from torchtitan_spmd.distributed.plan import ShardingPlan
from torchtitan_spmd.distributed.representation import FsdpSpec, StateLayout, TensorRepresentation

from .expert_parallel import EXPERT_WEIGHTS, expert_modules

__all__ = ["apply_fsdp", "clear_dtensor_sharding_caches", "dense_shard_dims", "expert_shard_dims", "set_gradient_sync"]


def expert_shard_dims(model: nn.Module, shard_ranks: int, *, tensor_parallel: bool = False) -> dict[str, int]:
    """The dim FSDP shards each grouped expert weight on, by FQN, when ``shard_ranks`` ranks shard it
    (before ``fully_shard``; ``tensor_parallel``: the plan shards the experts over ``tp``).

    Dim 0 (the expert; FSDP2's default) unless the ranks outnumber the experts this rank holds
    (``num_experts / ep``; upstream b5bcd76's ``efsdp * ep > num_experts``): FSDP2 would then pad
    every rank to a whole expert (``qwen3`` 30B-A3B at EP 8 on 512 ranks: 16 experts over 64
    ranks, 4x the bytes), so they shard on dim 1 (the expert's rows) instead, when it divides
    evenly (FSDP2 pads only dim 0). Under tensor parallelism without EP the experts' dims 1 and 2
    are the plan's (``tp``): they stay on dim 0."""
    dims: dict[str, int] = {}
    for fqn, experts in expert_modules(model):
        for name in EXPERT_WEIGHTS:
            param = experts._parameters[name]
            assert param is not None
            local = param.to_local() if isinstance(param, DTensor) else param
            if not tensor_parallel and local.shape[0] < shard_ranks and local.shape[1] % shard_ranks == 0:
                dims[f"{fqn}.{name}"] = 1
            else:
                dims[f"{fqn}.{name}"] = 0
    return dims


def _plan_sharded_dims(layout: Any) -> set[int]:
    """The tensor dims a parameter's plan layout shards over a model-parallel axis (``tp``)."""
    from spmd_types.types import Shard as TypeShard  # noqa: PLC0415

    dims = {t.dim for t in layout.axis_types.values() if isinstance(t, TypeShard)}
    return dims | {i for i, entry in enumerate(layout.partition_spec or ()) if entry}


def dense_shard_dims(model: nn.Module, shard_ranks: int, layouts: Mapping[str, StateLayout]) -> dict[str, int]:
    """The dim FSDP shards each other (not a grouped expert) parameter on, by FQN: dim 1 when dim 0
    of this rank's (tensor-parallel) shard does not divide evenly over the ``shard_ranks`` and dim 1
    does and the plan leaves dim 1 whole (FSDP2 would pad dim 0: llama3 405B's TP-8 ``wk``/``wv``,
    128 rows, over FSDP 2,048 ranks held 16x their share); else dim 0. ``layouts``: the plan's
    (:func:`~torchtitan_spmd.distributed.apply_plan.apply_plan`), by FQN before activation
    checkpointing's wrappers."""
    experts = {id(m._parameters[n]) for _, m in expert_modules(model) for n in EXPERT_WEIGHTS}
    dims: dict[str, int] = {}
    for name, param in model.named_parameters():
        state = layouts.get(name.replace("_checkpoint_wrapped_module.", ""))
        if id(param) in experts or state is None:
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        even1 = local.ndim >= 2 and local.shape[0] % shard_ranks != 0 and local.shape[1] % shard_ranks == 0
        dims[name] = 1 if even1 and 1 not in _plan_sharded_dims(state.layout) else 0
    return dims


def _placement_fn(model: nn.Module, shard_ranks: int, *, experts: bool = True, tensor_parallel: bool = False,
                  layouts: Mapping[str, StateLayout] | None = None,
                  ) -> Callable[[nn.Parameter], Shard | None] | None:
    """``fully_shard``'s ``shard_placement_fn`` for :func:`expert_shard_dims`' dim-1 experts and,
    given the plan's ``layouts``, :func:`dense_shard_dims`' dim-1 parameters (None for every other
    parameter: FSDP2's ``Shard(0)``); None when nothing goes on dim 1."""
    named = dict(model.named_parameters())
    dims = expert_shard_dims(model, shard_ranks, tensor_parallel=tensor_parallel) if experts else {}
    if layouts is not None:
        dims |= dense_shard_dims(model, shard_ranks, layouts)
    dim1 = {id(named[fqn]) for fqn, dim in dims.items() if dim == 1}
    if not dim1:
        return None
    return lambda param: Shard(1) if id(param) in dim1 else None


def _shard(units: Sequence[nn.Module], spec: FsdpSpec, *, param_dtype: torch.dtype,
           reduce_dtype: torch.dtype, reshard_after_forward: bool | None,
           shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None) -> None:
    """``fully_shard`` each of ``units`` in order over ``spec``'s mesh, gradients summed
    (never divided) and reduced as plain sums (gloo has no ``PREMUL_SUM``)."""
    kwargs: dict[str, Any] = {
        "shard_placement_fn": shard_placement_fn,
        "mesh": spec.mesh, "reshard_after_forward": reshard_after_forward,
        # forward inputs are not cast, as upstream: the model casts what it needs
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                          cast_forward_inputs=False),
    }
    if spec.dp_mesh_dims is not None:
        # (DTensor's caches cannot hand back an earlier, equal mesh here: ParallelDims.build_mesh
        # cleared them unless these are the very meshes they were filled with, mesh_reuse.py.)
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
               roots: Sequence[nn.Module] | None = None,
               layouts: Mapping[str, StateLayout] | None = None) -> nn.Module:
    """Shard ``model``'s parameters with FSDP2 as the representation says; no-op without DP.

    1. With expert parallelism, every expert module (:func:`expert_modules`) over the
       representation's expert FSDP mesh (``representation.expert_fsdp_spec()``: ``efsdp``,
       with ``dp_replicate`` for HSDP), first: the blocks' units then leave the expert
       weights to them.
    2. Each module matching the plan's ``fsdp_units``, then the ``roots``, over
       ``representation.fsdp_spec()``.

    Grouped expert weights go on dim 1 when their shard ranks (``efsdp``; ``fsdp`` without EP)
    outnumber the experts a rank holds (:func:`expert_shard_dims`), under every representation;
    given the plan's ``layouts``, so does any other parameter whose dim 0 would be padded and dim 1
    would not (:func:`dense_shard_dims`).

    ``reshard_after_forward``: ``fully_shard``'s (None: its default); False under pipeline
    parallelism, as upstream (a stage's parameters stay gathered between its microbatches'
    forwards and backwards). ``roots``: the FSDP roots after the units (default ``[model]``;
    under a looped pipeline schedule, the rank's stage modules).

    ``param_dtype``/``reduce_dtype``: the ``MixedPrecisionPolicy`` of every unit, experts included.
    """
    policy = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype,
              "reshard_after_forward": reshard_after_forward}
    pd = representation.parallel_dims
    expert_spec = representation.expert_fsdp_spec()
    if expert_spec is not None:
        _shard([m for _, m in expert_modules(model)], expert_spec, **policy,
               shard_placement_fn=_placement_fn(model, pd.axis_size("efsdp")))
    spec = representation.fsdp_spec()
    if spec is not None:
        experts_here = expert_spec is None and expert_modules(model)
        # the experts here only without EP (with EP, theirs are the expert units')
        _shard([*plan.fsdp_unit_modules(model), *(roots if roots is not None else [model])], spec, **policy,
               shard_placement_fn=_placement_fn(model, pd.axis_size("fsdp"), experts=bool(experts_here),
                                                tensor_parallel=pd.tp_enabled, layouts=layouts))
    return model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduces gradients across the data-parallel ranks.

    Off for every microbatch but the last of a step: FSDP then accumulates the
    unsharded gradients locally (in the reduce dtype) and reduces them once. No-op
    without FSDP.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
