"""What the two DTensor representations (``default``, ``full_dtensor``) share."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

from ..layout import SpmdLayout
from ..parallel_dims import unfold_dp_axes
from ..representation import StateLayout, TensorRepresentation

#: The data-parallel axes of a dense mesh.
DATA_PARALLEL_AXES: tuple[str, ...] = tuple(unfold_dp_axes(["dp"]))


def local_grad_placements(inputs: Any, output: Any) -> tuple[Any, ...]:
    """The placements of the gradient of a local computation's input (or parameter).

    The input's own placements, except ``Partial`` on a mesh dim where the input is
    replicated and the output is not (sharded or a pending sum): each rank's output
    depends on the whole input, so each rank holds a part of its gradient -- a
    colwise linear's input, a replicated norm weight under sequence parallelism.
    """
    return tuple(Partial() if isinstance(i, Replicate) and not isinstance(o, Replicate) else i
                 for i, o in zip(inputs, output, strict=True))


def local_view(x: Any, output: tuple[Any, ...], cache: dict[tuple[Any, ...], tuple[Any, ...]]) -> Any:
    """``x``'s local shard as an autograd view whose gradient has :func:`local_grad_placements`
    against the ``output`` placements (``cache``: those already worked out, by input
    placements); anything but a DTensor is returned as it is."""
    if not isinstance(x, DTensor):
        return x
    placements = x.placements
    if torch.compiler.is_compiling():  # traced: no cache (a mutated dict is a guard and a side effect)
        return x.to_local(grad_placements=local_grad_placements(placements, output))
    if placements not in cache:
        cache[placements] = local_grad_placements(placements, output)
    return x.to_local(grad_placements=cache[placements])


class DTensorRepresentation(TensorRepresentation):
    """Shared by the DTensor backends: placements, local views, state-dict views, loss parallel."""

    def placements(self, layout: SpmdLayout, *, data: bool, like: DTensor | None = None) -> tuple[Any, ...]:
        """DTensor placements of ``layout`` on the forward mesh.

        On the data-parallel axes: those of ``like`` if given (boundaries only move the
        model axes), else ``Shard(0)`` for batch data or ``Replicate()`` for states.
        """
        mesh = self._mesh()
        names = mesh.mesh_dim_names or ()
        model_axes = [a for a in names if a not in DATA_PARALLEL_AXES]
        model = dict(zip(model_axes, layout.placements(model_axes), strict=True))
        out = []
        for i, axis in enumerate(names):
            if axis not in DATA_PARALLEL_AXES:
                out.append(model[axis])
            elif like is not None:
                out.append(like.placements[i])
            else:
                out.append(Shard(0) if data else Replicate())
        return tuple(out)

    def _mesh(self) -> DeviceMesh:
        if self.forward_mesh is None:
            raise RuntimeError(f"spmd_backend={self.name!r}: no forward mesh (nothing is distributed).")
        return self.forward_mesh

    def check_layout(self, x: DTensor, layout: SpmdLayout, where: str) -> None:
        """Raise RuntimeError unless ``x`` is laid out as ``layout`` on the model axes."""
        if tuple(x.placements) != self.placements(layout, data=True, like=x):
            raise RuntimeError(f"{where}: arrives as {x.placements} but the plan declares {layout}; fix the plan.")

    def redistribute_dtensor(self, x: DTensor, src: SpmdLayout, dst: SpmdLayout, where: str) -> DTensor:
        """Check that ``x`` is ``src``, then redistribute its model axes to ``dst``."""
        self.check_layout(x, src, where)
        want = self.placements(dst, data=True, like=x)
        return x if tuple(x.placements) == want else x.redistribute(x.device_mesh, want)

    def to_local(self, x: torch.Tensor) -> torch.Tensor:
        return x.to_local() if isinstance(x, DTensor) else x

    def sum_over_batch(self, x: torch.Tensor) -> torch.Tensor:
        out = x.detach().clone()
        loss_mesh = self.parallel_dims.get_optional_mesh("loss")
        if loss_mesh is not None:
            dist.all_reduce(out, group=loss_mesh.get_group())
        return out

    def to_dtensor(self, tensor: torch.Tensor, state: StateLayout) -> torch.Tensor:
        if isinstance(tensor, DTensor) or self.forward_mesh is None:
            return tensor
        return DTensor.from_local(
            tensor, self.forward_mesh, self.placements(state.layout, data=False), run_check=False,
            shape=state.global_shape, stride=torch.empty(state.global_shape, device="meta").stride(),
        )

    @classmethod
    def train_context(cls, forward_mesh: DeviceMesh | None, *, loss_parallel: bool,
                      typechecking: bool) -> AbstractContextManager[None]:
        return torch_loss_parallel() if loss_parallel else nullcontext()
