"""Backend ``full_dtensor``: every parameter, buffer and input is a DTensor on one mesh.

Interpretation of the sharding plan on the multi-axis SPMD mesh
``(dp_replicate, dp_shard, cp, tp)`` (inactive axes dropped):

- parameters and buffers: ``Replicate`` on the data-parallel axes, the plan's
  layout on ``tp``; FSDP shards their storage over ``dp_shard`` via
  ``fully_shard(mesh, dp_mesh_dims=DataParallelMeshDims(...))``;
- inputs: ``Shard(0)`` on DP, ``Shard(1)`` on CP, ``Replicate`` on TP;
- every planned module boundary must receive DTensors (a plain tensor is an
  error) and redistributes them to the declared layout; activations stay
  batch-sharded on the DP axes;
- ``local_compute`` modules (attention's SDPA, which DTensor cannot shard on
  CPU) run on the local shards, wrapped back into DTensors;
- the loss is a DTensor whose value is already the global mean, so FSDP must
  *sum* gradients: its divide factor is 1 and reductions are forced to SUM
  (gloo also rejects the PREMUL_SUM that a plain divide factor would need).
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

try:  # fully_shard(dp_mesh_dims=...) for DTensor parameters on the dense mesh: torch >= 2.13
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # torch 2.11: full_dtensor runs without data parallelism only
    DataParallelMeshDims = None  # type: ignore[assignment,misc]
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.torch_version import TorchVersion

from ._dtensor_common import (
    clear_dtensor_sharding_caches,
    dtensor_clip_grad_norm_,
    maybe_loss_parallel,
    set_module_tensor,
)
from .backends import SpmdBackendRuntime, describe_unsupported, reject_unimplemented_parallelism
from .layout import SpmdLayout
from .plan import ModulePlan, ShardingPlan, boundary_dst, boundary_src

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig

    from .parallel_dims import ParallelDims

__all__ = [
    "BACKEND",
    "FullDTensorBackend",
    "parallelize_inputs",
    "resolve_fsdp_mesh",
    "spmd_mesh",
    "validate_config",
]

#: The torch that first has FSDP's ``DataParallelMeshDims`` (checked: 2.11 lacks it).
FSDP_MIN_TORCH = "2.13"
#: The torch whose ``loss_parallel()`` takes a multi-dimensional mesh (2.11's: 1-D only).
LOSS_PARALLEL_MIN_TORCH = "2.13"
_MULTI_DIM_LOSS_PARALLEL = TorchVersion(torch.__version__) >= LOSS_PARALLEL_MIN_TORCH
_DP_AXES = ("dp_replicate", "dp_shard")
_MODEL_AXES = ("cp", "tp")


def spmd_mesh(parallel_dims: ParallelDims) -> DeviceMesh:
    """The dense mesh every DTensor of this backend lives on (active axes only).

    On a single rank, the 1-rank ``dp_shard`` mesh.
    """
    mesh = parallel_dims.resolve_mesh(["dp", "cp", "tp"])
    if mesh is None:
        mesh = parallel_dims.get_optional_mesh("dp_shard", include_singleton_axes=True)
    if mesh is None:
        raise RuntimeError("full_dtensor: ParallelDims built no dp_shard mesh; call build_mesh() first.")
    return mesh


def validate_config(job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """Reject what ``full_dtensor`` cannot run, naming the alternative."""
    reject_unimplemented_parallelism(
        "full_dtensor", parallel_dims, cp_what="context parallelism under SDPA attention"
    )
    _check_fsdp_support(parallel_dims)
    loss_parallel = parallel_dims.tp_enabled and not job_config.parallelism.disable_loss_parallel
    if loss_parallel and not _MULTI_DIM_LOSS_PARALLEL:
        raise ValueError(describe_unsupported(
            "full_dtensor",
            f"loss parallel (tensor_parallel_degree={parallel_dims.tp}) on torch {torch.__version__}",
            f"it needs torch >= {LOSS_PARALLEL_MIN_TORCH} (loss_parallel() on the multi-axis "
            "mesh). Set parallelism.disable_loss_parallel=True, or upgrade torch.",
        ))


def _check_fsdp_support(parallel_dims: ParallelDims) -> None:
    """Data parallelism needs ``fully_shard(dp_mesh_dims=...)``: a clear error where it is missing."""
    if parallel_dims.dp_enabled and DataParallelMeshDims is None:
        raise ValueError(describe_unsupported(
            "full_dtensor",
            f"data-parallel sharding (dp_replicate={parallel_dims.dp_replicate}, "
            f"dp_shard={parallel_dims.dp_shard}) on torch {torch.__version__}",
            f"it needs torch >= {FSDP_MIN_TORCH} (FSDP2's fully_shard(dp_mesh_dims="
            f"DataParallelMeshDims(...)) for DTensor parameters). Upgrade torch to "
            f"{FSDP_MIN_TORCH} or newer, or use parallelism.spmd_backend='default'.",
        ))


def resolve_fsdp_mesh(parallel_dims: ParallelDims) -> tuple[DeviceMesh, DataParallelMeshDims] | None:
    """The storage mesh and data-parallel dims for ``fully_shard``, or None without DP."""
    if not parallel_dims.dp_enabled:
        return None
    _check_fsdp_support(parallel_dims)
    mesh = spmd_mesh(parallel_dims)
    names = mesh.mesh_dim_names or ()
    shard = "dp_shard" if "dp_shard" in names else None
    replicate = "dp_replicate" if "dp_replicate" in names else None
    return mesh, DataParallelMeshDims(shard=shard, replicate=replicate)


def _placements(
    mesh: DeviceMesh, layout: SpmdLayout, *, data: bool, like: DTensor | None = None
) -> tuple[Any, ...]:
    """Placements for model-axis ``layout`` on ``mesh``.

    On the DP axes: those of ``like`` if given (boundaries only redistribute the
    model axes), else ``Shard(0)`` for batch data or ``Replicate()`` for weights.
    """
    names = mesh.mesh_dim_names or ()
    model_axes = [a for a in names if a not in _DP_AXES]
    model = dict(zip(model_axes, layout.placements(model_axes), strict=True))
    out = []
    for i, axis in enumerate(names):
        if axis not in _DP_AXES:
            out.append(model[axis])
        elif like is not None:
            out.append(like.placements[i])
        else:
            out.append(Shard(0) if data else Replicate())
    return tuple(out)


def parallelize_inputs(
    parallel_dims: ParallelDims, *tensors: torch.Tensor
) -> tuple[DTensor, ...]:
    """Wrap local batch tensors ``[batch, seq]``: DP -> Shard(0), CP -> Shard(1), TP -> Replicate."""
    mesh = spmd_mesh(parallel_dims)
    names = mesh.mesh_dim_names or ()
    placements = [Shard(0) if a in _DP_AXES else Shard(1) if a == "cp" else Replicate() for a in names]
    return tuple(DTensor.from_local(t, mesh, placements, run_check=False) for t in tensors)


def _redistribute(x: Any, mesh: DeviceMesh, b: Any, where: str) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        raise TypeError(
            f"full_dtensor: a plain torch.Tensor reached {where}; every input must be a DTensor "
            "(wrap inputs with torchtitan_spmd.distributed.full_dtensor.parallelize_inputs)."
        )
    src, dst = boundary_src(b), boundary_dst(b)
    if src is None or dst is None:
        return x
    if tuple(x.placements) != _placements(mesh, src, data=True, like=x):
        raise RuntimeError(f"{where}: arrives as {x.placements} but the plan declares {src}.")
    want = _placements(mesh, dst, data=True, like=x)
    return x if tuple(x.placements) == want else x.redistribute(mesh, want)


def _install(fqn: str, module: nn.Module, mplan: ModulePlan, mesh: DeviceMesh) -> None:
    def pre_hook(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        bounds = list(mplan.inputs) + [None] * (len(args) - len(mplan.inputs))
        return tuple(_redistribute(x, mesh, b, f"{fqn} input #{i}") for i, (x, b) in enumerate(zip(args, bounds, strict=True)))

    def post_hook(_: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        dst = boundary_dst(mplan.output)
        if dst is None or not isinstance(output, DTensor):
            return output
        want = _placements(mesh, dst, data=True, like=output)
        return output if tuple(output.placements) == want else output.redistribute(mesh, want)

    module.register_forward_pre_hook(pre_hook)
    module.register_forward_hook(post_hook)
    if mplan.local_compute:
        out_layout = boundary_dst(mplan.output)
        if out_layout is None:
            raise ValueError(f"plan for {fqn!r}: local_compute needs an output layout.")
        forward = module.forward

        @functools.wraps(forward)
        def local_forward(*args: Any) -> Any:
            local = [a.to_local() if isinstance(a, DTensor) else a for a in args]
            out = forward(*local)
            return DTensor.from_local(out, mesh, _placements(mesh, out_layout, data=True), run_check=False)

        module.forward = local_forward  # type: ignore[method-assign]


class FullDTensorBackend(SpmdBackendRuntime):
    """Everything a DTensor on the dense mesh; see the module docstring."""

    name: ClassVar[str] = "full_dtensor"

    def validate_config(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        validate_config(job_config, parallel_dims)

    def parallelize(self, model: nn.Module, parallel_dims: ParallelDims, plan: ShardingPlan,
                    job_config: JobConfig) -> nn.Module:
        mesh = spmd_mesh(parallel_dims)
        for _, module, name, layout in plan.param_layouts(model):
            full = getattr(module, name)
            if full is None:
                continue
            set_module_tensor(module, name, distribute_tensor(
                full.detach(), mesh, _placements(mesh, layout, data=False), src_data_rank=None))
        for fqn, module, mplan in plan.resolve(model):
            _install(fqn, module, mplan, mesh)
        if job_config.parallelism.disable_loss_parallel:
            model.register_forward_hook(_replicate_vocab)
        fsdp = resolve_fsdp_mesh(parallel_dims)
        if fsdp is not None:
            storage, dims = fsdp
            clear_dtensor_sharding_caches()  # an earlier, equal mesh must not leak in
            for unit in [*plan.fsdp_unit_modules(model), model]:
                fully_shard(unit, mesh=storage, dp_mesh_dims=dims)
                # The loss is already the global mean: sum, don't average, across DP.
                unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]
                unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        return model

    def prepare_inputs(self, tokens: torch.Tensor, labels: torch.Tensor,
                       parallel_dims: ParallelDims) -> tuple[torch.Tensor, torch.Tensor]:
        tokens_d, labels_d = parallelize_inputs(parallel_dims, tokens, labels)
        return tokens_d, labels_d

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # loss_parallel() only means over 1-D meshes: sum, then divide by the
        # global token count (a DTensor's shape is global), giving the global mean.
        total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
        return total / labels.numel()

    def loss_value(self, loss: torch.Tensor, parallel_dims: ParallelDims) -> float:
        value = loss.detach()
        return float(value.full_tensor() if isinstance(value, DTensor) else value)

    def train_context(self, *, enable_loss_parallel: bool, parallel_dims: ParallelDims | None,
                      spmd_typechecking: bool) -> AbstractContextManager[None]:
        return maybe_loss_parallel(enable_loss_parallel)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, parallel_dims: ParallelDims) -> float:
        return dtensor_clip_grad_norm_(model, max_norm)


def _replicate_vocab(_: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """Without loss parallel, gather the vocab dim (batch stays sharded)."""
    if not isinstance(output, DTensor):
        return output
    names = output.device_mesh.mesh_dim_names or ()
    want = [Shard(0) if a in _DP_AXES else Replicate() for a in names]
    return output.redistribute(output.device_mesh, want)


BACKEND = FullDTensorBackend()
