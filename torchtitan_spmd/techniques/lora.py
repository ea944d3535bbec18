"""Technique: LoRA, upstream's ``LoRAConverter``: low-rank adapters on the targeted linears.

Each targeted linear (an ``nn.Linear`` or a float8 one: LoRA goes after quantization, as
upstream orders them) computes ``base(x) + (alpha / rank) * (x @ lora_a.T) @ lora_b.T``, with
``lora_a`` (``[rank, in]``, Kaiming-uniform as ``nn.Linear`` initialises a weight, seeded by its
name) and ``lora_b`` (``[out, rank]``, zeros: the converted model starts as the base model).
Every other parameter of the model is frozen (``requires_grad=False``): the optimizer gets the
adapters alone, so the frozen base has no optimizer state and its FSDP shards no gradient.

The adapters are parameters of the linear itself (``wq.lora_a``; upstream's modules name them
``wq.lora_a.weight``), so one plan entry lays out the base weight and its adapters together,
as upstream derives them (``_lora_adapter_sharding``): a column-wise base (output features
sharded over ``tp``) has ``lora_a`` replicated and ``lora_b`` sharded on its rows; a row-wise base
(input features sharded) has ``lora_a`` sharded on its columns and ``lora_b`` replicated, so the
adapters' output is the same pending sum as the base's. Every backend then runs them as it runs
the base linear (local shards, DTensors, or typed local shards).

:func:`merge_lora` folds the adapters into the weights (``W + (alpha / rank) * B @ A``): the Hugging
Face export writes merged weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_spmd.config.converters import LoRAConverterConfig
from torchtitan_spmd.distributed.layout import SpmdLayout
from torchtitan_spmd.models.common import param_seed

from .quantization import expand_upstream_names

if TYPE_CHECKING:
    from torchtitan_spmd.distributed.plan import ShardingPlan

__all__ = ["ADAPTERS", "LoRAConverter", "adapter_names", "is_lora", "lora_scalings", "merge_lora", "merged_state_dict"]

#: The adapters' parameter names on a converted linear.
ADAPTERS: tuple[str, str] = ("lora_a", "lora_b")

_CLASSES: dict[type, type] = {}


def _lora_class(base: type[nn.Module]) -> type[nn.Module]:
    """The LoRA subclass of linear class ``base`` (cached): ``base``'s forward plus the adapters'."""
    if base in _CLASSES:
        return _CLASSES[base]

    class LoRALinear(base):  # type: ignore[valid-type, misc]
        lora_scaling: float

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            out = super().forward(input)
            # the second product as a matmul: under a row-wise base ``F.linear(input, lora_a)`` is a
            # pending sum over tp, which spmd_types' checker lets through a matmul (multilinear)
            # but not through ``F.linear``, which it does not know to be linear
            return out + self.lora_scaling * torch.matmul(F.linear(input, self.lora_a), self.lora_b.t())

    LoRALinear.__name__ = LoRALinear.__qualname__ = f"LoRA{base.__name__}"
    _CLASSES[base] = LoRALinear
    return LoRALinear


def is_lora(module: nn.Module) -> bool:
    """Whether ``module`` is a linear LoRA converted."""
    return type(module) in _CLASSES.values()


def adapter_names(model: nn.Module) -> list[str]:
    """The FQNs of every adapter parameter of ``model``."""
    return [f"{fqn}.{a}" if fqn else a for fqn, m in model.named_modules() if is_lora(m) for a in ADAPTERS]


class LoRAConverter:
    """Upstream's ``LoRAConverter``: adapters on the linears whose last name is in ``target_modules``
    (None: every linear), the rest of the model frozen."""

    Config: ClassVar[type[LoRAConverterConfig]] = LoRAConverterConfig

    def __init__(self, config: LoRAConverterConfig) -> None:
        config.check("LoRAConverter.Config")
        self.config = config
        self.scaling = float(config.alpha) / config.rank
        self.targets = None if config.target_modules is None else set(expand_upstream_names(config.target_modules))

    def _is_target(self, fqn: str, module: nn.Module) -> bool:
        if not isinstance(module, nn.Linear) or is_lora(module):
            return False
        return self.targets is None or fqn.rpartition(".")[2] in self.targets

    def convert(self, model: nn.Module) -> list[str]:
        """Freeze ``model`` and add adapters to the targeted linears; their names. ValueError when a
        target names no linear of the model (a one-line setup error, where upstream warns)."""
        for p in model.parameters():
            p.requires_grad_(False)
        converted = []
        for fqn, module in list(model.named_modules()):
            if not self._is_target(fqn, module):
                continue
            device, dtype = module.weight.device, module.weight.dtype
            module.__class__ = _lora_class(type(module))
            module.lora_scaling = self.scaling
            module.lora_a = nn.Parameter(torch.empty(self.config.rank, module.in_features, device=device,
                                                     dtype=dtype))
            module.lora_b = nn.Parameter(torch.empty(module.out_features, self.config.rank, device=device,
                                                     dtype=dtype))
            converted.append(fqn)
        if self.targets is not None:
            missing = self.targets - {n.rpartition(".")[2] for n in converted}
            if missing:
                raise ValueError(f"LoRAConverter.Config.target_modules: {sorted(missing)} name no linear of the "
                                 f"model (its linears: {sorted(_linear_names(model))}).")
        _wrap_initial_value(model, self.config.rank)
        return converted

    def extend_plan(self, plan: ShardingPlan, model: nn.Module) -> ShardingPlan:
        """``plan`` with the adapters of ``model`` (converted, on the meta device) laid out from
        their base weight's layout, in the base linear's own plan entry."""
        from torchtitan_spmd.distributed.plan import fqn_matches

        named = dict(model.named_modules())
        modules = dict(plan.modules)
        for pattern, mplan in plan.modules.items():
            hits = [named[fqn] for fqn in named if fqn_matches(pattern, fqn)]
            if "weight" not in mplan.params or not hits or not all(is_lora(m) for m in hits):
                continue
            a, b = _adapter_layouts(mplan.params["weight"])
            modules[pattern] = dataclasses.replace(mplan, params={**mplan.params, "lora_a": a, "lora_b": b})
        return dataclasses.replace(plan, modules=modules)


def _linear_names(model: nn.Module) -> set[str]:
    return {fqn.rpartition(".")[2] for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}


def _adapter_layouts(weight: SpmdLayout) -> tuple[SpmdLayout, SpmdLayout]:
    """``(lora_a, lora_b)`` layouts for a base weight ``[out, in]`` laid out as ``weight``:
    output rows sharded -> ``lora_b``'s rows too; input columns sharded -> ``lora_a``'s columns."""
    dims = weight.shard_dims()
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    for axis, kind in weight.types.items():
        dim = dims.get(axis)
        if dim == 0:
            b[axis] = kind
        elif dim == 1:
            a[axis] = kind
    return SpmdLayout(a), SpmdLayout(b)


def _wrap_initial_value(model: nn.Module, rank: int) -> None:
    """``model.initial_value`` extended to the adapters: ``lora_a`` as ``nn.Linear`` initialises a
    weight (Kaiming-uniform, a = sqrt(5)), seeded by its name; ``lora_b`` zeros."""
    base = model.initial_value  # type: ignore[attr-defined]
    if getattr(base, "_lora", False):
        return

    def initial_value(fqn: str, shape: Sequence[int], seed: int) -> torch.Tensor:
        leaf = fqn.rpartition(".")[2]
        if leaf == "lora_b":
            return torch.zeros(tuple(shape), dtype=torch.float32)
        if leaf == "lora_a":
            gen = torch.Generator(device="cpu")
            gen.manual_seed(param_seed(seed, fqn))
            bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)) on fan_in = shape[1]
            return torch.empty(tuple(shape), dtype=torch.float32).uniform_(-bound, bound, generator=gen)
        return base(fqn, shape, seed)

    initial_value._lora = True  # type: ignore[attr-defined]
    model.initial_value = initial_value  # type: ignore[method-assign]


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its linear's weight, in place, on an unsharded (full) model; the
    linears become plain again. Returns ``model``."""
    for module in list(model.modules()):
        if not is_lora(module):
            continue
        module.weight.add_(module.lora_scaling * (module.lora_b @ module.lora_a))
        del module.lora_a, module.lora_b
        module.__class__ = type(module).__mro__[1]
    return model


