"""The declarative sharding plan that every backend interprets.

A model declares, once, for each module (matched by fully-qualified name with
``*`` wildcards):

- the layout of each of its own parameters and buffers (``params``);
- the layout of each positional input (``inputs``) and of its output
  (``output``); an entry is either a :class:`SpmdLayout` (the value already has
  that layout) or a :class:`Redistribute` (it arrives as ``src`` and the module
  needs it as ``dst``);
- ``local_compute=True`` when the module's body must run on local shards
  (e.g. attention kernels that DTensor cannot shard on every device).

Layouts only mention the *model-parallel* axes (``cp``, ``tp``; later ``ep``); an
axis of size 1 is ignored, so one plan serves every degree.
The data-parallel axes are the backend's business: activations are batch-sharded
on them and parameters replicated (FSDP shards their storage separately).

One technique applies it (:mod:`.apply_plan`) against each backend's tensor
representation (:mod:`.representation`); a fork adds a model by writing a plan,
not three parallelize functions.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from torch import nn

from .layout import SpmdLayout


def fqn_matches(pattern: str, fqn: str) -> bool:
    """Match a module FQN against a pattern segment by segment (``*`` never spans a dot)."""
    if pattern == "" or fqn == "":
        return pattern == fqn
    parts, names = pattern.split("."), fqn.split(".")
    return len(parts) == len(names) and all(
        fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names, strict=True)
    )


@dataclass(frozen=True)
class Redistribute:
    """A boundary where a value arrives as ``src`` and is needed as ``dst``."""

    src: SpmdLayout
    dst: SpmdLayout

    def __post_init__(self) -> None:
        for name in ("src", "dst"):
            if not isinstance(getattr(self, name), SpmdLayout):
                raise TypeError(
                    f"Redistribute.{name} must be an SpmdLayout, got {type(getattr(self, name)).__name__}."
                )


Boundary = SpmdLayout | Redistribute | None


def boundary_src(b: Boundary) -> SpmdLayout | None:
    """The layout a value arrives with at boundary ``b`` (None: not planned)."""
    return b.src if isinstance(b, Redistribute) else b


def boundary_dst(b: Boundary) -> SpmdLayout | None:
    """The layout a value must have after boundary ``b`` (None: not planned)."""
    return b.dst if isinstance(b, Redistribute) else b


@dataclass(frozen=True)
class ModulePlan:
    """Layouts one module declares. See the module docstring."""

    params: Mapping[str, SpmdLayout] = field(default_factory=dict)
    inputs: tuple[Boundary, ...] = ()
    output: Boundary = None
    local_compute: bool = False

    def __post_init__(self) -> None:
        for name, layout in self.params.items():
            if not isinstance(layout, SpmdLayout):
                raise TypeError(
                    f"ModulePlan.params[{name!r}] must be an SpmdLayout, got {type(layout).__name__}."
                )
        for i, b in enumerate((*self.inputs, self.output)):
            if b is not None and not isinstance(b, SpmdLayout | Redistribute):
                raise TypeError(f"ModulePlan boundary #{i} must be SpmdLayout, Redistribute or None, got {b!r}.")


@dataclass(frozen=True)
class ShardingPlan:
    """An ordered mapping of module-name pattern to :class:`ModulePlan`.

    Attributes:
        modules: pattern -> plan, matched against module FQNs segment by segment
            (``layers.*.attention`` matches ``layers.0.attention``; ``*`` never spans a dot).
        mesh_axes: the model-parallel axes the layouts use (e.g. ``("tp",)``).
        output_module: FQN of the module whose output is the model's output
            (vocab-sharded logits when loss parallel is on).
        fsdp_units: patterns of the modules FSDP wraps individually (then the root).
        attention: patterns of the causal attention kernels (``local_compute``
            modules with a causal ``forward(q, k, v)``, heads-first, sequence-sharded on ``cp``) whose
            body context parallelism replaces (:mod:`.context_parallel`).
        stage_boundary: the layout of the activation between the model's top-level blocks
            (the residual stream): what a pipeline stage receives from the one before and
            sends to the one after (:mod:`.pipeline_parallel`). None: the plan declares none,
            and pipeline parallelism is a setup error.
    """

    modules: Mapping[str, ModulePlan]
    mesh_axes: tuple[str, ...] = ("tp",)
    output_module: str = "output"
    fsdp_units: tuple[str, ...] = ()
    attention: tuple[str, ...] = ()
    stage_boundary: SpmdLayout | None = None

    def output_layout(self) -> SpmdLayout | None:
        """The layout of the model's output: the last layout of ``output_module``'s output boundary."""
        mplan = self.modules.get(self.output_module)
        return boundary_dst(mplan.output) if mplan is not None else None

    def fsdp_unit_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules matching ``fsdp_units``, in model order."""
        return [
            m for fqn, m in model.named_modules()
            if any(fqn_matches(pat, fqn) for pat in self.fsdp_units)
        ]

    def resolve(self, model: nn.Module) -> list[tuple[str, nn.Module, ModulePlan]]:
        """Match every pattern against ``model``'s modules.

        Returns ``(fqn, module, plan)`` in model order. Raises ValueError if a
        pattern matches nothing, a module matches two patterns, or a planned
        parameter/buffer does not exist.
        """
        named = dict(model.named_modules())
        matched: dict[str, tuple[str, ModulePlan]] = {}
        for pattern, mplan in self.modules.items():
            hits = [fqn for fqn in named if fqn_matches(pattern, fqn)]
            if not hits:
                raise ValueError(
                    f"sharding plan pattern {pattern!r} matches no module of {type(model).__name__}."
                )
            for fqn in hits:
                if fqn in matched:
                    raise ValueError(
                        f"module {fqn!r} matches two plan patterns: {matched[fqn][0]!r} and {pattern!r}."
                    )
                matched[fqn] = (pattern, mplan)
                module = named[fqn]
                own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
                for pname in mplan.params:
                    if pname not in own:
                        raise ValueError(
                            f"plan {pattern!r} lays out {pname!r}, but module {fqn!r} has only "
                            f"{sorted(own)}."
                        )
        return [(fqn, named[fqn], matched[fqn][1]) for fqn in named if fqn in matched]

    def param_layouts(self, model: nn.Module) -> Iterator[tuple[str, nn.Module, str, SpmdLayout]]:
        """``(module fqn, module, tensor name, layout)`` for every tensor of ``model``.

        Parameters and buffers not named by the plan are replicated (``SpmdLayout()``).
        """
        planned = {fqn: mplan for fqn, _, mplan in self.resolve(model)}
        for fqn, module in model.named_modules():
            mplan = planned.get(fqn)
            own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
            for name, _ in own:
                layout = mplan.params.get(name) if mplan is not None else None
                yield fqn, module, name, layout if layout is not None else SpmdLayout()
