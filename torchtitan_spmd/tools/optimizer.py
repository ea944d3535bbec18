"""The optimizer of ``[optimizer]``: one group, or upstream's ``param_groups`` (a0c831c49).

Without ``param_groups``: ``optimizer.name`` (``AdamW`` or ``Adam``, betas 0.9/0.95) over every
parameter with ``lr``, ``eps`` and ``weight_decay``. With them: each trainable parameter goes to
the first group whose ``pattern`` it matches (``re.search`` on its plain name, activation
checkpointing's and compile's wrappers looked through); a pattern that claims nothing and a
trainable parameter no pattern claims are each a ``ValueError`` naming them. The groups of one
optimizer class share one torch optimizer (its ``param_groups``, each tagged with its
``pattern``); two classes make two, behind :class:`Optimizers`, one object for the trainer,
the learning-rate schedule (which scales every group's own ``lr``) and the checkpoint.

Checkpoints carry the grouping: each parameter's group hyperparameters, ``pattern`` and
``optimizer`` are in the flattened optimizer state (``param_groups.<fqn>.pattern``);
:func:`check_same_grouping` turns a changed grouping at resume into one line.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from torchtitan_spmd.distributed.apply_plan import plain_fqn

__all__ = ["BETAS", "Optimizers", "assign_groups", "build_optimizer", "check_same_grouping", "grouping",
           "optimizers_of", "validate_param_groups"]

#: The betas of ``optimizer.name`` without ``param_groups`` (upstream's ``default_adamw``).
BETAS = (0.9, 0.95)

_CLASSES: dict[str, type[torch.optim.Optimizer]] = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


def _impl_kwargs(implementation: str) -> dict[str, bool]:
    """``optimizer.implementation`` as torch's ``foreach``/``fused`` flags (a group's own
    ``optimizer_kwargs`` may override them)."""
    return {"foreach": implementation == "foreach", "fused": implementation in ("fused", "fused_opt_states_bf16")}


class Optimizers(torch.optim.Optimizer):
    """Several torch optimizers (one per optimizer class of ``param_groups``) as one.

    ``param_groups`` is every inner optimizer's groups (the same dicts, so ``LambdaLR``
    scales each group's ``lr`` in place); ``step``, ``zero_grad``, ``state_dict`` and
    ``load_state_dict`` go to each. :func:`optimizers_of` lists the inner ones for
    torch's state-dict helpers, which take one optimizer at a time.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
        super().__init__(params, {})  # hooks and the attributes LRScheduler reads
        self.optimizers = optimizers
        self.param_groups = [g for opt in optimizers for g in opt.param_groups]

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Step every inner optimizer (closures are not supported, as upstream)."""
        if closure is not None:
            raise TypeError("Optimizers.step does not take a closure.")
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) every inner optimizer's gradients."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """``{"0": first optimizer's state_dict, "1": ...}`` (the checkpoint uses torch's helpers per optimizer)."""
        return {str(i): opt.state_dict() for i, opt in enumerate(self.optimizers)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """The inverse of :meth:`state_dict`."""
        for i, opt in enumerate(self.optimizers):
            opt.load_state_dict(state_dict[str(i)])


def optimizers_of(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind ``optimizer``: its inner ones, or itself."""
    return list(optimizer.optimizers) if isinstance(optimizer, Optimizers) else [optimizer]