@torch.no_grad()
def merged_state_dict(state: dict[str, Any], scalings: dict[str, float]) -> dict[str, Any]:
    """A model state dict with its adapters folded into the weights and dropped:
    ``{fqn.weight: W + s * B @ A}`` for each linear ``fqn`` of ``scalings`` (``{linear fqn: alpha / rank}``,
    :func:`lora_scalings`). The values may be full tensors or DTensors of global shape (a
    checkpoint's views): the merged weight keeps the weight's placements. What the Hugging Face
    export writes."""
    from torch.distributed.tensor import DTensor

    if not scalings:
        return state
    out = {k: v for k, v in state.items() if k.rpartition(".")[2] not in ADAPTERS}
    for fqn, s in scalings.items():
        w, a, b = state[f"{fqn}.weight"], state[f"{fqn}.lora_a"], state[f"{fqn}.lora_b"]
        delta = (b.to(torch.float32) @ a.to(torch.float32)) * s
        if isinstance(w, DTensor):
            delta = delta.redistribute(w.device_mesh, w.placements)
        out[f"{fqn}.weight"] = (w.to(torch.float32) + delta).to(w.dtype)
    return out


def lora_scalings(model: nn.Module) -> dict[str, float]:
    """``{plain linear fqn: alpha / rank}`` of every LoRA linear of ``model``."""
    from torchtitan_spmd.distributed.apply_plan import plain_fqn

    return {plain_fqn(fqn): m.lora_scaling for fqn, m in model.named_modules() if is_lora(m)}
