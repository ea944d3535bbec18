"""Jobs for the ``qwen3`` family: ``--module qwen3 --config <function name>``."""

from __future__ import annotations

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.config.converters import NVFP4LinearConverterConfig, nvfp4_bf16_tail_fqns
from torchtitan_spmd.models import cpu_job_config, upstream_recipe

from . import model_registry

__all__ = ["qwen3_0_6b", "qwen3_14b", "qwen3_1_7b", "qwen3_30b_a3b", "qwen3_32b", "qwen3_debugmodel",
           "qwen3_debugmodel_first_85_pct_layers_nvfp4", "qwen3_debugmodel_nvfp4", "qwen3_moe_debug",
           "qwen3_moe_tiny", "qwen3_tiny"]


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


_EXTRAS = ("Upstream also: ChunkedCELoss (same loss here, unchunked), the profiler, a validator, c4 data "
           "and ./assets/hf/<model> (see torchtitan_spmd.models.upstream_recipe).")


def qwen3_0_6b() -> JobConfig:
    """Upstream's Qwen3-0.6B recipe: flavour ``0.6B`` (tied embeddings), lr 3e-4, warm-up 2, local batch
    4 x 4096, 10 steps, selective AC, checkpoints every 500."""
    return upstream_recipe("qwen3", "0.6B", lr=3e-4, warmup_steps=2, local_batch_size=4, seq_len=4096, steps=10,
                           checkpoint_interval=500, ac_mode="selective")


def qwen3_1_7b() -> JobConfig:
    """Upstream's Qwen3-1.7B recipe: flavour ``1.7B`` (tied embeddings), lr 8e-4, warm-up 20, local batch
    4 x 4096, 100 steps, selective AC, checkpoints every 50."""
    return upstream_recipe("qwen3", "1.7B", lr=8e-4, warmup_steps=20, local_batch_size=4, seq_len=4096, steps=100,
                           checkpoint_interval=50, ac_mode="selective")


def qwen3_14b() -> JobConfig:
    """Upstream's Qwen3-14B recipe: flavour ``14B``, lr 8e-4, warm-up 600, local batch 4 x 4096, 3000 steps,
    FSDP over every rank, full AC, checkpoints every 500."""
    return upstream_recipe("qwen3", "14B", lr=8e-4, warmup_steps=600, local_batch_size=4, seq_len=4096, steps=3000,
                           checkpoint_interval=500, ac_mode="full")


def qwen3_32b() -> JobConfig:
    """Upstream's Qwen3-32B recipe: flavour ``32B``, lr 8e-4, warm-up 600, local batch 2 x 4096, 3000 steps,
    FSDP over every rank, full AC, checkpoints every 500."""
    return upstream_recipe("qwen3", "32B", lr=8e-4, warmup_steps=600, local_batch_size=2, seq_len=4096, steps=3000,
                           checkpoint_interval=500, ac_mode="full")


def qwen3_30b_a3b() -> JobConfig:
    """Upstream's Qwen3-30B-A3B recipe: flavour ``30B-A3B`` (128 experts, top-8), lr 8e-4, warm-up 600,
    local batch 2 x 4096, 3000 steps, FSDP over every rank, full AC, checkpoints every 500."""
    return upstream_recipe("qwen3", "30B-A3B", lr=8e-4, warmup_steps=600, local_batch_size=2, seq_len=4096,
                           steps=3000, checkpoint_interval=500, ac_mode="full")


for _recipe in (qwen3_0_6b, qwen3_1_7b, qwen3_14b, qwen3_32b, qwen3_30b_a3b):
    _recipe.__doc__ = f"{_recipe.__doc__} {_EXTRAS}"


def qwen3_debugmodel_nvfp4() -> JobConfig:
    """Upstream's (b5bcd76): the debug model's block linears in NVFP4 under ``spmd_types`` (an SM100+ GPU)."""
    job = qwen3_debugmodel()
    job.parallelism.spmd_backend = "spmd_types"
    job.model_spec = model_registry("debugmodel", converters=[NVFP4LinearConverterConfig(fqns=["layers"])])
    return job


def qwen3_debugmodel_first_85_pct_layers_nvfp4() -> JobConfig:
    """Upstream's (b5bcd76): NVFP4 on the first 85 % of the debug model's blocks (an SM100+ GPU)."""
    job = qwen3_debugmodel()
    job.parallelism.spmd_backend = "spmd_types"
    n_layers = model_registry("debugmodel").model_config("debugmodel").n_layers
    job.model_spec = model_registry("debugmodel", converters=[
        NVFP4LinearConverterConfig(fqns=nvfp4_bf16_tail_fqns(n_layers, 0.15))])  # upstream's 15 % tail
    return job
