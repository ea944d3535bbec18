"""Technique: model converters, the mechanism (upstream's ``ModelConfigConverter``).

A job lists converter configs in ``model.converters`` (or a recipe's
``job.model_spec = model_registry(flavor, converters=[...])``). Each config names its converter
class (:data:`CONVERTERS`): :mod:`.quantization` (float8, MXFP8, NVFP4) and
:mod:`.lora`. The trainer:

1. at validation, builds every converter (:func:`build_converters`): a missing extra, a GPU
   the converter needs, a bad field: one line, before any mesh or model;
2. converts the model right after it is built on the meta device (:func:`convert_model`), so
   the plan, FSDP, activation checkpointing and the initialisation see the converted modules;
3. after the plan sharded the parameters, tells the converted modules their shards
   (:func:`bind_converted`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchtitan_spmd.config.converters import ModelConfigConverterConfig

from . import lora, quantization

if TYPE_CHECKING:
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims
    from torchtitan_spmd.distributed.plan import ShardingPlan

__all__ = ["CONVERTERS", "bind_converted", "build_converters", "convert_model", "converted_counts", "converter_plan"]

#: Each converter class by its config class's converter name.
CONVERTERS: dict[str, type[Any]] = {
    cls.Config.converter: cls for cls in (
        quantization.Float8LinearConverter, quantization.Float8GroupedExpertsConverter,
        quantization.MXFP8LinearConverter, quantization.MXFP8GroupedExpertsConverter,
        quantization.NVFP4LinearConverter, lora.LoRAConverter)
}


def build_converters(configs: list[ModelConfigConverterConfig], *, dry_run: bool = False) -> list[Any]:
    """The converters of ``configs`` (``model.converters``), each checked at construction; a dry run
    (``dry_run=True``) sizes a GPU job on this machine, so the GPU-capability checks are skipped."""
    with quantization.hardware_checks_off() if dry_run else contextlib.nullcontext():
        return [CONVERTERS[c.converter](c) for c in configs]


def convert_model(model: nn.Module, converters: list[Any]) -> dict[str, list[str]]:
    """Apply ``converters`` to ``model`` in order, in place; ``{converter name: converted module names}``."""
    return {type(c).__name__: c.convert(model) for c in converters}


def converter_plan(plan: ShardingPlan, converters: list[Any], model_spec: Any, model_config: Any) -> ShardingPlan:
    """``plan`` with the layouts of the parameters the converters add (LoRA's adapters), read off
    the family's model converted on the meta device."""
    extending = [c for c in converters if hasattr(c, "extend_plan")]
    if not extending:
        return plan
    with torch.device("meta"):
        model = model_spec.build(model_config)
    convert_model(model, converters)
    for c in extending:
        plan = c.extend_plan(plan, model)
    return plan


def _max_over(group: Any) -> Callable[..., torch.Tensor]:
    import torch.distributed._functional_collectives as funcol

    def reduce(amax: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        out = funcol.all_reduce(amax, "max", group)
        return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out

    return reduce


def bind_converted(model: nn.Module, state_layouts: dict[str, Any], parallel_dims: ParallelDims,
                   representation: Any) -> None:
    """After the plan: the float8 linears learn how their weights are sharded over ``tp`` and
    the ``max`` that makes their scales global: the representation's ``amax_max_over_tp`` where
    it defines one (typed), else a plain all-reduce over the ``tp`` group; so do the float8
    grouped experts and the NVFP4 linears (these also take the representation's ``local_amax``,
    which types a per-tensor amax, where it defines one). The MXFP8 linears and experts learn their shards,
    checked to split no block (a setup error naming them)."""
    quantization.bind_mxfp8_shards(model, state_layouts, parallel_dims.tp)
    reduce = None
    if parallel_dims.tp_enabled:
        own = getattr(representation, "amax_max_over_tp", None)
        reduce = own() if own is not None else _max_over(parallel_dims.get_mesh("tp").get_group())
    quantization.bind_float8_shards(model, state_layouts, reduce)
    quantization.bind_float8_experts(model, state_layouts, parallel_dims.tp, reduce)
    quantization.bind_nvfp4_shards(model, state_layouts, parallel_dims.tp, reduce,
                                   getattr(representation, "local_amax", None))


def converted_counts(model: nn.Module) -> dict[str, int]:
    """What the converters changed in ``model`` (this rank's shards; the dry run's report): float8,
    MXFP8 and NVFP4 linears, float8 and MXFP8 grouped experts, and their weights' elements (kept in high precision:
    torchao's dynamic scaling stores no scales, it computes them each step), LoRA's adapter
    elements, and the frozen parameters' elements and bytes (no gradient, no optimizer state).
    Empty for an unconverted model."""
    from torch.distributed.tensor import DTensor

    def local(p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if isinstance(p, DTensor) else p

    out: dict[str, int] = {}
    for kind, cls in (("float8", quantization.Float8Linear), ("mxfp8", quantization.MXFP8Linear),
                      ("nvfp4", quantization.NVFP4Linear)):
        linears = [m for m in model.modules() if cls is not None and isinstance(m, cls)]
        if linears:
            out[f"{kind}_linears"] = len(linears)
            out[f"{kind}_weight_numel"] = sum(local(m.weight).numel() for m in linears)
            out[f"{kind}_stored_scales"] = 0
    for kind, which in (("float8", quantization.is_float8_experts), ("mxfp8", quantization.is_mxfp8_experts)):
        experts = [m for m in model.modules() if which(m)]
        if experts:
            out[f"{kind}_experts"] = len(experts)
            out[f"{kind}_expert_weight_numel"] = sum(local(getattr(m, w)).numel() for m in experts
                                                     for w in ("w1", "w2", "w3"))
    adapters = [getattr(m, a) for m in model.modules() if lora.is_lora(m) for a in lora.ADAPTERS]
    if adapters:
        out["lora_adapter_numel"] = sum(local(p).numel() for p in adapters)
    frozen = [local(p) for p in model.parameters() if not p.requires_grad]
    if frozen:
        out["frozen_numel"] = sum(p.numel() for p in frozen)
        out["frozen_bytes"] = sum(p.numel() * p.element_size() for p in frozen)
    return out
