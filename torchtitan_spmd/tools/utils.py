"""Scheduled garbage collection (upstream's ``torchtitan.tools.utils.GarbageCollection``).

Python's automatic collector runs whenever enough container objects have been
allocated since the last pass, and a training step allocates many (autograd
nodes, DTensor specs, hook closures): on a small model its passes are a visible
share of a step, at times no rank can predict, so the ranks wait for each other.
As upstream, the trainer turns it off and collects generation 1 every
``training.gc_freq`` steps; ``training.gc_debug`` collects every generation at
every step and, on CUDA, warns about reference cycles that hold tensors.
"""

from __future__ import annotations

import gc
import logging
import time

__all__ = ["GarbageCollection"]

logger = logging.getLogger(__name__)


class GarbageCollection:
    """Automatic collection off from construction to :meth:`close`; a collection every ``gc_freq`` steps.

    Raises ``ValueError`` if ``gc_freq`` is not a positive integer. :meth:`close`
    turns the automatic collector back on if it was on before (a trainer built
    inside a longer-lived process, such as a test, leaves it as it found it).
    """

    def __init__(self, gc_freq: int = 50, debug: bool = False) -> None:
        if isinstance(gc_freq, bool) or not isinstance(gc_freq, int) or gc_freq < 1:
            raise ValueError(f"training.gc_freq must be an integer >= 1, got {gc_freq!r}.")
        self.gc_freq = gc_freq
        self.debug = debug
        self._was_enabled = gc.isenabled()
        gc.disable()
        self.collect("initial collection")
        if debug:
            import torch

            if torch.cuda.is_available():
                from torch.utils.viz._cycles import warn_tensor_cycles

                warn_tensor_cycles()  # records CUDA memory history: CUDA only
            else:
                logger.warning("training.gc_debug: collecting every step; the warnings about "
                               "reference cycles that hold tensors need CUDA and are off.")

    def run(self, step: int) -> bool:
        """Collect if step ``step`` (1-based) is due; return whether a collection ran."""
        if self.debug:
            self.collect("gc_debug: full collection", generation=2)
            return True
        if step > 1 and step % self.gc_freq == 0:
            self.collect("periodic collection")
            return True
        return False

    @staticmethod
    def collect(reason: str, generation: int = 1) -> None:
        """``gc.collect(generation)``, logging how long it took."""
        start = time.monotonic()
        gc.collect(generation)
        logger.debug("[GC] %s took %.3f s", reason, time.monotonic() - start)

    def close(self) -> None:
        """Turn the automatic collector back on if it was on at construction."""
        if self._was_enabled:
            gc.enable()
