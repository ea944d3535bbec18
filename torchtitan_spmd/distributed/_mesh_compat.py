"""The DeviceMesh internals :class:`~torchtitan_spmd.distributed.ParallelDims` uses, across torch versions.

``ParallelDims.build_mesh`` makes every mesh a view over one rank map and creates
each process group once, with torch's private layout algebra
(``torch.distributed._mesh_layout``) and ``DeviceMesh``'s private constructor
arguments. That algebra changed shape between the torch versions this project
supports, so the few calls that differ live here, chosen by feature (not by
version number) when this module is imported:

torch >= 2.13 (the fast path, used as torch ships it)
    One canonical ``_FlatLayout`` per mesh axis, ``_MeshLayout([flat, ...])`` for
    a mesh, and ``_FlatLayout.composition`` to split an axis.

torch 2.11 and 2.12 (the fallback)
    No ``_FlatLayout``: ``_MeshLayout`` is a CuTe layout whose top-level modes are
    the mesh axes. An axis is a *coalesced* ``_MeshLayout`` (several modes when it
    merges non-adjacent ranks); a mesh nests each axis into one mode, and a 1-D
    mesh takes the form torch's own ``DeviceMesh._flatten`` gives, so that
    ``_flatten`` of the same ranks finds our registered mesh instead of raising.
    1-D views take the form torch itself gives them: a flattened axis the form of
    ``DeviceMesh._flatten``, a base axis the form of slicing (``mesh["tp"]``), so
    each compares equal to the mesh torch would make for the same ranks.

Process groups (:func:`init_axis_group`) are created the same way on both: only
this rank's group of each axis, found from the axis' sizes and strides
(:func:`axis_ranks`), with ``new_group(use_local_synchronization=True)``; torch's
own ``DeviceMesh._init_one_process_group`` only where it makes one call per rank
(an axis over the whole world, or a device-bound NCCL default group).

Both paths give the same meshes, rank groups and group sharing (one group per
distinct rank set and real/fake kind); ``tests/layer2_mesh`` checks them against
a spec that does not use this module, on each torch version it is run on.

``DeviceMesh(_layout=..., _rank_map=..., _root_mesh=..., _init_backend=False)``,
``DeviceMesh._init_one_process_group(axis, rank_map, name, (backend, options))``,
``_pg_registry``, ``_flatten_mapping``, ``_flatten_rank_map`` and
``_dim_group_names`` are the same on every supported version. Older torch (no
``_mesh_layout``, or a ``DeviceMesh`` without those arguments) is refused at
import with an ``ImportError`` naming the version needed.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._pycute import flatten
from torch.distributed.device_mesh import DeviceMesh

#: The oldest torch whose DeviceMesh internals this module supports.
MIN_TORCH = "2.11"
_NEEDED_INIT_ARGS = ("_layout", "_rank_map", "_root_mesh", "_init_backend")


def _unsupported(why: str) -> ImportError:
    return ImportError(
        f"torchtitan_spmd's mesh layer needs torch >= {MIN_TORCH} ({why}); found torch "
        f"{torch.__version__}. Install torch>={MIN_TORCH}."
    )


try:
    _mesh_layout = importlib.import_module("torch.distributed._mesh_layout")
except ImportError as exc:
    raise _unsupported("torch.distributed._mesh_layout is missing") from exc

_missing = [
    a for a in _NEEDED_INIT_ARGS if a not in inspect.signature(DeviceMesh.__init__).parameters
]
if _missing:  # pragma: no cover - torch < 2.11
    raise _unsupported(f"DeviceMesh.__init__ takes no {', '.join(_missing)}")

_MeshLayout: Any = _mesh_layout._MeshLayout
_FlatLayout: Any = getattr(_mesh_layout, "_FlatLayout", None)

#: Whether this torch has ``_FlatLayout`` (torch >= 2.13): the fast path.
HAS_FLAT_LAYOUT: bool = _FlatLayout is not None

#: One mesh axis' layout: a ``_FlatLayout`` (fast path) or a coalesced
#: ``_MeshLayout`` (fallback). Hashable and compared by value on both.
AxisLayout = Any

__all__ = [
    "HAS_FLAT_LAYOUT",
    "MIN_TORCH",
    "AxisLayout",
    "axis_layout",
    "axis_ranks",
    "default_group_timeout",
    "init_axis_group",
    "mesh_layout",
    "split_axis",
]


def axis_layout(sizes: Sequence[int], strides: Sequence[int]) -> AxisLayout:
    """The layout of one mesh axis that merges (row-major) modes of ``sizes`` and ``strides``."""
    if HAS_FLAT_LAYOUT:
        return _FlatLayout(tuple(sizes), tuple(strides))
    return _MeshLayout(tuple(sizes), tuple(strides)).coalesce()


def split_axis(layout: AxisLayout, outer: int, inner: int) -> tuple[AxisLayout, AxisLayout]:
    """Split one axis row-major into ``(outer, inner)``; return the two axes' layouts."""
    if outer * inner != layout.numel():
        raise ValueError(f"cannot split an axis of {layout.numel()} ranks into {outer} x {inner}")
    if HAS_FLAT_LAYOUT:
        out, inn = layout.composition(_MeshLayout.from_sizes_strides((outer, inner)))
        return out, inn
    both = layout.composition(_MeshLayout((outer, inner), (inner, 1)))
    return both[0].coalesce(), both[1].coalesce()


