"""TensorBoard scalars of every logged step (``metrics.enable_tensorboard``), as torchtitan.

One process writes (rank 0: the trainer's loss and grad norm are global values on every
rank) through ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package, the
``tensorboard`` extra, imported when the writer is built) into
``job.dump_folder/metrics.save_tb_folder/YYYYmmdd-HHMM``. Each logged step (every
``metrics.log_freq`` steps, and the last) gets these tags, with torchtitan's names:

==================================  ==========================================================
``loss_metrics/global_avg_loss``    the step's global mean loss
``grad_norm``                       the global gradient norm before clipping
``lr``                              the learning rate the step used
``throughput(tps)``                 tokens per second of this rank
``memory/max_active(GiB)``          peak memory: CUDA's max allocated, on CPU the peak RSS
==================================  ==========================================================
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

from torchtitan_spmd._errors import require

__all__ = ["TAGS", "MetricsLogger", "build_metrics_logger"]

#: TensorBoard tag -> the step record's attribute (and a scale).
TAGS: dict[str, tuple[str, float]] = {
    "loss_metrics/global_avg_loss": ("loss", 1.0),
    "grad_norm": ("grad_norm", 1.0),
    "lr": ("lr", 1.0),
    "throughput(tps)": ("tokens_per_s", 1.0),
    "memory/max_active(GiB)": ("peak_memory_mib", 1 / 1024),
}


class MetricsLogger:
    """Writes step records as TensorBoard scalars; a no-op when built with ``log_dir=None``.

    Args:
        log_dir: the folder of the event files (created), or None for a logger that writes
            nothing (ranks other than the one that logs, or TensorBoard off).
    """

    def __init__(self, log_dir: str | None) -> None:
        self.log_dir = log_dir
        self._writer: Any = None
        if log_dir is not None:
            tb = require("torch.utils.tensorboard", "tensorboard", "metrics.enable_tensorboard")
            os.makedirs(log_dir, exist_ok=True)
            self._writer = tb.SummaryWriter(log_dir, max_queue=1000)

    def log(self, record: Any) -> None:
        """Add every :data:`TAGS` scalar of ``record`` (a ``StepRecord``) at ``record.step``."""
        if self._writer is None:
            return
        for tag, (attr, scale) in TAGS.items():
            self._writer.add_scalar(tag, float(getattr(record, attr)) * scale, record.step)

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def build_metrics_logger(config: Any, dump_folder: str, *, writes: bool) -> MetricsLogger:
    """The ``[metrics]`` section's logger: TensorBoard into
    ``dump_folder/save_tb_folder/<YYYYmmdd-HHMM>`` when ``enable_tensorboard`` and ``writes``
    (this is the process that logs); otherwise a no-op logger. With ``enable_tensorboard`` every
    process checks that TensorBoard is installed, so a missing extra stops all of them at setup."""
    if config.enable_tensorboard:
        require("torch.utils.tensorboard", "tensorboard", "metrics.enable_tensorboard")
    if not (config.enable_tensorboard and writes):
        return MetricsLogger(None)
    return MetricsLogger(os.path.join(dump_folder, config.save_tb_folder, datetime.now().strftime("%Y%m%d-%H%M")))
