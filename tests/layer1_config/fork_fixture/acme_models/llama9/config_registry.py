"""Configs of the ``llama9`` family."""

from __future__ import annotations

from torchtitan_spmd.config import JobConfig, ModelConfig, TrainingConfig


def llama9_debugmodel() -> JobConfig:
    """The family's debug model, 10 steps."""
    return JobConfig(
        model=ModelConfig(name="llama9", flavor="debugmodel"),
        training=TrainingConfig(steps=10, local_batch_size=4, seq_len=256),
    )
