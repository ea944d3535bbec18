"""One set of meshes per layout and world, and DTensor's sharding caches kept while they are valid.

DTensor caches each operator's sharding decision (``propagate_op_sharding``, in Python and in
C++), keyed on the input specs and so on their meshes' *equality*: two meshes over the same ranks
with the same names and shape are equal, even when they hold different process groups. A cached
decision hands back the mesh object it was computed on. A second trainer in one process (a
notebook, a test's long-lived ranks, a fake-process-group set-up before a fork) would then get an
earlier trainer's mesh: groups that may no longer exist, or fully_shard's "different mesh
objects". So the caches used to be cleared for every trainer, and every trainer paid DTensor's
first sight of each operator again (on a 10-step CPU parity run, about two thirds of its time:
docs/benchmarks.md, "The test suite").

Here instead:

* :meth:`~torchtitan_spmd.distributed.parallel_dims.ParallelDims.build_mesh` hands a
  ``ParallelDims`` of the same degrees, backend and device as the previous build, on the same
  default process group, the *same* mesh objects and groups (:func:`reusable` /
  :func:`remember`). Another layout, or another default group (destroyed and created again),
  builds anew and replaces them.
* The caches are cleared (:func:`clear_dtensor_sharding_caches`) whenever they could hold a mesh
  other than the ones handed out: at every build of new meshes, and at a reuse when any live mesh
  in the process is not a view of the kept world mesh (:func:`settle_caches`). Only a build that
  reuses the previous build's meshes, with no other mesh alive, keeps them.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import planner_memo

__all__ = ["BuiltMeshes", "clear_dtensor_sharding_caches", "remember", "reusable", "settle_caches"]


def clear_dtensor_sharding_caches() -> None:
    """Forget DTensor's cached sharding propagations (the Python and the C++ cache) and its
    redistribution planners.

    They key on mesh *equality*: with a second, equal mesh in the process (another trainer, a
    benchmark, a notebook) they hand back the first mesh object, and
    ``fully_shard(dp_mesh_dims=...)`` then fails with "different mesh objects". Each planner
    (``torch.distributed.tensor._redistribute._planner_cache``, keyed on a weak reference to its
    mesh) holds its mesh strongly, so without this a mesh, and its groups, outlived every trainer
    that used it.
    """
    from torch.distributed.tensor import DTensor, _redistribute  # noqa: PLC0415 - heavy

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:  # (where this torch has the cache)
        clear_planners()
    planner_memo.clear()  # its keys hold specs, and so meshes


@dataclass
class BuiltMeshes:
    """The meshes and groups one ``ParallelDims`` built, and the default group they stand on."""

    default_group: Any
    world_mesh: DeviceMesh
    meshes: dict[tuple[str, ...], DeviceMesh]
    groups: dict[Any, str]


#: The last build's key and meshes (one entry: a build of another layout replaces it).
_LAST: list[tuple[tuple[Any, ...], BuiltMeshes]] = []


def _default_group() -> Any:
    return dist.distributed_c10d._get_default_group()


def reusable(key: tuple[Any, ...]) -> BuiltMeshes | None:
    """The meshes of the last build, if it was of ``key`` and on the current default group."""
    if _LAST and _LAST[0][0] == key and _LAST[0][1].default_group is _default_group():
        return _LAST[0][1]
    return None


def remember(key: tuple[Any, ...], built: BuiltMeshes) -> None:
    """Keep ``built`` (only it) for the next ``ParallelDims`` of ``key`` on this default group."""
    _LAST[:] = [(key, built)]


def _root(mesh: DeviceMesh) -> DeviceMesh:
    root = getattr(mesh, "_root_mesh", None)
    return mesh if root is None else root


def _only_kept_meshes_alive() -> bool:
    """Whether every live ``DeviceMesh`` in the process is a view of the kept world mesh.

    A cache entry keeps its mesh alive, so when this holds the caches refer to no other mesh.
    Dropped meshes refer to each other, so they wait for the cycle collector: when a look at
    the tracked objects finds only views of the kept world (the usual case: the previous trainer
    of this layout used the very same meshes), collecting could only remove meshes and the answer
    stands; otherwise the process is collected and looked at again. (A full collection touches
    every object, in a forked rank the parent's too: it was four fifths of this check's cost.)
    """
    if not _LAST:
        return False
    world = _LAST[0][1].world_mesh
    kinds = _mesh_types()  # by type, not isinstance: DeviceMesh's isinstance is a slow metaclass hook
    if _all_views_of(world, kinds):
        return True
    gc.collect()
    return _all_views_of(world, kinds)


def _all_views_of(world: DeviceMesh, kinds: set[type]) -> bool:
    """Whether every ``DeviceMesh`` the collector tracks (``kinds``: the class and its subclasses)
    is ``world`` or a view of it.

    Found as the objects that refer to their class (an instance of a Python class refers to it):
    the collector walks the objects' references in C, reading them only, where listing every
    object (``gc.get_objects``) takes a reference to each, so that a forked rank copies the pages
    of its parent's whole heap, and then tests each in Python (measured: 3.4x the time).
    """
    return all(_root(obj) is world for obj in gc.get_referrers(*kinds) if type(obj) in kinds)


def _mesh_types() -> set[type]:
    """``DeviceMesh`` and its subclasses, now."""
    kinds, todo = set(), [DeviceMesh]
    while todo:
        kind = todo.pop()
        if kind not in kinds:
            kinds.add(kind)
            todo.extend(kind.__subclasses__())
    return kinds


def settle_caches(*, reused: bool) -> bool:
    """Clear DTensor's sharding caches unless they can refer only to the kept meshes; return
    whether they were kept.

    Kept only when ``reused`` (this build hands out the previous build's mesh objects: same
    layout, same default group) and no other mesh is alive in the process.
    """
    keep = reused and _only_kept_meshes_alive()
    if not keep:
        clear_dtensor_sharding_caches()
    return keep
