"""``SpmdLayout`` -> ``spmd_types`` annotations on a mesh, and slicing a full tensor to a shard."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import spmd_types as st  # the library (absolute import), not this package
import torch
from spmd_types import R, S, V
from spmd_types.types import Shard
from torch.distributed.device_mesh import DeviceMesh

from ...layout import SpmdLayout
from .mesh_context import active, axis_names, group

__all__ = ["annotate", "axis_kind", "distribute_tensor", "layout_type", "state_type", "with_batch_axis"]


def axis_kind(layout: SpmdLayout, axis: str) -> Any:
    """``R``, ``I``, ``P`` or ``S(dim)`` of ``axis`` in ``layout`` (``V`` spec axes -> ``S``)."""
    dims = layout.shard_dims()
    if axis in dims:
        return S(dims[axis])
    return layout.types.get(axis, R)


def layout_type(
    layout: SpmdLayout,
    mesh: DeviceMesh,
    *,
    axes: Sequence[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> tuple[dict[Any, Any], st.PartitionSpec | None]:
    """``(types, partition_spec)`` for ``spmd_types.assert_type``, keyed by process group.

    ``axes``: the axes to describe (default: those ``layout`` mentions); ``defaults``:
    types for axes ``layout`` does not mention (e.g. ``R`` on dp for parameters).
    Inactive axes are left out (spmd_types drops singleton axes anyway).
    """
    names = axis_names(mesh)
    if axes is None:
        axes = [a for a in names if a in layout.types or a in layout.shard_dims()]
        axes += [a for a in (defaults or {}) if a in names and a not in axes]
    types: dict[Any, Any] = {}
    spec: st.PartitionSpec | None = None
    multi = layout.partition_spec is not None and any(
        len(layout.shard_order(d)) > 1 for d in set(layout.shard_dims().values())
    )
    for axis in axes:
        if not active(mesh, axis):
            continue
        if axis not in layout.types and axis not in layout.shard_dims() and defaults and axis in defaults:
            typ = defaults[axis]
        else:
            typ = axis_kind(layout, axis)
        types[group(mesh, axis)] = V if (multi and isinstance(typ, Shard)) else typ
    if multi:
        entries = []
        for entry in layout.partition_spec or ():
            names_ = (entry,) if isinstance(entry, str) else (entry or ())
            live = tuple(group(mesh, a) for a in names_ if active(mesh, a))
            entries.append(None if not live else live[0] if len(live) == 1 else live)
        spec = st.PartitionSpec(*entries)
    return types, spec


def with_batch_axis(layout: SpmdLayout, axis: str = "dp") -> SpmdLayout:
    """``layout`` with the batch (dim 0) sharded on ``axis`` too, outermost.

    ``S(0)`` on ``axis``, or, for a layout with a partition spec, ``axis`` put first in
    the spec's dim-0 entry (typed ``V``).
    """
    if layout.partition_spec is None:
        return layout.with_types(**{axis: S(0)})
    spec = list(layout.partition_spec)
    first = spec[0] if spec else None
    rest = (first,) if isinstance(first, str) else (first or ())
    head = (axis, *rest)
    spec[0:1] = [head if len(head) > 1 else axis]
    return SpmdLayout({**layout.axis_types, axis: V}, partition_spec=tuple(spec))


def state_type(layout: SpmdLayout, mesh: DeviceMesh) -> tuple[dict[Any, Any], st.PartitionSpec | None]:
    """The type of a parameter/buffer: ``layout`` on its axes, ``R`` on every other active axis.

    The data-parallel axes must be ``R`` for FSDP, and FSDP wants every storage axis annotated.
    """
    names = axis_names(mesh)
    return layout_type(layout, mesh, axes=[a for a in names if active(mesh, a)],
                       defaults=dict.fromkeys(names, R))


def annotate(tensor: torch.Tensor, types: dict[Any, Any], spec: st.PartitionSpec | None) -> None:
    """``spmd_types.assert_type`` on a plain tensor (no-op without types)."""
    if types:
        st.assert_type(tensor, types, partition_spec=spec)


def _chunk(tensor: torch.Tensor, n: int, dim: int, index: int) -> torch.Tensor:
    """Chunk ``index`` of ``n`` along ``dim``, as DTensor's ``Shard`` (empty past the end)."""
    chunks = torch.chunk(tensor, n, dim=dim)
    if index < len(chunks):
        return chunks[index]
    shape = list(tensor.shape)
    shape[dim] = 0
    return tensor.new_empty(shape)


def distribute_tensor(tensor: torch.Tensor, mesh: DeviceMesh, layout: SpmdLayout) -> torch.Tensor:
    """This rank's (unannotated, contiguous) shard of the full ``tensor`` under ``layout``.

    Axes sharding the same dim are applied in partition-spec order (outermost
    first): ``(dp, tp)`` on dim 0 chunks by ``dp``, then each ``dp`` chunk by ``tp``.
    Chunking follows ``torch.chunk`` like DTensor's ``Shard`` (uneven splits give the
    last ranks smaller, possibly empty, shards).
    """
    with torch.no_grad():
        local = tensor
        dims = layout.shard_dims()
        for dim in sorted(set(dims.values())):
            for axis in layout.shard_order(dim):
                if active(mesh, axis):
                    local = _chunk(local, mesh.size(axis_names(mesh).index(axis)), dim,
                                   mesh.get_local_rank(axis))
        if local is tensor:
            local = tensor.detach()
        return local.contiguous()
