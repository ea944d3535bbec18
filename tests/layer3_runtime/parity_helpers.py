"""Helpers for the parity tests: run the real Trainer on forked gloo ranks and compare it with
the independent reference (:mod:`torchtitan_spmd.reference`: the model restated in plain
PyTorch, ``torch.optim.AdamW``, the schedule's closed form; float64).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import grad_probe

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

#: name -> (world size, parallelism overrides)
PARITY_CONFIGS: dict[str, tuple[int, dict[str, Any]]] = {
    "fsdp4": (4, {"data_parallel_shard_degree": 4}),
    "hsdp2x2": (4, {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2}),
    "tp2_sp": (2, {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2}),
    "fsdp2_tp2": (4, {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}),
}

#: The layouts the second model family (qwen3) runs under every backend (CI time).
QWEN3_CONFIGS: tuple[str, ...] = ("fsdp2_tp2", "tp2_sp")

STEPS = 10
LOCAL_BATCH = 2
SEQ_LEN = 32
FLAVOR = "tiny"
#: Relative tolerance of the per-step loss against the reference.
TOL = 1e-5
#: ... and of the gradient norm: one step of the tiny qwen3 has a norm spike (9.9, the
#: others 2-3) where float32 alone is 1e-5 off the exact (float64) value.
NORM_TOL = 1e-4


def job_config(backend: str, parallelism: dict[str, Any], *, local_batch: int = LOCAL_BATCH,
               steps: int = STEPS, model: str = "llama3", **debug: Any) -> JobConfig:
    """A deterministic fp32 config for parity runs of model family ``model``.

    No activation checkpointing (CI time; ``test_training_features.py`` shows that
    it changes no loss).
    """
    return JobConfig.from_dict(
        {
            "model": {"name": model, "flavor": FLAVOR},
            "training": {"steps": steps, "local_batch_size": local_batch, "seq_len": SEQ_LEN,
                         "device": "cpu", "max_norm": 1.0, "mixed_precision_param": "float32"},
            "activation_checkpoint": {"mode": "none"},
            "optimizer": {"lr": 3e-3},
            "lr_scheduler": {"warmup_steps": 2},
            "parallelism": {**parallelism, "spmd_backend": backend},
            "debug": {"seed": 1234, "deterministic": True, **debug},
        }
    )


def _train(rank: int, world: int, cfg: JobConfig) -> list[tuple[float, float]]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    return [(r.loss, r.grad_norm) for r in trainer.run()]


@functools.cache
def warm_parent() -> None:
    """Import the heavy modules once in the test process, so forked ranks inherit them.

    (``debug.deterministic`` imports torch._inductor: seconds per rank otherwise.)
    Done at first use, not at collection, so deselected runs don't pay for it.
    """
    import torch._inductor  # noqa: F401

    import torchtitan_spmd.train  # noqa: F401
    from torchtitan_spmd.tools.flops import peak_flops

    grad_probe.install()  # every rank records its step-1 gradient norms (grad_probe)
    # The CPU peak a trainer's MFU is measured against, timed here once (a matmul of 0.27 GFLOP,
    # 7 times): ranks forked on as many threads inherit it rather than each timing its own
    # (measured: 2 % of the suite's rank time when every rank timed it).
    peak_flops("cpu", None)


class Run(list):  # type: ignore[type-arg]
    """A run's per-step records (a list, as before), with what the probe recorded (:mod:`grad_probe`)."""

    trace: grad_probe.TrainerTrace | None = None


def with_trace(records: list[Any], per_rank_traces: list[list[grad_probe.TrainerTrace]], index: int = 0) -> Run:
    """``records`` as a :class:`Run` carrying the ranks' pooled trace of trainer ``index``."""
    run = Run(records)
    run.trace = grad_probe.merge(per_rank_traces)[index]
    return run


def run_config(cfg: JobConfig, world: int) -> list[tuple[float, float]]:
    """Per-step (loss, grad_norm) of a run; every rank must agree exactly."""
    warm_parent()
    results = run_forked(grad_probe.probed(_train), world, cfg, timeout_s=300)
    per_rank = [r for r, _ in results]
    for rank, records in enumerate(per_rank):
        if records != per_rank[0]:
            raise AssertionError(f"rank {rank} logged {records}, rank 0 logged {per_rank[0]}")
    run = with_trace(per_rank[0], [t for _, t in results])
    grad_probe.check_schedules([cfg], [run.trace])
    return run


