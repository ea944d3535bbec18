"""Backend ``full_dtensor``: every parameter, buffer and input is a DTensor on one mesh.

The dense mesh ``(dp_replicate, dp_shard, cp, tp)`` (inactive axes dropped; on one
rank the 1-rank ``dp_shard`` mesh):

- parameters and buffers: ``Replicate`` on the data-parallel axes, the plan's
  layout on the model axes; FSDP shards their storage over ``dp_shard`` with
  ``fully_shard(mesh, dp_mesh_dims=DataParallelMeshDims(...))``;
- data: ``Shard(0)`` on the data-parallel axes, the plan's layout elsewhere;
- every plan boundary must receive DTensors (a plain tensor is an error) and
  redistributes only their model axes;
- local regions (attention's SDPA, which DTensor cannot shard on every device)
  run on the local shards, wrapped back into DTensors; an input replicated on an
  axis where the output is sharded gets a ``Partial`` gradient there (each rank's
  contribution);
- context parallelism: data is ``Shard(1)`` on ``cp`` too; the attention kernel's local
  region gets this rank's ``Shard(2)@cp`` queries, keys and values, and its ring
  attention exchanges keys and values over the ``cp`` group itself; FSDP shards over
  ``dp_shard x cp`` (torchtitan's ``fsdp`` axis), which sums the gradients over ``cp``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

try:  # fully_shard(dp_mesh_dims=...) for DTensor parameters on the dense mesh: torch >= 2.13
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # torch 2.11: full_dtensor runs without data parallelism only
    DataParallelMeshDims = None  # type: ignore[assignment,misc]

from ..layout import SpmdLayout
from ..representation import FsdpSpec, as_parameter_like
from ._dtensor import DTensorRepresentation, local_grad_placements, local_view

if TYPE_CHECKING:
    from torch import nn

    from torchtitan_spmd.config import JobConfig

    from ..parallel_dims import ParallelDims

__all__ = ["FSDP_MIN_TORCH", "REPRESENTATION", "FullDTensorRepresentation", "local_grad_placements"]

#: The torch that first has FSDP's ``DataParallelMeshDims`` (2.11 lacks it).
FSDP_MIN_TORCH = "2.13"


class FullDTensorRepresentation(DTensorRepresentation):
    """Everything a DTensor on the dense mesh; see the module docstring."""

    name: ClassVar[str] = "full_dtensor"

    @staticmethod
    def resolve_forward_mesh(parallel_dims: ParallelDims) -> DeviceMesh | None:
        mesh = parallel_dims.resolve_mesh(["dp", "cp", "tp"])
        if mesh is not None and parallel_dims.cp_enabled:
            # Under CP the mesh layer keeps dp_shard (FSDP's dp_shard x cp) even at size 1;
            # leave size-1 axes out: they hold no data, and DTensor's sharding search over
            # sequence-sharded activations grows with the mesh's dims (a 2-D (1, cp) mesh
            # costs several times a 1-D one in the first step).
            live = [n for n in mesh.mesh_dim_names or () if parallel_dims.axis_size(n) > 1]
            if len(live) < mesh.ndim:
                mesh = parallel_dims.get_optional_mesh(live)
        if mesh is None:
            mesh = parallel_dims.get_optional_mesh("dp_shard", include_singleton_axes=True)
        if mesh is None:
            raise RuntimeError("full_dtensor: ParallelDims built no dp_shard mesh; call build_mesh() first.")
        return mesh

    def validate(self, job_config: JobConfig) -> None:
        super().validate(job_config)
        self._check_fsdp_support()

    def _check_fsdp_support(self) -> None:
        self.require_torch_for_data_parallel(
            FSDP_MIN_TORCH, "FSDP2's fully_shard(dp_mesh_dims=DataParallelMeshDims(...)) for DTensor "
            "parameters", available=DataParallelMeshDims is not None)

    def distribute(self, tensor: torch.Tensor, layout: SpmdLayout) -> torch.Tensor:
        local = distribute_tensor(tensor.detach(), self._mesh(), self.placements(layout, data=False),
                                  src_data_rank=None)
        return as_parameter_like(tensor, local)

    def from_local(self, x: torch.Tensor, layout: SpmdLayout) -> torch.Tensor:
        return DTensor.from_local(x, self._mesh(), self.placements(layout, data=True), run_check=False)

    def _global(self, x: torch.Tensor, where: str) -> DTensor:
        if not isinstance(x, DTensor):
            raise TypeError(
                f"full_dtensor: a plain torch.Tensor reached {where}; every input must be a DTensor "
                "(prepare inputs with torchtitan_spmd.distributed.inputs.prepare_inputs)."
            )
        return x

    def arrive(self, x: Any, layout: SpmdLayout, *, module: nn.Module, where: str) -> Any:
        if isinstance(x, torch.Tensor):
            self.check_layout(self._global(x, where), layout, where)
        return x

    def redistribute(self, x: Any, src: SpmdLayout, dst: SpmdLayout, *, where: str) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return self.redistribute_dtensor(self._global(x, where), src, dst, where)

    def depart(self, x: Any, layout: SpmdLayout | None, *, where: str) -> Any:
        if isinstance(x, DTensor) and layout is not None:
            self.check_layout(x, layout, where)
        return x

    def local_region(self, forward: Callable[..., Any], out_layout: SpmdLayout, *,
                     where: str) -> Callable[..., Any]:
        mesh, placements = self._mesh(), self.placements(out_layout, data=True)
        grads: dict[tuple[Any, ...], tuple[Any, ...]] = {}

        def local(a: Any) -> Any:
            return local_view(a, placements, grads)

        @functools.wraps(forward)
        def local_forward(*args: Any, **kwargs: Any) -> Any:
            out = forward(*(local(a) for a in args), **{k: local(v) for k, v in kwargs.items()})
            return DTensor.from_local(out, mesh, placements, run_check=False)

        return local_forward

    def fsdp_spec(self) -> FsdpSpec | None:
        """The dense mesh; FSDP shards over ``dp_shard`` (and ``cp``: ``dp_shard x cp``)."""
        if not self.parallel_dims.dp_cp_enabled:
            return None
        self._check_fsdp_support()
        mesh = self._mesh()
        names = mesh.mesh_dim_names or ()
        shard = tuple(a for a in ("dp_shard", "cp") if a in names)
        dims = DataParallelMeshDims(
            shard=shard if len(shard) > 1 else (shard[0] if shard else None),
            replicate="dp_replicate" if "dp_replicate" in names else None,
        )
        return FsdpSpec(mesh=mesh, dp_mesh_dims=dims)

    # ------------------------------------------------------------------ expert parallelism
    def _sparse_mesh(self) -> DeviceMesh:
        """``(dp_replicate, efsdp, ep)``, ``dp_replicate`` only when active."""
        pd = self.parallel_dims
        return pd.get_mesh(["dp_replicate", "efsdp", "ep"] if pd.dp_replicate_enabled else ["efsdp", "ep"])

    def distribute_experts(self, tensor: torch.Tensor) -> torch.Tensor:
        """A DTensor on the sparse mesh: ``Replicate`` on the data-parallel axes, ``Shard(0)`` on ``ep``
        (``tensor``: the plan's replicated DTensor on the dense mesh, or a plain full tensor)."""
        full = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        mesh = self._sparse_mesh()
        placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
        return as_parameter_like(tensor, distribute_tensor(full.detach(), mesh, placements, src_data_rank=None))

    def expert_fsdp_spec(self) -> FsdpSpec | None:
        """The sparse mesh, FSDP over ``efsdp`` (and replicating over ``dp_replicate``)."""
        pd = self.parallel_dims
        if not pd.ep_enabled:
            return None
        return FsdpSpec(mesh=self._sparse_mesh(), dp_mesh_dims=DataParallelMeshDims(
            shard="efsdp", replicate="dp_replicate" if pd.dp_replicate_enabled else None))


REPRESENTATION = FullDTensorRepresentation
