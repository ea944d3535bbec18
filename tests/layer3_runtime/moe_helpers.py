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


def moe_reference(global_batch: int) -> tuple[tuple[float, float], ...]:
    """The reference's per-step (loss, grad_norm) on ``global_batch`` sequences a step (cached)."""
    return moe_reference_with_trace(global_batch)[0]


@functools.cache
def moe_reference_with_trace(global_batch: int, force: bool = False) -> tuple[Any, Any]:
    """:func:`moe_reference` (``force``: ``debug.moe_force_load_balance``) and its
    :class:`~torchtitan_spmd.reference.ReferenceTrace` (gradient norms, tokens per expert, biases)."""
    from torchtitan_spmd.reference import ReferenceTrace, run_reference

    cfg = moe_config("default", "single", moe_force_load_balance=force)
    cfg.training.local_batch_size = global_batch
    trace = ReferenceTrace()
    return tuple(run_reference(cfg, global_batch=global_batch, trace=trace)), trace


def check_moe_trace(got: Any, ref_trace: Any, what: str) -> None:
    """A run's :mod:`grad_probe` trace against the reference's: every parameter's gradient norm at
    step 1 (the router gates included), every layer's expert bias after every step, and, where
    the records carry it (``got[i][2]``), the fewest and most tokens any expert got each step."""
    from grad_probe import compare_expert_bias
    from parity_helpers import check_grad_norms

    check_grad_norms(got, ref_trace, what)
    compare_expert_bias(got.trace.expert_bias, ref_trace.expert_bias, what=what)
    loads = [g[2] for g in got if len(g) > 2 and isinstance(g[2], tuple)]
    if loads:
        want = [(min(min(c) for c in step), max(max(c) for c in step)) for step in ref_trace.tokens_per_expert]
        assert loads == want[: len(loads)], (what, loads, want)


def check_moe_parity(got: list[tuple[Any, ...]], layout: str) -> tuple[float, float]:
    """Loss within ``TOL`` and gradient norm within ``NORM_TOL`` of the reference at every step, each
    parameter's gradient norm at step 1 and the expert biases after every step too, and it
    trains; returns the largest relative differences."""
    ref, ref_trace = moe_reference_with_trace(GLOBAL_BATCH[layout])
    check_moe_trace(got, ref_trace, f"moe {layout}")
    loss, norm = [g[0] for g in got], [g[1] for g in got]
    loss_diff, norm_diff = max_rel(loss, [r[0] for r in ref]), max_rel(norm, [r[1] for r in ref])
    assert loss_diff < TOL, (loss, ref)
    assert norm_diff < NORM_TOL, (norm, ref)
    assert loss[-1] < loss[0] - 0.1
    return loss_diff, norm_diff
