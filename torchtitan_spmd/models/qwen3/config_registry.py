"""Jobs for the ``qwen3`` family: ``--module qwen3 --config <function name>``."""

from __future__ import annotations

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.models import cpu_job_config

__all__ = ["qwen3_debugmodel", "qwen3_moe_debug", "qwen3_moe_tiny", "qwen3_tiny"]


def qwen3_debugmodel() -> JobConfig:
    """The 6.07M-parameter debug model: local batch 4 x 256 tokens, lr 8e-4, 10 steps."""
    return cpu_job_config("qwen3", "debugmodel", local_batch_size=4, seq_len=256, lr=8e-4)


def qwen3_tiny() -> JobConfig:
    """The small test model: local batch 2 x 32 tokens, lr 3e-3, 10 steps (seconds on CPU)."""
    return cpu_job_config("qwen3", "tiny", local_batch_size=2, seq_len=32, lr=3e-3)


def qwen3_moe_debug() -> JobConfig:
    """Upstream's MoE debug model (``debugmodel_moe``: 64 experts, top-8): local batch 4 x 256 tokens
    (upstream: 4 x 4096, sized for a GPU), lr 3e-4, 10 steps."""
    return cpu_job_config("qwen3", "debugmodel_moe", local_batch_size=4, seq_len=256, lr=3e-4)


def qwen3_moe_tiny() -> JobConfig:
    """The small MoE test model (``moe_tiny``: 2 layers, 8 experts, top-2): local batch 2 x 32 tokens,
    lr 3e-3, 10 steps (seconds on CPU)."""
    return cpu_job_config("qwen3", "moe_tiny", local_batch_size=2, seq_len=32, lr=3e-3)
