"""Helpers for ``test_pipeline_features.py``: several pipeline-parallel jobs on one group of forked
gloo ranks, each the real Trainer, compared with the independent reference.

One launch runs a list of configs in turn (each its own Trainer, the DTensor caches cleared
between them), so the cases share the forks and the imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grad_probe
from parity_helpers import job_config, warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

#: The shipped CSV schedules (tests/assets/pp_schedules).
SCHEDULES = Path(__file__).resolve().parents[1] / "assets" / "pp_schedules"
STEPS = 4


def pp_config(parallelism: dict[str, Any], *, local_batch: int = 2, global_batch: int = 4, steps: int = STEPS,
              model: str = "llama3", flavor: str = "tiny") -> JobConfig:
    """The parity harness's deterministic fp32 config (no AC) with ``parallelism`` and the batch sizes."""
    cfg = job_config("default", parallelism, local_batch=local_batch, steps=steps, model=model)
    cfg.model.flavor = flavor
    cfg.training.global_batch_size = global_batch
    return cfg


def pp2(schedule: str = "1F1B", **fields: Any) -> dict[str, Any]:
    """PP 2 x FSDP 2 (4 ranks) with ``pipeline_parallel_schedule=schedule`` and other fields."""
    return {"data_parallel_shard_degree": 2, "pipeline_parallel_degree": 2, "pipeline_parallel_schedule": schedule,
            **fields}


def _worker(rank: int, world: int, configs: list[JobConfig]) -> list[dict[str, Any]]:
    import torch
    from torch._dynamo.utils import counters

    from torchtitan_spmd.techniques.fsdp import clear_dtensor_sharding_caches
    from torchtitan_spmd.train import Trainer

    out = []
    for cfg in configs:
        # A second trainer in the process: DTensor's propagation caches key on mesh equality
        # and would hand the first trainer's (equal) mesh objects to the second.
        clear_dtensor_sharding_caches()
        torch._dynamo.reset()  # an earlier run's compiled code would be reused: count this run's graphs
        graphs = counters["stats"]["unique_graphs"]
        trainer = Trainer(cfg)
        try:
            records = [(r.loss, r.grad_norm, None if r.expert_load is None else
                        (r.expert_load.min, r.expert_load.max)) for r in trainer.run()]
        finally:
            trainer.close()
        out.append({"records": records, "graphs": counters["stats"]["unique_graphs"] - graphs})
    return out


@dataclass
class Cell:
    """One config's run: the per-step ``(loss, grad_norm, tokens/expert min-max or None)``, which
    every rank logged alike, and how many graphs Dynamo captured on each rank."""

    records: list[tuple[Any, ...]]
    graphs: list[int]
    #: What :mod:`grad_probe` recorded, pooled over the ranks (the schedule class checked already).
    trace: grad_probe.TrainerTrace | None = None


def run_cells(configs: dict[str, JobConfig], world: int, timeout_s: float = 600) -> dict[str, Cell]:
    """Each config's :class:`Cell`, all configs in one launch of ``world`` ranks."""
    warm_parent()
    names = list(configs)
    probed = run_forked(grad_probe.probed(_worker), world, [configs[n] for n in names], timeout_s=timeout_s)
    per_rank = [r for r, _ in probed]
    for rank, results in enumerate(per_rank):
        for name, mine, first in zip(names, results, per_rank[0], strict=True):
            if mine["records"] != first["records"]:
                raise AssertionError(f"{name}: rank {rank} logged {mine['records']}, rank 0 logged {first['records']}")
    traces = grad_probe.merge([t for _, t in probed])
    grad_probe.check_schedules([configs[n] for n in names], traces)
    return {name: Cell(per_rank[0][i]["records"], [r[i]["graphs"] for r in per_rank], traces[i])
            for i, name in enumerate(names)}
