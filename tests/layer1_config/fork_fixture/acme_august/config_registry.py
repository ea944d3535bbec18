"""The August fork's configs (``--module acme_august --config NAME``)."""

from __future__ import annotations

from torchtitan_spmd.config import ParallelismConfig, TrainingConfig

from .trainer import AugustTrainerConfig


def august_debug() -> AugustTrainerConfig:
    """FSDP 2 x TP 2 under upstream's August default backend (spmd_types: not written)."""
    return AugustTrainerConfig(
        training=TrainingConfig(steps=10, num_tokens_per_microbatch_per_dp_rank=2 * 64, max_context_length=64,
                                num_tokens_per_train_step=4 * 2 * 64 * 2),
        parallelism=ParallelismConfig(data_parallel_shard_degree=2, tensor_parallel_degree=2),
    )


def august_partial_dtensor() -> AugustTrainerConfig:
    """The same run under partial_dtensor, spelled as upstream b5bcd76 spells it."""
    config = august_debug()
    config.parallelism.spmd_backend = "partial_dtensor"
    return config
