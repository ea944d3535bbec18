"""TensorBoard scalars and W&B values of every logged step (``metrics.enable_tensorboard``,
``metrics.enable_wandb``), as torchtitan.

One process writes (rank 0: the trainer's loss and grad norm are global values on every
rank; every rank, each under ``rank_<r>``, with ``metrics.save_for_all_ranks``) through ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package, the
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

and, when the step measured them, ``mfu(%)``, ``tflops`` and ``time_metrics/data_loading(s)``
(:data:`OPTIONAL_TAGS`); a validation adds ``validation_metrics/loss``. W&B (the ``wandb``
package, the ``wandb`` extra) gets the same names, in ``job.dump_folder/wandb``; with
``WANDB_MODE=offline`` nothing leaves the machine.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

from torchtitan_spmd._errors import require

__all__ = ["OPTIONAL_TAGS", "TAGS", "MetricsLogger", "build_metrics_logger"]

#: TensorBoard tag -> the step record's attribute (and a scale).
TAGS: dict[str, tuple[str, float]] = {
    "loss_metrics/global_avg_loss": ("loss", 1.0),
    "grad_norm": ("grad_norm", 1.0),
    "lr": ("lr", 1.0),
    "throughput(tps)": ("tokens_per_s", 1.0),
    "memory/max_active(GiB)": ("peak_memory_mib", 1 / 1024),
}

#: Tags of the step record's optional values, written when measured (upstream's names).
OPTIONAL_TAGS: dict[str, tuple[str, float]] = {
    "mfu(%)": ("mfu", 1.0),
    "tflops": ("tflops", 1.0),
    "time_metrics/data_loading(s)": ("data_loading_s", 1.0),
}


class MetricsLogger:
    """Writes step records as TensorBoard scalars and W&B values; a no-op when built with
    neither (ranks other than the one that logs, or both off).

    Args:
        log_dir: the folder of the TensorBoard event files (created), or None.
        wandb_dir: the folder of the W&B run (created), or None.
        wandb_config: the run's config, recorded by W&B.
    """

    def __init__(self, log_dir: str | None, wandb_dir: str | None = None,
                 wandb_config: dict[str, Any] | None = None) -> None:
        self.log_dir = log_dir
        self.wandb_dir = wandb_dir
        self._writer: Any = None
        self._wandb: Any = None
        if log_dir is not None:
            tb = require("torch.utils.tensorboard", "tensorboard", "metrics.enable_tensorboard")
            os.makedirs(log_dir, exist_ok=True)
            self._writer = tb.SummaryWriter(log_dir, max_queue=1000)
        if wandb_dir is not None:
            wandb = require("wandb", "wandb", "metrics.enable_wandb")
            os.makedirs(wandb_dir, exist_ok=True)
            # W&B writes into a "wandb" folder of its dir: wandb_dir is that folder, not nested twice
            parent = os.path.dirname(wandb_dir) if os.path.basename(wandb_dir) == "wandb" else wandb_dir
            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "torchtitan"), dir=parent,
                                     config=wandb_config or {})

    def _values(self, record: Any) -> dict[str, float]:
        out = {tag: float(getattr(record, attr)) * scale for tag, (attr, scale) in TAGS.items()}
        for tag, (attr, scale) in OPTIONAL_TAGS.items():
            value = getattr(record, attr, None)
            if value is not None:
                out[tag] = float(value) * scale
        return out

    def log(self, record: Any) -> None:
        """Write every :data:`TAGS` value (and the measured :data:`OPTIONAL_TAGS`) of ``record``
        (a ``StepRecord``) at ``record.step``."""
        if self._writer is None and self._wandb is None:
            return
        values = self._values(record)
        if self._writer is not None:
            for tag, value in values.items():
                self._writer.add_scalar(tag, value, record.step)
        if self._wandb is not None:
            self._wandb.log(values, step=record.step)

    def log_validation(self, record: Any) -> None:
        """``validation_metrics/loss`` of a ``ValidationRecord`` at its step (upstream's tag)."""
        if self._writer is not None:
            self._writer.add_scalar("validation_metrics/loss", float(record.loss), record.step)
        if self._wandb is not None:
            self._wandb.log({"validation_metrics/loss": float(record.loss)}, step=record.step)

    def close(self) -> None:
        """Flush and close the event file and finish the W&B run (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def check_metrics_extras(config: Any) -> None:
    """Raise :class:`~torchtitan_spmd._errors.MissingExtraError` (a ``ValueError`` naming the
    field and the extra to install) for each enabled metrics backend whose package is missing.
    The trainer calls it in its validation phase, so the error is agreed and printed once."""
    if config.enable_tensorboard:
        require("torch.utils.tensorboard", "tensorboard", "metrics.enable_tensorboard")
    if getattr(config, "enable_wandb", False):
        require("wandb", "wandb", "metrics.enable_wandb")


def build_metrics_logger(config: Any, dump_folder: str, *, writes: bool | None = None, rank: int = 0,
                         job_config: dict[str, Any] | None = None) -> MetricsLogger:
    """The ``[metrics]`` section's logger for this process: TensorBoard into
    ``dump_folder/save_tb_folder/<YYYYmmdd-HHMM>`` when ``enable_tensorboard``, W&B into
    ``dump_folder/wandb`` when ``enable_wandb``, if this process writes (``writes``; by default
    rank 0, or every rank, each in ``rank_<r>`` (TensorBoard's ``.../rank_<r>``, W&B's
    ``dump_folder/rank_<r>/wandb``), with ``save_for_all_ranks``); otherwise a no-op
    logger. Every process checks that the enabled packages are installed, so a missing extra
    stops all of them at setup."""
    check_metrics_extras(config)
    all_ranks = getattr(config, "save_for_all_ranks", False)
    if writes is None:
        writes = rank == 0 or all_ranks
    if not writes:
        return MetricsLogger(None)
    leaf = f"rank_{rank}" if all_ranks else ""
    tb = (os.path.join(dump_folder, config.save_tb_folder, datetime.now().strftime("%Y%m%d-%H%M"), leaf)
          if config.enable_tensorboard else None)
    wb = os.path.join(dump_folder, leaf, "wandb") if getattr(config, "enable_wandb", False) else None
    return MetricsLogger(tb.rstrip(os.sep) if tb else None, wb.rstrip(os.sep) if wb else None, job_config)
