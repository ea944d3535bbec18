"""The learning-rate schedule of ``[lr_scheduler]``: upstream's warmup-stable-decay (a0c831c49).

A multiplicative factor of ``optimizer.lr`` (and of every param group's own ``lr``) for
``torch.optim.lr_scheduler.LambdaLR``, a pure function of the 0-based count of completed
optimizer steps, in three phases:

1. **warmup**, ``warmup_steps`` steps: ``(step + 1) / warmup_steps``;
2. **stable**, factor 1: until the last ``decay_steps`` of the schedule;
3. **decay**, ``decay_steps`` steps: ``progress = (step + 1 - warmup - stable) / decay_steps``
   and ``linear`` ``1 - progress``, ``sqrt`` ``1 - sqrt(progress)`` or ``cosine``
   ``(1 + cos(pi * progress)) / 2``, scaled into ``[min_lr_factor, 1]``.

``decay_steps`` is ``round(total * decay_ratio)`` (WSD, arXiv 2404.06395) or, without
``decay_ratio``, every step after the warmup. ``total`` is ``lr_scheduler.total_steps`` or
``training.steps``. As upstream, one virtual step is added to the stable phase so that the
last real step's factor is not ``min_lr_factor`` exactly, and a warmup longer than the run
(or a warmup plus decay longer) is shortened to fit, with a warning. Written here (not
imported from torchtitan, which this library does not depend on) with upstream's formula.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["WarmupStableDecay", "build_lr_scheduler", "lr_state_problem"]

logger = logging.getLogger("torchtitan_spmd")


@dataclass(frozen=True)
class WarmupStableDecay:
    """The schedule's phase lengths (after upstream's adjustments) and its decay; callable as
    ``LambdaLR``'s ``lr_lambda``."""

    warmup_steps: int
    stable_steps: int
    decay_steps: int
    decay_type: str
    min_lr_factor: float

    @classmethod
    def from_config(cls, config: Any, training_steps: int) -> WarmupStableDecay:
        """From an ``[lr_scheduler]`` section and ``training.steps``, as upstream builds it."""
        total = config.total_steps if config.total_steps is not None else training_steps
        warmup = int(config.warmup_steps)
        once = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0  # one line per job
        if warmup > total and once:
            logger.warning(f"lr_scheduler.warmup_steps={warmup} exceeds the {total} steps of the "
                           f"schedule: the warmup is {total} steps.")
        warmup = min(warmup, total)
        if config.decay_ratio is not None:
            decay = round(total * config.decay_ratio)
            if warmup + decay > total:
                if once:
                    logger.warning(f"lr_scheduler: warmup ({warmup}) + decay ({decay}) steps exceed the "
                                   f"{total} steps of the schedule: the decay is {total - warmup} steps.")
                decay = total - warmup
        else:
            decay = total - warmup
        # the virtual last step: the run's last step is not at min_lr_factor exactly
        stable = total + 1 - warmup - decay
        return cls(warmup, stable, decay, config.decay_type, config.min_lr_factor)

    def __call__(self, step: int) -> float:
        """The factor of 0-based step ``step`` (the optimizer steps already taken)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if step < self.warmup_steps + self.stable_steps or self.decay_steps <= 0:
            return 1.0  # (no decay: past the schedule's end, as a resumed run's later steps are, it stays)
        progress = (step + 1 - self.warmup_steps - self.stable_steps) / self.decay_steps
        curve: Callable[[float], float] = _DECAYS[self.decay_type]
        return self.min_lr_factor + (1.0 - self.min_lr_factor) * curve(progress)


    @classmethod
    def state_problem(cls, state: Any) -> tuple[str, str] | None:
        """``(field, what is wrong)`` with ``state``, a saved schedule (``LambdaLR`` saves the
        lambda's ``__dict__``), for this class (None: nothing): the same fields, whole phase
        lengths, a known decay, a finite ``min_lr_factor`` in [0, 1]."""
        fields = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(state, Mapping) or set(state) != fields:
            keys = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
            return "", f"holds a schedule with the fields {keys}, not {sorted(fields)}"
        for name in ("warmup_steps", "stable_steps", "decay_steps"):
            if type(state[name]) is not int or state[name] < 0:
                return name, f"holds {str(state[name])[:40]!r}, not a whole number of steps"
        if state["decay_type"] not in _DECAYS:
            return "decay_type", (f"holds decay_type {str(state['decay_type'])[:40]!r}, which is no decay this "
                                  f"library knows ({', '.join(_DECAYS)})")
        factor = state["min_lr_factor"]
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0.0 <= factor <= 1.0:
            return "min_lr_factor", f"holds min_lr_factor {str(factor)[:40]!r}, not a number in [0, 1]"
        return None


_DECAYS: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1.0 - p,
    "sqrt": lambda p: 1.0 - math.sqrt(p),
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
}


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: Any,
                       training_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` over every param group of ``optimizer`` with :class:`WarmupStableDecay`
    (each group's own ``lr`` is its peak)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupStableDecay.from_config(config, training_steps))


def _finite_numbers(value: Any, n: int) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == n and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)


def lr_state_problem(scheduler: Any, state: Any) -> tuple[str, str] | None:
    """``(key, what is wrong)`` with ``state``, a ``LambdaLR`` state read from a checkpoint, for
    ``scheduler`` (None: nothing): one saved schedule per param group, each valid
    (:meth:`WarmupStableDecay.state_problem`), finite learning rates, whole step counts.
    Checked at load: ``LambdaLR.load_state_dict`` copies the saved fields into the live
    schedule as they are, so an unknown ``decay_type`` would fail only at the first step."""
    if not isinstance(state, Mapping):
        return "", f"is a {type(state).__name__}, not a scheduler state"
    ours = list(getattr(scheduler, "lr_lambdas", []))
    saved = state.get("lr_lambdas")
    if not isinstance(saved, (list, tuple)) or len(saved) != len(ours):
        shown = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
        return "lr_lambdas", f"holds {shown} schedules for {len(ours)} param groups"
    for i, (fn, fields) in enumerate(zip(ours, saved, strict=True)):
        if isinstance(fn, WarmupStableDecay):
            problem = WarmupStableDecay.state_problem(fields)
            if problem is not None:
                return ".".join(p for p in ("lr_lambdas", str(i), problem[0]) if p), problem[1]
    for key in ("base_lrs", "_last_lr"):
        if key in state and not _finite_numbers(state[key], len(ours)):
            return key, f"holds {str(state[key])[:60]!r}, not {len(ours)} finite learning rates"
    for key, least in (("last_epoch", -1), ("_step_count", 0)):
        if key in state and (type(state[key]) is not int or state[key] < least):
            return key, f"holds {str(state[key])[:40]!r}, not a whole step count"
    return None
