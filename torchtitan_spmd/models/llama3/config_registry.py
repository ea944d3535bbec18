"""Jobs for the ``llama3`` family: ``--module llama3 --config <function name>``."""

from __future__ import annotations

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.config.converters import (
    Float8LinearConverterConfig,
    LoRAConverterConfig,
    MXFP8LinearConverterConfig,
    NVFP4LinearConverterConfig,
    nvfp4_bf16_tail_fqns,
)
from torchtitan_spmd.models import cpu_job_config, upstream_recipe

from . import model_registry

__all__ = ["llama3_405b", "llama3_70b", "llama3_8b", "llama3_8b_first_85_pct_layers_nvfp4", "llama3_8b_mxfp8",
           "llama3_debugmodel", "llama3_debugmodel_first_85_pct_layers_nvfp4", "llama3_debugmodel_flex_attn",
           "llama3_debugmodel_float8", "llama3_debugmodel_float8_emulate_lora", "llama3_debugmodel_nvfp4",
           "llama3_tiny"]


def llama3_debugmodel() -> JobConfig:
    """The 6.07M-parameter debug model: local batch 4 x 256 tokens, lr 8e-4, 10 steps."""
    return cpu_job_config("llama3", "debugmodel", local_batch_size=4, seq_len=256, lr=8e-4)


def llama3_debugmodel_flex_attn() -> JobConfig:
    """:func:`llama3_debugmodel` on packed documents (upstream's name): flavour ``debugmodel_flex_attn``,
    ``attn_mask_type="block_causal"`` (each document attends only within itself)."""
    return cpu_job_config("llama3", "debugmodel_flex_attn", local_batch_size=4, seq_len=256, lr=8e-4)


def _compile_enabled(job: JobConfig) -> bool:
    return job.compile.enable and "model" in job.compile.components


def llama3_debugmodel_float8() -> JobConfig:
    """Upstream's: :func:`llama3_debugmodel` with its linears in float8 (torchao's ``rowwise`` recipe,
    ``Float8LinearConverter``). Needs an SM89+ GPU, as upstream's; on a CPU
    ``--config llama3_debugmodel_float8_emulate_lora`` (or a job with ``emulate=True``) runs."""
    job = llama3_debugmodel()
    job.model_spec = model_registry("debugmodel", converters=[
        Float8LinearConverterConfig(model_compile_enabled=_compile_enabled(job))])
    return job


def llama3_debugmodel_float8_emulate_lora() -> JobConfig:
    """Upstream's CPU-runnable converter recipe: :func:`llama3_debugmodel` with float8 emulated and LoRA
    (rank 8, alpha 16) on ``wq``, ``wkv`` (upstream's fused name: ``wk`` and ``wv`` here) and ``wo``;
    everything else frozen."""
    job = llama3_debugmodel()
    job.model_spec = model_registry("debugmodel", converters=[
        Float8LinearConverterConfig(emulate=True, model_compile_enabled=False),
        LoRAConverterConfig(rank=8, alpha=16.0, target_modules=["wq", "wkv", "wo"]),
    ])
    return job


#: Upstream's NVFP4 mix: the last 15 % of the blocks (and the output) stay in high precision.
_NVFP4_BF16_TAIL_FRACTION = 0.15


def _nvfp4_leading_blocks(flavor: str) -> list[str]:
    """The NVFP4 converter's ``fqns`` for ``flavor``: its blocks but the high-precision tail."""
    n_layers = model_registry(flavor).model_config(flavor).n_layers
    return nvfp4_bf16_tail_fqns(n_layers, _NVFP4_BF16_TAIL_FRACTION)


def llama3_debugmodel_nvfp4() -> JobConfig:
    """Upstream's (b5bcd76): the debug model's block linears in NVFP4 under ``spmd_types``. NVFP4 needs an
    SM100+ GPU: elsewhere a one-line setup error."""
    job = llama3_debugmodel()
    job.parallelism.spmd_backend = "spmd_types"
    job.model_spec = model_registry("debugmodel", converters=[
        NVFP4LinearConverterConfig(fqns=["layers"], model_compile_enabled=_compile_enabled(job))])
    return job


