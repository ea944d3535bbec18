"""Jobs for the ``deepseek_v3`` family: ``--module deepseek_v3 --config <function name>``.

Upstream's recipe names (a0c831c49); ``deepseek_v3_16b`` and ``deepseek_v3_671b`` keep upstream's
batch, sequence, learning rate and schedule numbers (sized for GPU clusters; here they run only
with the degrees and devices they need). ``deepseek_v3_tiny`` is for tests (seconds on CPU).
"""

from __future__ import annotations

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.config.converters import (
    Float8GroupedExpertsConverterConfig,
    Float8LinearConverterConfig,
    MXFP8GroupedExpertsConverterConfig,
    MXFP8LinearConverterConfig,
)
from torchtitan_spmd.models import cpu_job_config

from . import model_registry

__all__ = ["deepseek_v3_16b", "deepseek_v3_671b", "deepseek_v3_671b_float8", "deepseek_v3_debugmodel",
           "deepseek_v3_debugmodel_mxfp8", "deepseek_v3_tiny"]


def deepseek_v3_debugmodel() -> JobConfig:
    """Upstream's debug model (6 layers, MLA, 8 experts top-3, 2 shared experts, 1 dense layer):
    local batch 4 x 256 tokens (upstream: 8 x 2048, sized for a GPU), lr 8e-4, 10 steps."""
    return cpu_job_config("deepseek_v3", "debugmodel", local_batch_size=4, seq_len=256, lr=8e-4)


def deepseek_v3_tiny() -> JobConfig:
    """The small test model (3 layers, 8 experts in 4 groups, sigmoid routing, q_lora_rank 16, YaRN):
    local batch 2 x 32 tokens, lr 3e-3, 10 steps."""
    return cpu_job_config("deepseek_v3", "tiny", local_batch_size=2, seq_len=32, lr=3e-3)


def _large(flavor: str, *, steps: int, warmup_steps: int) -> JobConfig:
    config = cpu_job_config("deepseek_v3", flavor, local_batch_size=4, seq_len=4096, lr=2.2e-4, steps=steps,
                            warmup_steps=warmup_steps)
    config.lr_scheduler.min_lr_factor = 0.1
    config.training.mixed_precision_param = "bfloat16"
    return config


def deepseek_v3_16b() -> JobConfig:
    """The 16B flavour (deepseek-moe-16b's sizes, as upstream): local batch 4 x 4096, lr 2.2e-4, min lr
    factor 0.1, 1000 steps (upstream's numbers), 100 warmup steps (this library's choice), bf16."""
    return _large("16B", steps=1000, warmup_steps=100)


def deepseek_v3_671b() -> JobConfig:
    """DeepSeek-V3 671B: local batch 4 x 4096, lr 2.2e-4, min lr factor 0.1, 10000 steps, 2000 warmup
    steps (upstream's numbers), bf16."""
    return _large("671B", steps=10_000, warmup_steps=2000)


def deepseek_v3_671b_float8() -> JobConfig:
    """Upstream's (b5bcd76; a0c831c49's ``deepseek_v3_671b`` listed the same converters): the 671B
    recipe with its dense linears in float8 but the output and the routers' gates, and float8
    grouped GEMMs for the experts (an SM89+ GPU: torchao's ``_Float8GroupedMM``, the experts whole on
    their ranks; experts whose hidden dim tensor parallelism shards are a setup error there)."""
    job = deepseek_v3_671b()
    compiled = job.compile.enable and "model" in job.compile.components
    job.model_spec = model_registry("671B", converters=[
        Float8LinearConverterConfig(filter_fqns=["lm_head", "router.gate"], model_compile_enabled=compiled),
        Float8GroupedExpertsConverterConfig(model_compile_enabled=compiled),
    ])
    return job


def deepseek_v3_debugmodel_mxfp8() -> JobConfig:
    """Upstream's (b5bcd76): the debug model compiled, its linears and experts in MXFP8 (an SM100+ GPU)."""
    job = deepseek_v3_debugmodel()
    job.compile.enable, job.compile.components = True, ["model"]
    job.model_spec = model_registry("debugmodel", converters=[
        MXFP8LinearConverterConfig(model_compile_enabled=True),
        MXFP8GroupedExpertsConverterConfig(model_compile_enabled=True),
    ])
    return job
