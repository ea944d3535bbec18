"""Technique: materialise a model built on the meta device and initialise it after sharding.

The weights do not depend on the layout: for every parameter and buffer the model
computes the *full* initial tensor from the seed and the tensor's name
(``model.initial_value(fqn, shape, seed)``), and each rank copies its own shard of it
into its local storage, through the representation's DTensor view of that state
(:meth:`~torchtitan_spmd.distributed.representation.TensorRepresentation.to_dtensor`).
So a run on one process and a run on any mesh start from the same full weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan_spmd.distributed._mesh_compat import outside_local_tensor_mode
from torchtitan_spmd.distributed.apply_plan import resolve_state
from torchtitan_spmd.distributed.representation import StateLayout, TensorRepresentation

__all__ = ["InitializableModel", "init_weights"]


class InitializableModel(Protocol):
    """What :func:`init_weights` needs from a model."""

    def initial_value(self, fqn: str, shape: Sequence[int], seed: int) -> torch.Tensor:
        """The full initial value of parameter or buffer ``fqn`` of full ``shape`` (CPU, float32)."""
        ...


def _state(model: nn.Module, fqn: str) -> torch.Tensor:
    module, name = resolve_state(model, fqn)
    return module._parameters[name] if name in module._parameters else module._buffers[name]  # type: ignore[return-value]


@torch.no_grad()
def init_weights(model: nn.Module, states: Mapping[str, StateLayout], representation: TensorRepresentation,
                 *, seed: int, device: torch.device | str) -> None:
    """Allocate ``model``'s storage on ``device`` and fill every state with its shard of the full value.

    ``states``: what :func:`~torchtitan_spmd.distributed.apply_plan.apply_plan` returned.
    """
    representation.materialize(model, states, device)
    for fqn, state in states.items():
        view = representation.to_dtensor(_state(model, fqn), state)
        with outside_local_tensor_mode():  # one full value, not one draw per simulated rank
            full = model.initial_value(fqn, state.global_shape, seed)  # type: ignore[operator]
        if tuple(full.shape) != tuple(state.global_shape):
            raise ValueError(f"{type(model).__name__}.initial_value({fqn!r}) has shape {tuple(full.shape)}, "
                             f"expected {tuple(state.global_shape)}.")
        if isinstance(view, DTensor):
            full = full.to(device=view.device, dtype=view.dtype)
            local = distribute_tensor(full, view.device_mesh, view.placements, src_data_rank=None).to_local()
            view.to_local().copy_(local)
        else:
            view.copy_(full)
