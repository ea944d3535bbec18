"""The fork's configs, one function each (``--module acme_titan --config NAME``)."""

from __future__ import annotations

from torchtitan_spmd.config import ParallelismConfig, TrainingConfig

from .trainer import AcmeTrainerConfig


def acme_debug() -> AcmeTrainerConfig:
    """A small FSDP 2 x TP 2 run."""
    return AcmeTrainerConfig(
        training=TrainingConfig(steps=10, local_batch_size=2, seq_len=64),
        parallelism=ParallelismConfig(data_parallel_shard_degree=2, tensor_parallel_degree=2),
    )


def acme_full_dtensor() -> AcmeTrainerConfig:
    """The same run under the full_dtensor backend, spelled as the fork always has."""
    config = acme_debug()
    config.parallelism = ParallelismConfig(  # the fork's legacy constructor keyword
        data_parallel_shard_degree=2, tensor_parallel_degree=2, full_dtensor=True
    )
    return config


NOT_A_FUNCTION = 3


def acme_returns_dict() -> dict[str, int]:
    """Not a config: ConfigManager must say so."""
    return {"steps": 3}
