"""The DeviceMesh internals :class:`~torchtitan_spmd.distributed.ParallelDims` uses, across torch versions.

``ParallelDims.build_mesh`` makes every mesh a view over one rank map and creates
each process group once, with torch's private layout algebra
(``torch.distributed._mesh_layout``) and ``DeviceMesh``'s private constructor
arguments. That algebra changed shape between the torch versions this project
supports, so the few calls that differ live here, chosen by feature (not by
version number) when this module is imported:

torch >= 2.13 (the fast path, used as torch ships it)
    One canonical ``_FlatLayout`` per mesh axis, ``_MeshLayout([flat, ...])`` for
    a mesh, ``_FlatLayout.composition`` to split an axis, and
    ``DeviceMesh._init_one_process_group(flat, ...)``.

torch 2.11 and 2.12 (the fallback)
    No ``_FlatLayout``: ``_MeshLayout`` is a CuTe layout whose top-level modes are
    the mesh axes. An axis is a *coalesced* ``_MeshLayout`` (several modes when it
    merges non-adjacent ranks); a mesh nests each axis into one mode, and a 1-D
    mesh takes the form torch's own ``DeviceMesh._flatten`` gives, so that
    ``_flatten`` of the same ranks finds our registered mesh instead of raising.
    ``_init_one_process_group`` takes the axis layout and nests it itself.
    1-D views take the form torch itself gives them: a flattened axis the form of
    ``DeviceMesh._flatten``, a base axis the form of slicing (``mesh["tp"]``), so
    each compares equal to the mesh torch would make for the same ranks.

Both paths give the same meshes, rank groups and group sharing (one group per
distinct rank set and real/fake kind); ``tests/layer2_mesh`` checks them against
a spec that does not use this module, on each torch version it is run on.

``DeviceMesh(_layout=..., _rank_map=..., _root_mesh=..., _init_backend=False)``,
``_pg_registry``, ``_flatten_mapping``, ``_flatten_rank_map`` and
``_dim_group_names`` are the same on every supported version. Older torch (no
``_mesh_layout``, or a ``DeviceMesh`` without those arguments) is refused at
import with an ``ImportError`` naming the version needed.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from typing import Any

import torch
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


def init_axis_group(
    layout: AxisLayout, rank_map: torch.Tensor, name: str, backend: str | None
) -> str | None:
    """Create the process groups of one axis with torch's own per-axis code.

    Returns the name of this rank's group (None if the rank is in none). ``backend``
    None means the default process group's backend; ``"fake"`` makes fake groups.
    """
    return DeviceMesh._init_one_process_group(layout, rank_map, name, (backend, None))
