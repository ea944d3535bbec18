"""torchtitan_spmd's job configuration (layer 1 of the stack).

A drop-in for ``torchtitan.config``::

    from torchtitan_spmd.config import ConfigManager, DebugConfig, ParallelismConfig

The sections live in :mod:`.configs` (as in torchtitan), the root ``JobConfig``
in :mod:`.job_config`, the tyro-based ``ConfigManager`` in :mod:`.manager`, and
the table of features the trainer does not implement yet in :mod:`.support`.
This package imports nothing from ``torchtitan_spmd.distributed`` or the runtime.
"""

from .activation_checkpoint import (
    ActivationCheckpointing,
    FullAC,
    MemoryBudgetAC,
    SelectiveAC,
    ac_section,
)
from .configs import (
    SPMD_BACKEND_ALIASES,
    SPMD_BACKENDS,
    ActivationCheckpointConfig,
    CheckpointConfig,
    CommConfig,
    CompileConfig,
    DataloaderConfig,
    DebugConfig,
    JobSection,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    ParamGroupConfig,
    ProfilerConfig,
    SpmdBackend,
    SpmdBackendSpelling,
    TokenizerConfig,
    TrainingConfig,
    ValidatorConfig,
)
from .fault_tolerance import FaultToleranceConfig
from .job_config import JobConfig, SpmdTypecheckingWarning
from .manager import ConfigManager
from .support import check_supported

#: torchtitan's map of dtype names to torch dtypes, built on first use (torch is not
#: imported with the config).
TORCH_DTYPE_MAP: dict[str, object]


def __getattr__(name: str) -> object:
    if name == "ActivationCheckpointingConfig":  # upstream b5bcd76's union (tyro imported on first use)
        from . import activation_checkpoint

        return activation_checkpoint.ActivationCheckpointingConfig
    if name == "TORCH_DTYPE_MAP":
        import torch

        value = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SPMD_BACKENDS",
    "SPMD_BACKEND_ALIASES",
    "TORCH_DTYPE_MAP",
    "ActivationCheckpointConfig",
    "ActivationCheckpointing",
    "ActivationCheckpointingConfig",
    "FullAC",
    "MemoryBudgetAC",
    "SelectiveAC",
    "ac_section",
    "CheckpointConfig",
    "CommConfig",
    "CompileConfig",
    "ConfigManager",
    "DataloaderConfig",
    "DebugConfig",
    "FaultToleranceConfig",
    "JobConfig",
    "JobSection",
    "LRSchedulerConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "ParamGroupConfig",
    "ProfilerConfig",
    "SpmdBackend",
    "SpmdBackendSpelling",
    "SpmdTypecheckingWarning",
    "TokenizerConfig",
    "TrainingConfig",
    "ValidatorConfig",
    "check_supported",
]
