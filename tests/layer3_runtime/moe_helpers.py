"""Helpers for the MoE parity tests: ``moe_tiny`` (2 layers, 8 experts, top-2) on real forked gloo
ranks against the independent reference (:mod:`torchtitan_spmd.reference`, float64), 6 steps."""

from __future__ import annotations

import functools
from typing import Any

from parity_helpers import LOCAL_BATCH, NORM_TOL, TOL, job_config, max_rel

from torchtitan_spmd.config import JobConfig

STEPS = 6
FLAVOR = "moe_tiny"

#: name -> (world size, parallelism overrides)
MOE_LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "single": (1, {"data_parallel_shard_degree": 1}),
    "fsdp4": (4, {"data_parallel_shard_degree": 4}),
    # HSDP 2 x 2, two gradient-accumulation microbatches, selective activation checkpointing
    "hsdp_accum_ac": (4, {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2}),
}

#: sequences per step of each layout (the reference's global batch)
GLOBAL_BATCH = {"single": LOCAL_BATCH, "fsdp4": 4 * LOCAL_BATCH, "hsdp_accum_ac": 8 * LOCAL_BATCH}


def moe_config(backend: str, layout: str, **debug: Any) -> JobConfig:
    """The parity harness's deterministic fp32 config (no AC) with the ``moe_tiny`` flavour, 6 steps."""
    cfg = job_config(backend, MOE_LAYOUTS[layout][1], model="qwen3", steps=STEPS, **debug)
    cfg.model.flavor = FLAVOR
    if layout == "hsdp_accum_ac":
        cfg.training.global_batch_size = GLOBAL_BATCH[layout]
        cfg.activation_checkpoint.mode = "selective"
    return cfg


@functools.cache
def moe_reference(global_batch: int) -> tuple[tuple[float, float], ...]:
    """The reference's per-step (loss, grad_norm) on ``global_batch`` sequences a step (cached)."""
    from torchtitan_spmd.reference import run_reference

    cfg = moe_config("default", "single")
    cfg.training.local_batch_size = global_batch
    return tuple(run_reference(cfg, global_batch=global_batch))


def check_moe_parity(got: list[tuple[Any, ...]], layout: str) -> tuple[float, float]:
    """Loss within ``TOL`` and gradient norm within ``NORM_TOL`` of the reference at every step, and it
    trains; returns the largest relative differences."""
    ref = moe_reference(GLOBAL_BATCH[layout])
    loss, norm = [g[0] for g in got], [g[1] for g in got]
    loss_diff, norm_diff = max_rel(loss, [r[0] for r in ref]), max_rel(norm, [r[1] for r in ref])
    assert loss_diff < TOL, (loss, ref)
    assert norm_diff < NORM_TOL, (norm, ref)
    assert loss[-1] < loss[0] - 0.1
    return loss_diff, norm_diff
