"""Technique: the global gradient norm and clipping, whatever the layout.

Each gradient contributes the sum of squares of its local shard, summed over
exactly the groups it is sharded over -- a DTensor gradient's sharded mesh dims
(``Shard`` and FSDP's ``_StridedShard``), or, for a plain gradient, what the
representation says (:meth:`~torchtitan_spmd.distributed.representation.TensorRepresentation.grad_shard_groups`)
-- and never over replicated ones, so every element counts once. Gradients
sharded the same way share one bucket, and each group gets one all-reduce over
the buckets it shards, in parameter order, so every rank issues the same
collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from torchtitan_spmd.distributed.representation import TensorRepresentation

__all__ = ["clip_grad_norm_", "global_grad_norm", "parameter_grad_norms"]


def _without_partial(g: DTensor) -> DTensor:
    """``g`` with its pending sums (``Partial`` placements) reduced to ``Replicate``."""
    if not any(p.is_partial() for p in g.placements):
        return g
    return g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])


def _local_and_groups(param: torch.Tensor, representation: TensorRepresentation,
                      ) -> tuple[torch.Tensor, tuple[dist.ProcessGroup, ...]]:
    g = param.grad
    assert g is not None
    if not isinstance(g, DTensor):
        return g, representation.grad_shard_groups(param)
    g = _without_partial(g)
    groups = tuple(
        g.device_mesh.get_group(i) for i, p in enumerate(g.placements)
        if not p.is_replicate() and g.device_mesh.size(i) > 1
    )
    return g.to_local(), groups


def global_grad_norm(parameters: Iterable[torch.Tensor], representation: TensorRepresentation, *,
                     stage_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The 2-norm over every gradient of ``parameters``, as a float32 CPU scalar, equal on every rank.

    ``stage_group``: under pipeline parallelism the ``pp`` group; each stage holds other
    parameters, so the stages' squared norms are summed over it as well.
    """
    buckets: dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is None:
            continue
        local, groups = _local_and_groups(p, representation)
        buckets.setdefault(groups, []).append(local.detach().float().pow(2).sum())
    if not buckets:
        return _over_stages(torch.zeros((), dtype=torch.float32), stage_group).sqrt()
    keys = list(buckets)
    sums = torch.stack([torch.stack(buckets[k]).sum() for k in keys])
    seen: list[dist.ProcessGroup] = []
    for key in keys:
        seen.extend(g for g in key if not any(g is s for s in seen))
    for group in seen:
        idx = [i for i, k in enumerate(keys) if any(g is group for g in k)]
        sub = sums[idx].clone()
        dist.all_reduce(sub, group=group)
        sums[idx] = sub
    return _over_stages(sums.sum(), stage_group).sqrt().cpu()


def parameter_grad_norms(named_parameters: Iterable[tuple[str, torch.Tensor]],
                         representation: TensorRepresentation) -> dict[str, float]:
    """Each gradient's full 2-norm (of the whole, unsharded tensor), by parameter name; equal on
    every rank that holds the parameter.

    For debugging and parity checks: one all-reduce per parameter and group it is sharded over
    (the same groups as :func:`global_grad_norm`), so every rank holding the same parameters
    must call it. A parameter without a gradient is left out.
    """
    out: dict[str, float] = {}
    for name, p in named_parameters:
        if p.grad is None:
            continue
        local, groups = _local_and_groups(p, representation)
        square = local.detach().double().pow(2).sum()
        for group in groups:
            dist.all_reduce(square, group=group)
        out[name] = float(square.sqrt())
    return out


def _over_stages(squares: torch.Tensor, stage_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``squares`` summed over the pipeline stages (unchanged without ``stage_group``)."""
    if stage_group is None:
        return squares
    squares = squares.clone()
    dist.all_reduce(squares, group=stage_group)
    return squares


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    representation: TensorRepresentation, *,
                    stage_group: dist.ProcessGroup | None = None) -> float:
    """Clip gradients in place to ``max_norm`` over the global norm (0: no clipping); return the norm.

    ``stage_group``: the ``pp`` group under pipeline parallelism (the norm over every stage).

    ``Partial`` DTensor gradients (replicated parameters under sequence parallel, e.g.
    the norm weights) are reduced here, in place and once, so the optimizer only sees
    ``Replicate`` ones: torch 2.11's DTensor AdamW mis-updates from a ``Partial``
    gradient (2e-5 off after two steps). The norm needs that reduction anyway.
    """
    params = [p for p in parameters if p.grad is not None]
    for p in params:
        if isinstance(p.grad, DTensor):
            p.grad = _without_partial(p.grad)
    total = global_grad_norm(params, representation, stage_group=stage_group)
    if params and max_norm > 0:
        _scale_local_grads(params, max_norm, total)
    return float(total)


def _scale_local_grads(params: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Multiply every gradient by ``min(1, max_norm / (total + 1e-6))``, in place, on its local shard.

    The same arithmetic as ``torch.nn.utils.clip_grads_with_norm_`` (a float32
    coefficient clamped at 1, one ``_foreach_mul_`` per device and dtype), but on
    the local tensors: a DTensor gradient's ``to_local()`` shares its storage, and
    scaling a shard needs no sharding propagation. Through DTensor the same call
    re-propagated the sharding of every gradient's ``mul_`` each step (about 4% of a
    CPU step under FSDP 2 x TP 2).
    """
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        assert g is not None
        local = g.to_local() if isinstance(g, DTensor) else g
        groups.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), grads in groups.items():
        torch._foreach_mul_(grads, coef.to(device))