def reference(global_batch: int, steps: int = STEPS, model: str = "llama3") -> tuple[tuple[float, float], ...]:
    """The independent reference on the same global batch (cached per batch size and model)."""
    return reference_with_trace(global_batch, steps, model)[0]


@functools.cache
def reference_with_trace(global_batch: int, steps: int = STEPS, model: str = "llama3") -> tuple[Any, Any]:
    """:func:`reference` and its :class:`~torchtitan_spmd.reference.ReferenceTrace` (cached)."""
    from torchtitan_spmd.reference import ReferenceTrace, run_reference

    cfg = job_config("default", {"data_parallel_shard_degree": 1}, local_batch=global_batch, steps=steps,
                     model=model)
    trace = ReferenceTrace()
    return tuple(run_reference(cfg, global_batch=global_batch, trace=trace)), trace


def check_grad_norms(got: Any, ref_trace: Any, what: str) -> float:
    """Each parameter's step-1 gradient norm of ``got`` (a :class:`Run`) against the reference's,
    within ``grad_probe.GRAD_TOL``; prints and returns the largest relative difference."""
    assert getattr(got, "trace", None) is not None and got.trace.grad_norms, f"{what}: no gradient norms recorded"
    diff = grad_probe.compare_grad_norms(got.trace.grad_norms, ref_trace.grad_norms, what=what)
    print(f"\n{what}: per-tensor gradient norms at step 1: max rel diff {diff:.1e} "
          f"({len(ref_trace.grad_norms)} tensors)")
    return diff


def data_parallel_degree(parallelism: dict[str, Any], world: int) -> int:
    """How many data-parallel ranks share the global batch."""
    tp = parallelism.get("tensor_parallel_degree", 1)
    return world // tp


def skip_full_dtensor_on_old_torch(backend: str, config_name: str) -> None:
    """Skip a full_dtensor run of ``PARITY_CONFIGS[config_name]`` that needs a newer torch, naming it."""
    import pytest
    import torch

    from torchtitan_spmd.distributed.representations import full_dtensor as fd

    world, parallelism = PARITY_CONFIGS[config_name]
    if (backend == "full_dtensor" and data_parallel_degree(parallelism, world) > 1
            and fd.DataParallelMeshDims is None):
        pytest.skip(f"full_dtensor with data parallelism needs torch >= {fd.FSDP_MIN_TORCH} "
                    f"(fully_shard(dp_mesh_dims=...)); this is torch {torch.__version__}")


def max_rel(a: list[float], b: list[float]) -> float:
    """Largest relative difference between two equal-length series; NaN anywhere is infinitely far."""
    assert len(a) == len(b), (len(a), len(b))
    return max((math.inf if math.isnan(x) or math.isnan(y) else abs(x - y) / max(abs(y), 1e-12)
                for x, y in zip(a, b, strict=True)), default=0.0)


def check_parity(got: list[tuple[float, float]] | list[tuple[Any, ...]], config_name: str, *,
                 model: str = "llama3") -> tuple[float, float]:
    """Assert that per-step ``(loss, grad_norm, ...)`` match the reference on the same global batch
    (loss within ``TOL``, gradient norm within ``NORM_TOL``, each parameter's gradient norm at step 1
    within ``grad_probe.GRAD_TOL``: ``got`` a :class:`Run`) and that the model trained; returns the
    largest relative differences (loss, grad norm)."""
    world, parallelism = PARITY_CONFIGS[config_name]
    ref, ref_trace = reference_with_trace(LOCAL_BATCH * data_parallel_degree(parallelism, world), model=model)
    check_grad_norms(got, ref_trace, f"{model} {config_name}")
    loss, norm = [g[0] for g in got], [g[1] for g in got]
    ref_loss, ref_norm = [r[0] for r in ref], [r[1] for r in ref]
    assert max_rel(loss, ref_loss) < TOL, (loss, ref_loss)
    assert max_rel(norm, ref_norm) < NORM_TOL, (norm, ref_norm)
    assert loss[-1] < loss[0] - 0.1  # it trains (guards against a frozen or no-op model)
    return max_rel(loss, ref_loss), max_rel(norm, ref_norm)
