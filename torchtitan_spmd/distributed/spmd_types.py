"""torchtitan's module path ``torchtitan.distributed.spmd_types``, for forks that import from it.

Re-exports the helpers of upstream's module (a0c831c49) that this library has with
upstream's signatures and meaning:

- :func:`spmd_layout_to_dtensor_placements` (``SpmdLayout`` -> DTensor placements keyed
  by mesh axis; defined with the layout language in :mod:`.layout`);
- :func:`current_spmd_mesh` and :func:`set_current_spmd_mesh` (the thread-local mesh that
  ``spmd_types``' checker and collectives read);
- :func:`spmd_distribute_tensor` (a full tensor -> this rank's shard under an ``SpmdLayout``,
  partition-spec order deciding the slicing of a dim sharded over several axes).

Upstream's plan-level helpers (``annotate_input_spmd_types``,
``spmd_redistribute_per_axis``, ``spmd_validate_redistributions``, ``spmd_mesh_size``)
take upstream's ``ShardingConfig`` and model protocol; here that work is the
``spmd_types`` representation's (:mod:`.representations.spmd_types`), reached through
the trainer and the plan, so they are not re-exported under names that would promise
upstream's signatures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .layout import spmd_layout_to_dtensor_placements
from .representations.spmd_types.layout_types import distribute_tensor as _distribute_tensor
from .representations.spmd_types.mesh_context import current_spmd_mesh, set_current_spmd_mesh

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from .layout import SpmdLayout

__all__ = [
    "current_spmd_mesh",
    "set_current_spmd_mesh",
    "spmd_distribute_tensor",
    "spmd_layout_to_dtensor_placements",
]


def spmd_distribute_tensor(tensor: torch.Tensor, mesh: DeviceMesh, layout: SpmdLayout) -> torch.Tensor:
    """This rank's local shard of the full ``tensor`` laid out as ``layout`` on ``mesh``.

    torchtitan's helper of that name (a0c831c49), with its meaning: ``S(dim)`` axes shard
    their dim; with a ``V`` + partition-spec layout the spec's order decides how a dim
    sharded over several axes is sliced (``(dp, cp)``: by ``dp``, then each ``dp`` slice
    by ``cp``; ``(cp, dp)`` gives ranks other slices). Axes the mesh lacks or of size 1
    do not shard. Chunks follow ``torch.chunk`` like DTensor's ``Shard``. The result is
    a plain, contiguous tensor without ``spmd_types`` annotation (the representation
    annotates the states it owns).
    """
    return _distribute_tensor(tensor, mesh, layout)
