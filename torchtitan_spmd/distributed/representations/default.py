"""Backend ``default``: DTensor only on the TP axis, FSDP2 on the data-parallel axes.

- parameters are DTensors on the 1-D ``tp`` mesh with the plan's placements;
  buffers stay plain tensors;
- activations travel between modules as plain local tensors: a module that
  computes with its (DTensor) parameters sees DTensors (``DTensor.from_local``
  with the declared layout), a redistributing boundary hands the module body a
  DTensor, and every output leaves as a local tensor;
- FSDP2 ``fully_shard`` on the ``fsdp`` mesh, or ``(dp_replicate, fsdp)`` for HSDP.

Without tensor parallelism nothing is a DTensor before FSDP: there is no forward mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from ..layout import SpmdLayout
from ..representation import FsdpSpec, as_parameter_like
from ._dtensor import DTensorRepresentation

if TYPE_CHECKING:
    from ..parallel_dims import ParallelDims

__all__ = ["REPRESENTATION", "DefaultRepresentation"]


class DefaultRepresentation(DTensorRepresentation):
    """DTensor on TP, FSDP2 on DP; see the module docstring."""

    name: ClassVar[str] = "default"

    @staticmethod
    def resolve_forward_mesh(parallel_dims: ParallelDims) -> DeviceMesh | None:
        return parallel_dims.get_optional_mesh("tp")

    def distribute(self, tensor: torch.Tensor, layout: SpmdLayout) -> torch.Tensor:
        if not isinstance(tensor, nn.Parameter):
            return tensor  # buffers stay plain
        placements = self.placements(layout, data=False)
        return as_parameter_like(tensor, distribute_tensor(tensor.detach(), self._mesh(), placements,
                                                           src_data_rank=None))

    def from_local(self, x: torch.Tensor, layout: SpmdLayout) -> torch.Tensor:
        return x  # activations are local

    def _wrap(self, x: torch.Tensor, layout: SpmdLayout, where: str) -> DTensor:
        if isinstance(x, DTensor):
            self.check_layout(x, layout, where)
            return x
        return DTensor.from_local(x, self._mesh(), self.placements(layout, data=True), run_check=False)

    def arrive(self, x: Any, layout: SpmdLayout, *, module: nn.Module, where: str) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if isinstance(x, DTensor) or any(True for _ in module.parameters(recurse=False)):
            return self._wrap(x, layout, where)
        return x  # a module that only passes a local tensor on

    def redistribute(self, x: Any, src: SpmdLayout, dst: SpmdLayout, *, where: str) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return self.redistribute_dtensor(self._wrap(x, src, where), src, dst, where)

    def depart(self, x: Any, layout: SpmdLayout | None, *, where: str) -> Any:
        if not isinstance(x, DTensor):
            return x
        if layout is not None:
            self.check_layout(x, layout, where)
        return x.to_local()

    def local_region(self, forward: Callable[..., Any], out_layout: SpmdLayout, *,
                     where: str) -> Callable[..., Any]:
        @functools.wraps(forward)
        def local_forward(*args: Any, **kwargs: Any) -> Any:
            return self.local_body(forward, *args, **kwargs)  # activations stay local

        return local_forward

    def fsdp_spec(self) -> FsdpSpec | None:
        pd = self.parallel_dims
        if not pd.dp_enabled:
            return None
        mesh = pd.get_mesh(["dp_replicate", "fsdp"]) if pd.dp_replicate_enabled else pd.get_mesh("fsdp")
        return FsdpSpec(mesh=mesh)


REPRESENTATION = DefaultRepresentation
