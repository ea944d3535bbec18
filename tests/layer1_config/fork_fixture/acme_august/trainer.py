"""The fork's root config (upstream b5bcd76's ``Trainer.Config`` shape) and code that reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_spmd.config import (
    ActivationCheckpointingConfig,
    CompileConfig,
    DebugConfig,
    FullAC,
    ParallelismConfig,
    SelectiveAC,
    TrainingConfig,
)


@dataclass(kw_only=True)
class AugustTrainerConfig:
    """The fork's root config."""

    dump_folder: str = "./outputs"
    """Where outputs go."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    """[training]"""

    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """[parallelism]"""

    compile: CompileConfig = field(default_factory=CompileConfig)
    """[compile]"""

    activation_checkpoint: ActivationCheckpointingConfig = field(default_factory=SelectiveAC.Config)
    """upstream b5bcd76's union of policies (#3674): ``activation-checkpoint:full`` on the command line"""

    debug: DebugConfig = field(default_factory=DebugConfig)
    """[debug]"""


def uses_partial_dtensor(config: AugustTrainerConfig) -> bool:
    """What upstream's code at b5bcd76 writes (e.g. its loss and AC helpers)."""
    return config.parallelism.spmd_backend == "partial_dtensor"


def recomputes_whole_blocks(config: AugustTrainerConfig) -> bool:
    """What upstream's code at b5bcd76 writes (e.g. its minimal async EP check)."""
    return isinstance(config.activation_checkpoint, FullAC.Config)


def microbatch_sequences(config: AugustTrainerConfig) -> int:
    """Upstream's arithmetic: sequences of one forward on one data-parallel rank."""
    return config.training.num_tokens_per_microbatch_per_dp_rank // config.training.max_context_length
