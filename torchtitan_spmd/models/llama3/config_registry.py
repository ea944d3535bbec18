"""Jobs for the ``llama3`` family: ``--module llama3 --config <function name>``."""

from __future__ import annotations

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.models import cpu_job_config, upstream_recipe

__all__ = ["llama3_405b", "llama3_70b", "llama3_8b", "llama3_debugmodel", "llama3_debugmodel_flex_attn", "llama3_tiny"]


def llama3_debugmodel() -> JobConfig:
    """The 6.07M-parameter debug model: local batch 4 x 256 tokens, lr 8e-4, 10 steps."""
    return cpu_job_config("llama3", "debugmodel", local_batch_size=4, seq_len=256, lr=8e-4)


def llama3_debugmodel_flex_attn() -> JobConfig:
    """:func:`llama3_debugmodel` on packed documents (upstream's name): flavour ``debugmodel_flex_attn``,
    ``attn_mask_type="block_causal"`` (each document attends only within itself)."""
    return cpu_job_config("llama3", "debugmodel_flex_attn", local_batch_size=4, seq_len=256, lr=8e-4)


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
    full AC, checkpoints every 500, TensorBoard. Upstream also converts the linears to float8,
    which this library lacks. Async TP runs on CUDA; the dry run (``--comm.mode fake_backend``)
    accepts it; a real CPU run stops at setup naming ``parallelism.enable_async_tensor_parallel``
    (``--parallelism.no-enable-async-tensor-parallel`` runs it without)."""
    config = upstream_recipe("llama3", "405B", lr=8e-5, warmup_steps=600, local_batch_size=2, seq_len=8192,
                             steps=3000, checkpoint_interval=500, ac_mode="full", tensorboard=True,
                             tensor_parallel_degree=8, enable_async_tensor_parallel=True)
    config.compile.enable = True
    return config
