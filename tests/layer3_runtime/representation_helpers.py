"""Checks of the representation interface, run per backend (layer 3 and layer 4 tests use them)."""

from __future__ import annotations

from typing import Any

import torch
from parity_helpers import PARITY_CONFIGS, job_config, skip_full_dtensor_on_old_torch, warm_parent
from torch import nn

from torchtitan_spmd.launcher import run_forked


def _views_of_the_trainer(rank: int, world: int, backend: str, config_name: str, model: str) -> dict[str, Any]:
    """Build a trainer; compare every state's DTensor view with the single-process init."""
    from torch.distributed.tensor import DTensor

    from torchtitan_spmd.models import get_model_spec
    from torchtitan_spmd.train import Trainer

    cfg = job_config(backend, PARITY_CONFIGS[config_name][1], model=model, steps=1)
    trainer = Trainer(cfg)
    reference = get_model_spec(model).build_initialized("tiny", seed=cfg.debug.seed, vocab_size=320,
                                                        max_seq_len=cfg.training.seq_len)  # as the trainer
    full = dict(reference.named_parameters()) | dict(reference.named_buffers())
    mismatched, not_shared, kinds = [], [], set()
    for fqn, state in trainer.state_layouts.items():
        module_name, _, name = fqn.rpartition(".")
        module = trainer.model.get_submodule(module_name)
        tensor = module._parameters[name] if name in module._parameters else module._buffers[name]
        view = trainer.representation.to_dtensor(tensor, state)
        kinds.add((type(tensor).__name__, type(view).__name__))
        value = view.full_tensor() if isinstance(view, DTensor) else view
        if not torch.equal(value.detach(), full[fqn].detach()):
            mismatched.append(fqn)
        own = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        seen = view.to_local() if isinstance(view, DTensor) else view
        if own.numel() and own.data_ptr() != seen.data_ptr():
            not_shared.append(fqn)
    return {"mismatched": mismatched, "not_shared": not_shared, "kinds": sorted(kinds),
            "n": len(trainer.state_layouts)}


def check_views_match_single_process_init(backend: str, config_name: str, model: str) -> set[tuple[str, str]]:
    """Every state of every rank, viewed as a DTensor (sharing storage), is the single-process weight.

    Returns the ``(tensor type, view type)`` pairs seen.
    """
    skip_full_dtensor_on_old_torch(backend, config_name)
    warm_parent()
    world = PARITY_CONFIGS[config_name][0]
    results = run_forked(_views_of_the_trainer, world, backend, config_name, model, timeout_s=300)
    for rank, r in enumerate(results):
        assert r["n"] > 20, r
        assert r["mismatched"] == [], f"rank {rank}: {r['mismatched']}"
        assert r["not_shared"] == [], f"rank {rank}: {r['not_shared']}"
    return {tuple(k) for r in results for k in r["kinds"]}


class _Scale(nn.Module):
    """A local region with a keyword argument."""

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        assert type(x) is torch.Tensor and type(scale) is torch.Tensor, (type(x), type(scale))
        return x * scale


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Scale()

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.inner(x, scale=scale)


def _local_region_with_kwargs(rank: int, world: int, backend: str) -> list[float]:
    from torch.distributed.tensor import DTensor

    from torchtitan_spmd.distributed.apply_plan import apply_plan
    from torchtitan_spmd.distributed.layout import SpmdLayout
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims
    from torchtitan_spmd.distributed.plan import ModulePlan, ShardingPlan
    from torchtitan_spmd.distributed.representation import build_representation

    pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1, world_size=world,
                      spmd_backend=backend, device_type="cpu")
    pd.build_mesh()
    rep = build_representation(pd)
    model = _Outer()
    apply_plan(model, ShardingPlan({"inner": ModulePlan(inputs=(SpmdLayout(),), output=SpmdLayout(),
                                                        local_compute=True)}), rep)
    x, scale = rep.from_local(torch.arange(4.0), SpmdLayout()), rep.from_local(torch.full((4,), 3.0), SpmdLayout())
    out = model(x, scale)
    return (out.to_local() if isinstance(out, DTensor) else out).tolist()


def check_local_region_passes_keyword_arguments(backend: str) -> None:
    """A local region's body sees plain tensors, keyword arguments included, and computes."""
    for out in run_forked(_local_region_with_kwargs, 2, backend, timeout_s=120):
        assert out == [0.0, 3.0, 6.0, 9.0]


class _ScaleByWeight(nn.Module):
    """A planned module with its own parameter; records what its body sees."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((2,), 2.0))
        self.seen: list[tuple[str, str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((type(self.weight).__name__, type(x).__name__))
        return x * self.weight


def _module_body_sees_local_tensors(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from torchtitan_spmd.distributed.apply_plan import apply_plan
    from torchtitan_spmd.distributed.layout import S, SpmdLayout
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims
    from torchtitan_spmd.distributed.plan import ModulePlan, ShardingPlan
    from torchtitan_spmd.distributed.representation import build_representation

    pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1, world_size=world,
                      spmd_backend="default", device_type="cpu")
    pd.build_mesh()
    rep = build_representation(pd)
    sharded = SpmdLayout({"tp": S(0)})
    model = _ScaleByWeight()
    apply_plan(model, ShardingPlan({"": ModulePlan(params={"weight": SpmdLayout()}, inputs=(sharded,),
                                                   output=sharded)}, mesh_axes=("tp",)), rep)
    x = torch.arange(2.0 * rank, 2.0 * rank + 2).reshape(1, 2).requires_grad_()  # row `rank` of [[0, 1], [2, 3]]
    out = model(x)
    out.sum().backward()
    weight = model.weight
    grad = weight.grad
    errors = []
    try:
        apply_plan(_ScaleByWeight(), ShardingPlan({"": ModulePlan(inputs=(sharded,))}, mesh_axes=("tp",)), rep)
    except ValueError as e:
        errors.append(str(e))
    return {
        "seen": model.seen, "out": out.flatten().tolist(), "weight_is_dtensor": isinstance(weight, DTensor),
        "grad": grad.placements.__repr__() if isinstance(grad, DTensor) else type(grad).__name__,
        "grad_full": grad.full_tensor().tolist() if isinstance(grad, DTensor) else None,
        "x_grad": x.grad.flatten().tolist(), "errors": errors,
    }


def check_default_module_bodies_compute_on_local_shards() -> None:
    """Under ``default`` a planned module's body sees its DTensor parameter and input as local
    tensors; the replicated weight's gradient is a pending sum over tp (each rank saw half the
    input), and a module with parameters but no output layout is a setup error."""
    for rank, r in enumerate(run_forked(_module_body_sees_local_tensors, 2, timeout_s=120)):
        assert r["seen"] == [("Tensor", "Tensor")], r["seen"]
        assert r["weight_is_dtensor"]  # restored after the call
        assert r["out"] == [4.0 * rank, 4.0 * rank + 2.0]
        assert r["grad"] == "(Partial(sum),)", r["grad"]
        assert r["grad_full"] == [0.0 + 2.0, 1.0 + 3.0]  # d/dw of sum(x * w): the column sums of x
        assert r["x_grad"] == [2.0, 2.0]
        assert len(r["errors"]) == 1 and "needs an output layout" in r["errors"][0], r["errors"]
