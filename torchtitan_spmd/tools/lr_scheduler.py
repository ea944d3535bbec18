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

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["WarmupStableDecay", "build_lr_scheduler"]

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
