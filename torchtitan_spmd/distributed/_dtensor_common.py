"""Pieces shared by the two DTensor backends (``default`` and ``full_dtensor``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel


def dtensor_global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm over all (DTensor or plain) ``grads`` as a global, fp32 scalar.

    Each DTensor contributes the squares of its local shard, summed over the mesh
    dims it is sharded on (one all-reduce per dim and distinct placement), never
    over replicated dims, so every element is counted exactly once.
    """
    totals: dict[tuple[int, tuple[int, ...]], tuple[DeviceMesh | None, torch.Tensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            if any(p.is_partial() for p in g.placements):
                g = g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])
            # Any placement that is neither replicated nor partial shards the data
            # (FSDP+TP uses _StridedShard, for which is_shard() is False).
            dims = tuple(i for i, p in enumerate(g.placements) if not (p.is_replicate() or p.is_partial()))
            key, mesh, local = (id(g.device_mesh), dims), g.device_mesh, g.to_local()
        else:
            key, mesh, local = (0, ()), None, g
        sq = local.detach().float().pow(2).sum()
        if key in totals:
            totals[key] = (mesh, totals[key][1] + sq)
        else:
            totals[key] = (mesh, sq)
    total = torch.zeros((), dtype=torch.float32)
    for (_, dims), (mesh, sq) in totals.items():
        for dim in dims:
            dist.all_reduce(sq, group=mesh.get_group(dim))  # type: ignore[union-attr]
        total = total + sq.cpu()
    return total.sqrt()


def dtensor_clip_grad_norm_(model: nn.Module, max_norm: float) -> float:
    """Clip over the global norm of (possibly DTensor) gradients; return the norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    # Reduce Partial gradients (replicated parameters under sequence parallel) here,
    # once, so the optimizer only sees Replicate ones: torch 2.11's DTensor AdamW
    # mis-updates from a Partial gradient (norm weights 2e-5 off after two steps).
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(
                g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements]
            )
    total = dtensor_global_grad_norm([p.grad for p in params])  # type: ignore[misc]
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(params[0].grad.device))  # type: ignore[union-attr]
    return float(total)


@contextlib.contextmanager
def maybe_loss_parallel(enabled: bool) -> Iterator[None]:
    """torch's ``loss_parallel()`` when ``enabled``; otherwise nothing."""
    if enabled:
        with loss_parallel():
            yield
    else:
        yield


def set_module_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter or buffer ``name`` of ``module`` (keeping its kind)."""
    if name in module._parameters:
        old = module._parameters[name]
        requires_grad = old.requires_grad if old is not None else True
        module.register_parameter(name, nn.Parameter(value, requires_grad=requires_grad))
    else:
        persistent = name not in module._non_persistent_buffers_set
        module.register_buffer(name, value, persistent=persistent)


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
