"""The fork's trainer config: its own root dataclass embedding torchtitan_spmd's sections."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_spmd.config import (
    ActivationCheckpointConfig,
    CheckpointConfig,
    CommConfig,
    CompileConfig,
    DebugConfig,
    ParallelismConfig,
    TrainingConfig,
)


@dataclass(kw_only=True)
class AcmeDataConfig:
    """The fork's own section."""

    corpus: str = "acme-web"
    """Which corpus to read."""

    shuffle: bool = True
    """Shuffle the documents."""


@dataclass(kw_only=True)
class AcmeTrainerConfig:
    """The fork's root config, shaped like torchtitan's ``Trainer.Config``."""

    dump_folder: str = "./outputs"
    """Where outputs go."""

    model_name: str = "acme-llama"
    """The fork's model."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    """[training]"""

    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """[parallelism]"""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """[checkpoint]"""

    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    """[activation_checkpoint]"""

    compile: CompileConfig = field(default_factory=CompileConfig)
    """[compile]"""

    comm: CommConfig = field(default_factory=CommConfig)
    """[comm]"""

    debug: DebugConfig = field(default_factory=DebugConfig)
    """[debug]"""

    data: AcmeDataConfig = field(default_factory=AcmeDataConfig)
    """[data]: the fork's own section."""
