"""Backend ``default``: DTensor only on the TP axis, FSDP2 on the data-parallel axes.

- parameters are DTensors on the 1-D ``tp`` mesh with the plan's placements;
  buffers stay plain tensors (a buffer the plan shards, e.g. a tied embedding's row ids:
  this rank's shard);
- activations travel between modules as plain local tensors; a redistributing
  boundary wraps its value as a DTensor with the declared layout
  (``DTensor.from_local``) and lets DTensor redistribute it;
- the bodies of planned modules run on local shards, as ``local_map`` would: their
  DTensor parameters and inputs are handed in as ``to_local()`` views, with
  ``Partial`` gradients where a replicated input feeds a sharded or partial output
  (:func:`~._dtensor.local_grad_placements`), and the output leaves as the local
  tensor the plan declares. The plan, not DTensor's sharding propagation, says what
  each body produces; the boundaries check what arrives as a DTensor;
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
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from ..layout import SpmdLayout
from ..representation import FsdpSpec, as_parameter_like
from ._dtensor import DTensorRepresentation, local_view

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
        placements = self.placements(layout, data=False)
        if not isinstance(tensor, nn.Parameter):  # buffers stay plain: this rank's shard
            if all(isinstance(p, Replicate) for p in placements):
                return tensor
            return distribute_tensor(tensor.detach(), self._mesh(), placements, src_data_rank=None).to_local()
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
        if isinstance(x, DTensor):
            self.check_layout(x, layout, where)
        return x  # local tensors pass as they are; module bodies take local views of DTensors

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
        """The body on the local shards of its DTensor arguments, as ``local_map`` would: an argument
        replicated where the output is sharded or partial (an MoE block's gathered tokens) gets a
        ``Partial`` gradient there (:func:`~._dtensor.local_view`); activations stay local."""
        out = self.placements(out_layout, data=True)
        grads: dict[tuple[Any, ...], tuple[Any, ...]] = {}

        def local(x: Any) -> Any:
            return local_view(x, out, grads)

        @functools.wraps(forward)
        def local_forward(*args: Any, **kwargs: Any) -> Any:
            return forward(*(local(a) for a in args), **{k: local(v) for k, v in kwargs.items()})

        return local_forward

    def module_body(self, module: nn.Module, forward: Callable[..., Any], out_layout: SpmdLayout | None, *,
                    where: str) -> Callable[..., Any] | None:
        """A module that owns DTensor parameters computes on local shards, as ``local_map`` would.

        For the call its DTensor parameters (FSDP2's unsharded ones, when it has
        swapped them in) and DTensor arguments are ``to_local()`` views whose
        gradients have ``local_grad_placements`` against ``out_layout`` (:func:`~._dtensor.local_view`);
        the result is local. The plan, not DTensor's sharding propagation, says what the
        body produces; the boundaries check what arrives as a DTensor.
        """
        names = [n for n, p in module._parameters.items() if isinstance(p, DTensor)]
        if not names:
            return None
        if out_layout is None:
            raise ValueError(f"plan for {where!r}: a module with parameters needs an output layout "
                             "(what its body produces).")
        out = self.placements(out_layout, data=True)
        grads: dict[tuple[Any, ...], tuple[Any, ...]] = {}

        def local(x: Any) -> Any:
            return local_view(x, out, grads)

        @functools.wraps(forward)
        def local_params_forward(*args: Any, **kwargs: Any) -> Any:
            params = module._parameters
            saved = {n: params[n] for n in names}
            try:
                for n, p in saved.items():
                    params[n] = local(p)
                result = forward(*(local(a) for a in args), **{k: local(v) for k, v in kwargs.items()})
            finally:
                params.update(saved)
            return result  # local, laid out as out_layout: the output boundary wraps it if it redistributes

        return local_params_forward

    def fsdp_spec(self) -> FsdpSpec | None:
        pd = self.parallel_dims
        if not pd.dp_enabled:
            return None
        mesh = pd.get_mesh(["dp_replicate", "fsdp"]) if pd.dp_replicate_enabled else pd.get_mesh("fsdp")
        return FsdpSpec(mesh=mesh)


REPRESENTATION = DefaultRepresentation
