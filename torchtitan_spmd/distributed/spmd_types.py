"""torchtitan's module path ``torchtitan.distributed.spmd_types``, for forks that import from it.

Re-exports the helpers of upstream's module (a0c831c49) that this library has with
upstream's signatures and meaning:

- :func:`spmd_layout_to_dtensor_placements` (``SpmdLayout`` -> DTensor placements keyed
  by mesh axis; defined with the layout language in :mod:`.layout`);
- :func:`current_spmd_mesh` and :func:`set_current_spmd_mesh` (the thread-local mesh that
  ``spmd_types``' checker and collectives read).

Upstream's plan-level helpers (``annotate_input_spmd_types``, ``spmd_distribute_tensor``,
``spmd_redistribute_per_axis``, ``spmd_validate_redistributions``, ``spmd_mesh_size``)
take upstream's ``ShardingConfig`` and model protocol; here that work is the
``spmd_types`` representation's (:mod:`.representations.spmd_types`), reached through
the trainer and the plan, so they are not re-exported under names that would promise
upstream's signatures.
"""

from __future__ import annotations

from .layout import spmd_layout_to_dtensor_placements
from .representations.spmd_types.mesh_context import current_spmd_mesh, set_current_spmd_mesh

__all__ = ["current_spmd_mesh", "set_current_spmd_mesh", "spmd_layout_to_dtensor_placements"]