def mesh_layout(axes: Sequence[AxisLayout], *, flattened: bool = False) -> Any:
    """The ``_layout`` of a ``DeviceMesh`` whose dimensions are ``axes``, outermost first.

    ``flattened``: a 1-D mesh that merges several axes of the root, registered as a
    flattened mesh. The fallback then takes the form ``DeviceMesh._flatten`` gives
    (which is not the form slicing gives), so that torch finds it equal to its own;
    the fast path's canonical layouts need no such care.
    """
    if HAS_FLAT_LAYOUT:
        return _MeshLayout(list(axes))
    if flattened:
        # As DeviceMesh._flatten: the coalesced layout, nested into one mode only
        # when it has several.
        (axis,) = axes
        return axis if len(axis) == 1 else axis.nest()
    # As DeviceMesh slicing: one (possibly nested) mode per axis.
    return _MeshLayout(tuple(a.shape for a in axes), tuple(a.stride for a in axes))


def _modes(layout: AxisLayout) -> list[tuple[int, int]]:
    """The (size, stride) modes of an axis layout, outermost first, size-1 modes left out."""
    shape, stride = flatten(layout.shape), flatten(layout.stride)
    return [(size, step) for size, step in zip(shape, stride, strict=True) if size > 1]


def axis_ranks(layout: AxisLayout, rank_map: torch.Tensor, rank: int) -> list[int] | None:
    """The ranks of ``rank``'s subgroup of one axis, in mesh order; None if ``rank`` is in none.

    The row of ``_MeshLayout([layout]).remap_to_tensor(rank_map)`` that holds ``rank``,
    computed from the layout's sizes and strides in O(axis size), without the
    world-sized 2-D tensor: the axis' coordinates of a position are its mixed-radix
    digits, ``(position // stride) % size`` for each mode, which holds for every
    layout that has a complement (its modes, sorted by stride, leave gaps that other
    modes can fill: ``size * stride`` of each divides the next stride and the world).
    """
    flat = rank_map.reshape(-1)
    world = flat.numel()
    if 0 <= rank < world and int(flat[rank]) == rank:
        position = rank  # the identity rank map: build_mesh's
    else:
        hits = (flat == rank).nonzero()
        if hits.numel() == 0:
            return None
        position = int(hits[0, 0])
    modes = _modes(layout)
    span = 1
    for size, step in sorted(modes, key=lambda m: m[1]):
        if step % span:
            raise ValueError(f"axis layout {layout} has no complement in a world of {world} ranks")
        span = step * size
    if world % span:
        raise ValueError(f"axis layout {layout} has no complement in a world of {world} ranks")
    base = position - sum(((position // step) % size) * step for size, step in modes)
    offsets = torch.zeros(1, dtype=torch.long)
    for size, step in modes:  # row-major over the modes, as remap_to_tensor
        offsets = (offsets[:, None] + torch.arange(size, dtype=torch.long) * step).reshape(-1)
    return flat[base + offsets].tolist()


def default_group_timeout(device_type: str) -> timedelta | None:
    """The timeout the default process group was created with, on ``device_type``'s backend.

    None when the backend keeps no options (torch's fake backend): torch's default then.
    """
    default = dist.distributed_c10d._get_default_group()
    try:
        options = default._get_backend(torch.device(device_type)).options
    except (RuntimeError, AttributeError):  # no backend for that device, or no options
        return None
    return getattr(options, "_timeout", None)


def _splits_default_group() -> bool:
    """Whether torch creates a real axis' groups with one ``split_group`` of the default group.

    As ``DeviceMesh._init_one_process_group``: the default group has a bound device
    (NCCL with ``device_id``) and CUDA is there. Never on CPU or gloo.
    """
    default = dist.distributed_c10d._get_default_group()
    return getattr(default, "bound_device_id", None) is not None and torch.cuda.is_available()


def local_tensor_mode_active() -> bool:
    """Whether torch's ``LocalTensorMode`` (one process simulating every rank) is on; False on a
    torch without it."""
    try:
        from torch.distributed._local_tensor import local_tensor_mode  # noqa: PLC0415
    except ImportError:
        return False
    return local_tensor_mode() is not None


def outside_local_tensor_mode() -> AbstractContextManager[Any]:
    """A context with torch's ``LocalTensorMode`` off (nothing when it is not on): what runs in it
    computes one value, not one per simulated rank."""
    if not local_tensor_mode_active():
        return nullcontext()
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode  # noqa: PLC0415

    return maybe_disable_local_tensor_mode()


def _this_rank() -> int:
    """``dist.get_rank()``; under torch's ``LocalTensorMode`` (one process simulating every rank,
    on a fake default group) rank 0: its ``get_rank`` is then one symbolic value for all the
    simulated ranks, and the mode's collectives derive every rank's subgroup from rank 0's (they
    take a group's ranks as a layout and its complement over the world)."""
    return 0 if local_tensor_mode_active() else dist.get_rank()


def init_axis_group(
    layout: AxisLayout,
    rank_map: torch.Tensor,
    name: str,
    backend: str | None,
    timeout: timedelta | None = None,
) -> str | None:
    """Create this rank's process group of one axis; return its name (None if in none).

    ``backend`` None means the default process group's backend; ``"fake"`` makes a
    fake group. One group-creation call per rank, whatever the world size:

    - a real axis over the whole world, or any real axis when the default group has a
      bound device: torch's own ``DeviceMesh._init_one_process_group``, which then
      reuses the default group, or makes one ``split_group`` call for the axis;
    - otherwise only this rank's subgroup (:func:`axis_ranks`), with
      ``new_group(use_local_synchronization=True)``: only its members call it. Torch
      names such a group by hashing its ranks with a per-process count of the groups
      created before (``_world.group_count`` on torch 2.14, ``len(_world.pg_names)``
      before), so two groups over the same ranks (a real and a fake one) get
      different names, and the members agree on the name when every rank has
      created as many groups before: ``build_mesh`` makes one call per distinct
      axis on every rank, in the same order. Torch's own routine instead makes
      every rank call ``new_group`` for every subgroup of the axis.

    ``timeout``: of the groups ``new_group`` creates here (None: torch's default;
    the default group and ``split_group``'s groups keep torch's).
    """
    if backend is None and (layout.numel() == dist.get_world_size() or _splits_default_group()):
        return DeviceMesh._init_one_process_group(layout, rank_map, name, (None, None))
    ranks = axis_ranks(layout, rank_map, _this_rank())
    if ranks is None:
        return None
    group = dist.new_group(
        ranks,
        timeout=timeout,
        backend=backend,
        use_local_synchronization=True,
        group_desc=f"mesh_{name}",
    )
    return group.group_name if isinstance(group, dist.ProcessGroup) else None
