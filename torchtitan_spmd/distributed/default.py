"""Backend ``default``: DTensor only on the TP axis, FSDP2 on the data-parallel axes.

Interpretation of the sharding plan:

- every parameter becomes a DTensor on the 1-D ``tp`` mesh with the plan's
  placements (buffers stay plain tensors);
- activations travel between modules as plain local tensors; a module whose
  inputs need a redistribution, or which owns parameters, sees DTensors
  (``DTensor.from_local`` with the declared ``src``, then ``redistribute`` to
  ``dst``); its output is redistributed to the declared layout and turned back
  into a local tensor;
- the model's output stays a vocab-sharded DTensor when loss parallel is on,
  for torch's ``loss_parallel()``; otherwise it is gathered;
- FSDP2 ``fully_shard`` on the ``fsdp`` mesh, or ``(dp_replicate, fsdp)`` for HSDP.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from ._dtensor_common import dtensor_clip_grad_norm_, maybe_loss_parallel, set_module_tensor
from .backends import SpmdBackendRuntime, reject_unimplemented_parallelism
from .layout import SpmdLayout
from .plan import ModulePlan, ShardingPlan, boundary_dst, boundary_src

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig

    from .parallel_dims import ParallelDims

__all__ = ["BACKEND", "DefaultBackend", "apply_tp_plan"]


def _to_dtensor(x: Any, mesh: DeviceMesh, src: SpmdLayout, dst: SpmdLayout, where: str) -> Any:
    axes = mesh.mesh_dim_names or ()
    if isinstance(x, DTensor):
        if tuple(x.placements) != src.placements(axes):
            raise RuntimeError(
                f"{where}: arrives as {x.placements} but the plan declares {src}; fix the plan."
            )
    elif isinstance(x, torch.Tensor):
        x = DTensor.from_local(x, mesh, src.placements(axes), run_check=False)
    else:
        return x
    want = dst.placements(axes)
    return x if tuple(x.placements) == want else x.redistribute(mesh, want)


def _install_hooks(fqn: str, module: nn.Module, mplan: ModulePlan, mesh: DeviceMesh, keep_output: bool) -> None:
    owns_dtensors = any(True for _ in module.parameters(recurse=False))

    def pre_hook(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        out = list(args)
        for i, b in enumerate(mplan.inputs[: len(args)]):
            src, dst = boundary_src(b), boundary_dst(b)
            if src is None or dst is None:
                continue
            x = args[i]
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and src == dst and not owns_dtensors:
                continue  # a container that only forwards a local tensor
            out[i] = _to_dtensor(x, mesh, src, dst, f"{fqn} input #{i}")
        return tuple(out)

    def post_hook(_: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not isinstance(output, DTensor):
            return output
        dst = boundary_dst(mplan.output)
        if dst is not None:
            want = dst.placements(mesh.mesh_dim_names or ())
            if tuple(output.placements) != want:
                output = output.redistribute(mesh, want)
        return output if keep_output else output.to_local()

    if mplan.inputs:
        module.register_forward_pre_hook(pre_hook)
    if mplan.output is not None or owns_dtensors:
        module.register_forward_hook(post_hook)


def apply_tp_plan(model: nn.Module, plan: ShardingPlan, tp_mesh: DeviceMesh) -> None:
    """Distribute ``model``'s parameters on ``tp_mesh`` and install the boundary hooks."""
    axes = tp_mesh.mesh_dim_names or ()
    for _, module, name, layout in plan.param_layouts(model):
        if name not in module._parameters:
            continue  # buffers stay plain under this backend
        full = module._parameters[name]
        if full is None:
            continue
        local = distribute_tensor(full.detach(), tp_mesh, layout.placements(axes), src_data_rank=None)
        set_module_tensor(module, name, local)
    for fqn, module, mplan in plan.resolve(model):
        _install_hooks(fqn, module, mplan, tp_mesh, keep_output=fqn == plan.output_module)


class DefaultBackend(SpmdBackendRuntime):
    """DTensor on TP, FSDP2 on DP; see the module docstring."""

    name: ClassVar[str] = "default"

    def validate_config(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        reject_unimplemented_parallelism(self.name, parallel_dims)

    def parallelize(self, model: nn.Module, parallel_dims: ParallelDims, plan: ShardingPlan,
                    job_config: JobConfig) -> nn.Module:
        if parallel_dims.tp_enabled:
            apply_tp_plan(model, plan, parallel_dims.get_mesh("tp"))
            if job_config.parallelism.disable_loss_parallel:
                model.register_forward_hook(_gather_logits)
        if parallel_dims.dp_enabled:
            dp_mesh = (
                parallel_dims.get_mesh(["dp_replicate", "fsdp"])
                if parallel_dims.dp_replicate_enabled
                else parallel_dims.get_mesh("fsdp")
            )
            for unit in plan.fsdp_unit_modules(model):
                fully_shard(unit, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
        return model

    def prepare_inputs(self, tokens: torch.Tensor, labels: torch.Tensor,
                       parallel_dims: ParallelDims) -> tuple[torch.Tensor, torch.Tensor]:
        return tokens, labels

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    def loss_value(self, loss: torch.Tensor, parallel_dims: ParallelDims) -> float:
        value = loss.detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()
        value = value.clone()
        loss_mesh = parallel_dims.get_optional_mesh("loss")
        if loss_mesh is not None:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=loss_mesh.get_group())
            value /= loss_mesh.size()
        return float(value)

    def train_context(self, *, enable_loss_parallel: bool, parallel_dims: ParallelDims | None,
                      spmd_typechecking: bool) -> AbstractContextManager[None]:
        return maybe_loss_parallel(enable_loss_parallel) if enable_loss_parallel else contextlib.nullcontext()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, parallel_dims: ParallelDims) -> float:
        return dtensor_clip_grad_norm_(model, max_norm)


def _gather_logits(_: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """Without loss parallel, gather the vocab-sharded logits into a full local tensor."""
    if isinstance(output, DTensor):
        from torch.distributed.tensor import Replicate

        return output.redistribute(output.device_mesh, [Replicate()] * output.device_mesh.ndim).to_local()
    return output


BACKEND = DefaultBackend()
