"""Helpers for the context-parallel tests (layers 3 and 4): configs and the parity check.

The reference is :func:`parity_helpers.reference`: one process, ``spmd_backend="default"``,
no context parallelism (full sequences, positions ``0 .. seq-1``, the causal SDPA), on
the same global batch.
"""

from __future__ import annotations

from typing import Any

from parity_helpers import LOCAL_BATCH, job_config, max_rel, reference

#: name -> (world size, parallelism overrides)
CP_CONFIGS: dict[str, tuple[int, dict[str, Any]]] = {
    "cp2": (2, {"data_parallel_shard_degree": 1, "context_parallel_degree": 2}),
    "cp2_tp2": (4, {"data_parallel_shard_degree": 1, "context_parallel_degree": 2, "tensor_parallel_degree": 2}),
    "fsdp2_cp2": (4, {"data_parallel_shard_degree": 2, "context_parallel_degree": 2}),
}

CP_STEPS = 5
TOL = 1e-5


def cp_job_config(backend: str, config_name: str, **overrides: Any) -> Any:
    """The deterministic parity config of ``CP_CONFIGS[config_name]`` (5 steps); ``overrides``
    go to the parallelism section (e.g. ``context_parallel_load_balancer=None``)."""
    _, parallelism = CP_CONFIGS[config_name]
    debug = {"spmd_typechecking": True} if backend == "spmd_types" else {}
    return job_config(backend, {**parallelism, **overrides}, steps=CP_STEPS, **debug)


def global_batch(config_name: str) -> int:
    """The global batch of a CP run: the local batch times the data-parallel degree
    (context-parallel ranks share their rows, each holding a slice of every sequence)."""
    world, par = CP_CONFIGS[config_name]
    dp = world // (par.get("tensor_parallel_degree", 1) * par["context_parallel_degree"])
    return LOCAL_BATCH * dp


def check_cp_parity(got: list[tuple[Any, ...]], config_name: str) -> tuple[float, float]:
    """Assert per-step ``(loss, grad_norm, ...)`` within ``TOL`` of the one-process run and that the
    model trained; returns the largest relative differences (loss, grad norm)."""
    ref = reference(global_batch(config_name), steps=CP_STEPS)
    loss, norm = [g[0] for g in got], [g[1] for g in got]
    ref_loss, ref_norm = [r[0] for r in ref], [r[1] for r in ref]
    assert max_rel(loss, ref_loss) < TOL, (loss, ref_loss)
    assert max_rel(norm, ref_norm) < TOL, (norm, ref_norm)
    assert loss[-1] < loss[0] - 0.1  # it trains (guards against a frozen or no-op model)
    return max_rel(loss, ref_loss), max_rel(norm, ref_norm)
