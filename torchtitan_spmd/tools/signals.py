"""Stop signals: SIGTERM and SIGINT end a run cleanly, after the step and the save in progress.

:class:`StopRequest` turns SIGTERM and SIGINT into a request that the ranks agree on after
each step (one small all-reduce), so a save in progress completes and is published, and the
run stops with :class:`StoppedBySignal` (exit ``128 + signal``). A second signal stops at
once (the save, if any, is abandoned without a marker: the next start ignores it).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StopRequest", "StoppedBySignal", "signal_name"]

logger = logging.getLogger("torchtitan_spmd")


class StoppedBySignal(Exception):  # noqa: N818 - it is not an error: the run was asked to stop
    """The run stopped because of SIGTERM or SIGINT, after the step ``step`` (and its save)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        """``128 + signal number``, as a shell reports a process the signal ended."""
        return 128 + self.signum


class StopRequest:
    """SIGTERM/SIGINT handlers that turn the first signal into a stop request.

    :meth:`agreed` (called by every rank after each step) tells whether any rank got one.
    The second signal restores the default handler and re-sends itself: the process ends at
    once, and a save in progress is abandoned (no marker: the next start ignores it).
    Install from the main thread; :meth:`uninstall` restores the previous handlers.
    """

    SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequest:
        """Install the handlers (a no-op outside the main thread); returns ``self``."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were there before :meth:`install`."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            logger.warning(f"{name} again: stopping now (a save in progress is abandoned, without its marker)")
            self.uninstall()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        logger.warning(f"{name} received: stopping after this step and the save in progress, if any "
                       f"(send it again to stop at once)")

    def agreed(self, world_size: int, device: str = "cpu") -> int | None:
        """The signal any rank received (the largest number), the same on every rank; None: none."""
        mine = self.signum or 0
        if world_size > 1:
            flag = torch.tensor([mine], dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            mine = int(flag.item())
        return mine or None


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15."""
    return signal.Signals(signum).name