def llama3_debugmodel_first_85_pct_layers_nvfp4() -> JobConfig:
    """Upstream's (b5bcd76): NVFP4 on the first 85 % of the debug model's blocks (SM100+)."""
    job = llama3_debugmodel()
    job.parallelism.spmd_backend = "spmd_types"
    job.model_spec = model_registry("debugmodel", converters=[
        NVFP4LinearConverterConfig(fqns=_nvfp4_leading_blocks("debugmodel"), model_compile_enabled=_compile_enabled(job))])
    return job


def llama3_tiny() -> JobConfig:
    """The 140k-parameter test model: local batch 2 x 32 tokens, lr 3e-3, 10 steps (seconds on CPU)."""
    return cpu_job_config("llama3", "tiny", local_batch_size=2, seq_len=32, lr=3e-3)


def llama3_8b() -> JobConfig:
    """Upstream's Llama-3.1-8B recipe: flavour ``8B``, lr 3e-4, local batch 1 x 8192, 1000 steps,
    selective AC, checkpoints every 500, TensorBoard. Upstream also: ChunkedCELoss (same loss here,
    unchunked), the profiler, a validator, c4 data and ``./assets/hf/Llama-3.1-8B`` (see
    :func:`~torchtitan_spmd.models.upstream_recipe`)."""
    return upstream_recipe("llama3", "8B", lr=3e-4, local_batch_size=1, seq_len=8192, steps=1000,
                           checkpoint_interval=500, ac_mode="selective", tensorboard=True)


def llama3_70b() -> JobConfig:
    """Upstream's Llama-3.1-70B recipe: flavour ``70B``, lr 1.5e-4, local batch 8 x 8192, 1000 steps,
    TP 8, full AC, checkpoints every 500, TensorBoard (upstream's extras as :func:`llama3_8b`)."""
    return upstream_recipe("llama3", "70B", lr=1.5e-4, local_batch_size=8, seq_len=8192, steps=1000,
                           checkpoint_interval=500, ac_mode="full", tensorboard=True, tensor_parallel_degree=8)


def llama3_405b() -> JobConfig:
    """Upstream's Llama-3.1-405B recipe: flavour ``405B``, lr 8e-5, warm-up 600, local batch 2 x 8192,
    3000 steps, TP 8 with async TP, the blocks compiled (upstream's ``CompileConfig(enable=True)``),
    full AC, checkpoints every 500, TensorBoard, and its linears in float8 but the output
    (``Float8LinearConverter``, filter ``output``: an SM89+ GPU). Async TP runs on CUDA; the dry run
    (``--comm.mode fake_backend``) accepts both; a real CPU run stops at setup naming
    ``parallelism.enable_async_tensor_parallel`` (``--parallelism.no-enable-async-tensor-parallel``
    runs it without)."""
    job = upstream_recipe("llama3", "405B", lr=8e-5, warmup_steps=600, local_batch_size=2, seq_len=8192,
                          steps=3000, checkpoint_interval=500, ac_mode="full", tensorboard=True,
                          tensor_parallel_degree=8, enable_async_tensor_parallel=True)
    job.compile.enable = True
    job.model_spec = model_registry("405B", converters=[
        Float8LinearConverterConfig(filter_fqns=["output"], model_compile_enabled=_compile_enabled(job))])
    return job


def llama3_8b_mxfp8() -> JobConfig:
    """Upstream's (b5bcd76): :func:`llama3_8b` compiled, its linears in MXFP8 (an SM100+ GPU)."""
    job = llama3_8b()
    job.compile.enable, job.compile.components = True, ["model"]
    job.model_spec = model_registry("8B", converters=[MXFP8LinearConverterConfig(model_compile_enabled=True)])
    return job


def llama3_8b_first_85_pct_layers_nvfp4() -> JobConfig:
    """Upstream's (b5bcd76): :func:`llama3_8b` compiled under ``spmd_types``, NVFP4 on its first 85 % of
    blocks (an SM100+ GPU)."""
    job = llama3_8b()
    job.parallelism.spmd_backend = "spmd_types"
    job.compile.enable, job.compile.components = True, ["model"]
    job.model_spec = model_registry("8B", converters=[
        NVFP4LinearConverterConfig(fqns=_nvfp4_leading_blocks("8B"), model_compile_enabled=True)])
    return job
