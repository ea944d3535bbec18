"""torchtitan_spmd's job configuration (layer 1 of the stack).

A drop-in for ``torchtitan.config``::

    from torchtitan_spmd.config import ConfigManager, JobConfig, ParallelismConfig

This package imports nothing from ``torchtitan_spmd.distributed`` or the runtime.
"""

from .job_config import (
    SPMD_BACKEND_ALIASES,
    SPMD_BACKENDS,
    CommConfig,
    DebugConfig,
    JobConfig,
    JobSection,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    SpmdBackend,
    SpmdTypecheckingWarning,
    TrainingConfig,
)
from .manager import ConfigManager

__all__ = [
    "SPMD_BACKENDS",
    "SPMD_BACKEND_ALIASES",
    "CommConfig",
    "ConfigManager",
    "DebugConfig",
    "JobConfig",
    "JobSection",
    "LRSchedulerConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "SpmdBackend",
    "SpmdTypecheckingWarning",
    "TrainingConfig",
]