def _named_trainable(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    for name, param in model.named_parameters():
        if param.requires_grad:
            yield plain_fqn(name), param


def assign_groups(names: list[str], param_groups: list[Any], *, require_every_pattern: bool = True,
                  ) -> list[list[int]]:
    """Which of ``names`` (trainable parameters' plain names) each of ``param_groups`` claims,
    first match wins: one list of indices into ``names`` per group.

    Raises ``ValueError`` naming a pattern that claims nothing (unless not
    ``require_every_pattern``: a pipeline stage holds part of the model) or the names no
    pattern claims."""
    claimed: set[int] = set()
    out: list[list[int]] = []
    for i, group in enumerate(param_groups):
        pattern = re.compile(group.pattern)
        mine = [j for j, name in enumerate(names) if j not in claimed and pattern.search(name)]
        claimed.update(mine)
        if not mine and require_every_pattern:
            raise ValueError(f"optimizer.param_groups[{i}].pattern={group.pattern!r} matches no trainable "
                             "parameter left by the patterns before it"
                             + (f" (names look like {names[0]!r})." if names else "."))
        out.append(mine)
    unclaimed = [name for j, name in enumerate(names) if j not in claimed]
    if unclaimed:
        raise ValueError(f"optimizer.param_groups: no pattern claims the trainable parameter(s) "
                         f"{', '.join(unclaimed[:4])}{', ...' if len(unclaimed) > 4 else ''} "
                         f"({len(unclaimed)} in all); add a last group with pattern '.*'.")
    return out


def validate_param_groups(config: Any, model: nn.Module) -> None:
    """``optimizer.param_groups`` against the whole model (built on the meta device): every
    pattern claims a parameter and every trainable parameter is claimed (``ValueError``)."""
    if config.param_groups:
        assign_groups([name for name, _ in _named_trainable(model)], config.param_groups)


def build_optimizer(model: nn.Module, config: Any, *, whole_model: bool = True) -> torch.optim.Optimizer:
    """The optimizer of ``config`` (an ``[optimizer]`` section) over ``model``'s parameters.

    The state is the parameters' dtype (float32 whatever ``training.mixed_precision_param``).
    Raises ``ValueError`` naming the pattern that claims no parameter (only when
    ``whole_model``: a pipeline stage's part may lack what a pattern is for), the trainable
    parameters that no pattern claims, or a group whose ``optimizer_kwargs`` torch refuses.
    """
    impl = _impl_kwargs(config.implementation)
    named = list(_named_trainable(model))
    if not config.param_groups:
        return _CLASSES[config.name]([{"params": [p for _, p in named], "pattern": ".*"}], lr=config.lr,
                                     eps=config.eps, weight_decay=config.weight_decay, betas=BETAS, **impl)
    by_class: dict[str, list[dict[str, Any]]] = {}
    groups = assign_groups([n for n, _ in named], config.param_groups, require_every_pattern=whole_model)
    for index, (group, mine) in enumerate(zip(config.param_groups, groups, strict=True)):
        if mine:
            kwargs = {**impl, **group.optimizer_kwargs}
            _check_group_kwargs(index, group, kwargs, named[mine[0]][1])
            by_class.setdefault(group.optimizer_name, []).append(
                {"params": [named[j][1] for j in mine], "pattern": group.pattern, **kwargs})
    optimizers = [_CLASSES[name](groups) for name, groups in by_class.items()]
    return optimizers[0] if len(optimizers) == 1 else Optimizers(optimizers)


def _check_group_kwargs(index: int, group: Any, kwargs: dict[str, Any], like: torch.Tensor) -> None:
    """torch's own judgement of one group's kwargs, as one ``ValueError`` naming the group.

    A torch optimizer checks the values of its constructor's arguments (``lr >= 0``, ``betas``,
    ``eps``, unknown names, ``fused`` with ``foreach``), not those of a group dict it is given, so
    the group's kwargs go to the class's constructor over a one-element probe like ``like`` (its
    device and dtype): upstream passes the same kwargs to torch, which takes ``lr=0``.
    """
    cls = _CLASSES[group.optimizer_name]
    probe = torch.zeros(1, dtype=like.dtype, device=like.device, requires_grad=True)
    try:
        cls([probe], **kwargs)
    except (ValueError, TypeError, IndexError, RuntimeError, KeyError) as err:
        raise ValueError(f"optimizer.param_groups[{index}] (pattern {group.pattern!r}): torch.optim."
                         f"{cls.__name__} refuses optimizer_kwargs {dict(group.optimizer_kwargs)!r}: "
                         f"{type(err).__name__}: {err}") from None


def grouping(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """``{plain parameter name: "<optimizer class> <pattern>"}`` of this run."""
    names = {id(p): plain_fqn(n) for n, p in model.named_parameters()}
    out = {}
    for opt in optimizers_of(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in names:
                    out[names[id(p)]] = f"{type(opt).__name__} {group.get('pattern', '.*')!r}"
    return out


def check_same_grouping(saved: Mapping[str, str], current: Mapping[str, str], where: str) -> None:
    """Raise ``ValueError`` in one line when a parameter's optimizer group changed since the save."""
    changed = sorted(k for k in current if k in saved and saved[k] != current[k])
    if changed:
        name = changed[0]
        raise ValueError(f"{where}: the optimizer's param groups changed since the save: {name} was in "
                         f"{saved[name]}, now {current[name]} ({len(changed)} parameter(s) moved); resume "
                         "with the saved optimizer.param_groups, or exclude the optimizer "
                         "(checkpoint.exclude_from_loading=optimizer).")
