"""The fork's llama3 configs."""

from __future__ import annotations

from torchtitan.config import ForkTrainerConfig
from torchtitan_spmd.config import TrainingConfig


def llama3_debugmodel() -> ForkTrainerConfig:
    """The fork's debug job (the library's llama3 has a function of this name too)."""
    return ForkTrainerConfig(dump_folder="./fork_outputs", training=TrainingConfig(steps=7))
