"""Observers for the spmd_types feature runs (see ``feature_helpers.run_steps``; layer-3's are
in ``tests/layer3_runtime/probes.py``)."""

from __future__ import annotations

from typing import Any

from probes import _inner_block, _per_step

from torchtitan_spmd.distributed.spmd_types import current_spmd_mesh

__all__ = ["block_calls_on_mesh"]


def block_calls_on_mesh(trainer: Any) -> dict[str, Any]:
    """Per step, how many times the first block's body runs with the forward mesh current
    (thread-local ``current_spmd_mesh()``): 2 when backward's recompute sees it too."""
    counter = [0]
    mesh = trainer.representation.forward_mesh

    def hook(*_: Any) -> None:
        counter[0] += current_spmd_mesh() is mesh

    _inner_block(trainer).register_forward_pre_hook(hook)
    per_step = _per_step(trainer, counter)
    return {"result": lambda: per_step}
