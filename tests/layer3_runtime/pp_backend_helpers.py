"""Helpers for the pipeline-parallel tests under ``full_dtensor`` and ``spmd_types``: the cells, the
planted plans, and one forked run of many cells.

Every cell is 4 gloo ranks forked from the test process (:func:`run_cell`), which has imported the
library once (:func:`parity_helpers.warm_parent`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grad_probe
from parity_helpers import job_config, reference_with_trace, warm_parent
from pipeline_feature_helpers import SCHEDULES

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

WORLD = 4
STEPS = 4


@dataclass(frozen=True)
class Cell:
    """One PP run: ``backend`` on ``parallelism`` (with ``pipeline_parallel_degree`` 2)."""

    backend: str
    parallelism: dict[str, Any]
    local_batch: int = 2
    microbatch: int = 1
    typecheck: bool = False
    #: A name of :data:`PLANTS`: the plan is changed before the model is built.
    plant: str | None = None
    steps: int = STEPS
    #: ``debug.spmd_typechecking_steps`` (with ``typecheck``).
    typecheck_steps: int | None = None

    @property
    def global_batch(self) -> int:
        """Rows a step reads: the local batch times the data-parallel degree."""
        return self.local_batch * self.parallelism.get("data_parallel_shard_degree", 1)

    def config(self) -> JobConfig:
        par = {"pipeline_parallel_degree": 2, "pipeline_parallel_microbatch_size": self.microbatch,
               "data_parallel_shard_degree": 1, **self.parallelism}
        debug = ({"spmd_typechecking": True, "spmd_typechecking_steps": self.typecheck_steps}
                 if self.typecheck else {})
        cfg = job_config(self.backend, par, local_batch=self.local_batch, steps=self.steps, **debug)
        cfg.training.global_batch_size = self.global_batch
        return cfg


def _fsdp2(schedule: str) -> dict[str, Any]:
    return {"data_parallel_shard_degree": 2, "pipeline_parallel_schedule": schedule}


#: PP2 x TP2 GPipe: two microbatches of two rows (a one-row global microbatch under full_dtensor
#: hits DTensor's view rule on a size-1 batch dim: "would remove or reshape sharded dimension 0").
_TP2_GPIPE = {"tensor_parallel_degree": 2, "pipeline_parallel_schedule": "GPipe"}
_CP2_1F1B = {"context_parallel_degree": 2, "pipeline_parallel_schedule": "1F1B"}
#: Four stages ([embedding], [layers.0], [layers.1], [norm, output]) over pp 2 x tp 2, sequence
#: parallelism off (the residual stream replicated on tp): layers.1 is stage 2, a middle stage.
_TP2_INTERLEAVED = {"tensor_parallel_degree": 2, "pipeline_parallel_schedule": "Interleaved1F1B",
                    "enable_sequence_parallel": False}

#: A CSV schedule with split backwards (``I``/``W`` actions), two stages a rank (loop placement).
_CSV_SPLIT_BACKWARD = {**_fsdp2("PipelineScheduleMulti"),
                       "pipeline_parallel_schedule_csv": str(SCHEDULES / "pp2_looped_zero_bubble.csv")}

#: name -> cell; the parity cells of the issue per backend, one PP x CP cell each, a schedule that
#: splits each backward in two (input, then weight gradients) each, and the planted missing
#: collective trained without the checker.
PARITY_CELLS: dict[str, Cell] = {
    "full_dtensor-pp2_fsdp2_1f1b": Cell("full_dtensor", _fsdp2("1F1B")),
    "full_dtensor-pp2_fsdp2_zbvzerobubble": Cell("full_dtensor", _fsdp2("ZBVZeroBubble")),
    "full_dtensor-pp2_fsdp2_csv_split_backward": Cell("full_dtensor", _CSV_SPLIT_BACKWARD),
    "full_dtensor-pp2_tp2_gpipe": Cell("full_dtensor", _TP2_GPIPE, local_batch=4, microbatch=2),
    "full_dtensor-pp2_fsdp2_interleaved1f1b": Cell("full_dtensor", _fsdp2("Interleaved1F1B")),
    "full_dtensor-pp2_cp2_1f1b": Cell("full_dtensor", _CP2_1F1B),
    "spmd_types-pp2_fsdp2_1f1b": Cell("spmd_types", _fsdp2("1F1B")),
    "spmd_types-pp2_tp2_gpipe-typed": Cell("spmd_types", _TP2_GPIPE, local_batch=4, microbatch=2,
                                           typecheck=True),
    "spmd_types-pp2_fsdp2_interleaved1f1b-typed": Cell("spmd_types", _fsdp2("Interleaved1F1B"), typecheck=True),
    "spmd_types-pp2_cp2_1f1b-typed": Cell("spmd_types", _CP2_1F1B, typecheck=True),
    "spmd_types-pp2_fsdp2_zbvzerobubble-typed": Cell("spmd_types", _fsdp2("ZBVZeroBubble"), typecheck=True),
    "spmd_types-pp2_tp2_interleaved1f1b-typed": Cell("spmd_types", _TP2_INTERLEAVED, local_batch=4, microbatch=2,
                                                     typecheck=True),
    "spmd_types-missing_reduce_in_stage2-unchecked": Cell("spmd_types", _TP2_INTERLEAVED, local_batch=4,
                                                          microbatch=2, plant="missing_reduce"),
}

MISSING_REDUCE_TYPED = dataclasses.replace(PARITY_CELLS["spmd_types-missing_reduce_in_stage2-unchecked"],
                                           typecheck=True)
#: The module whose collective :func:`_missing_reduce` drops (in stage 2 of 4).
MISSING_REDUCE_MODULE = "layers.1.feed_forward.w2"


def _missing_reduce(plan: Any) -> Any:
    """``plan`` with the rowwise ``w2`` of ``layers.1`` declaring its partial output as the residual
    stream without the all-reduce (a fork's plan that forgot the reduction in one block)."""
    from torchtitan_spmd.distributed.plan import ModulePlan, boundary_dst

    w2 = plan.modules["layers.*.feed_forward.w2"]
    modules = {("layers.[!1].feed_forward.w2" if k == "layers.*.feed_forward.w2" else k): v
               for k, v in plan.modules.items()}
    modules[MISSING_REDUCE_MODULE] = ModulePlan(params=w2.params, inputs=w2.inputs,
                                                output=boundary_dst(w2.output))
    return dataclasses.replace(plan, modules=modules)


def _no_stage_boundary(plan: Any) -> Any:
    return dataclasses.replace(plan, stage_boundary=None)


def _wrong_stage_boundary(plan: Any) -> Any:
    from torchtitan_spmd.distributed.layout import SpmdLayout

    return dataclasses.replace(plan, stage_boundary=SpmdLayout())


#: name -> plan transformation.
PLANTS = {"missing_reduce": _missing_reduce, "no_stage_boundary": _no_stage_boundary,
          "wrong_stage_boundary": _wrong_stage_boundary}


def planted_spec(name: str, plant: str | None) -> Any:
    """The model spec of family ``name`` whose plans go through ``PLANTS[plant]`` (as it is for None)."""
    from torchtitan_spmd.models import get_model_spec

    spec = get_model_spec(name)
    if plant is None:
        return spec
    change = PLANTS[plant]
    return dataclasses.replace(spec, sharding_plan=lambda *a, **k: change(spec.sharding_plan(*a, **k)))


def train_cell(cell: Cell) -> dict[str, Any]:
    """Train one cell in this process: ``{"records": per-step (loss, grad norm)}``."""
    from unittest import mock

    import torchtitan_spmd.train as train_module

    with mock.patch.object(train_module, "get_model_spec", lambda name: planted_spec(name, cell.plant)):
        trainer = train_module.Trainer(cell.config())
    try:
        records = [(r.loss, r.grad_norm) for r in trainer.run()]
    finally:
        trainer.close()
    return {"records": records}


def _train_one(rank: int, world: int, cell: Cell) -> dict[str, Any]:
    return train_cell(cell)


def run_cell(cell: Cell, *, timeout_s: float = 300,
             train: Callable[[int, int, Cell], dict[str, Any]] = _train_one) -> dict[str, Any]:
    """``train(rank, world, cell)`` (by default :func:`train_cell`) on :data:`WORLD` forked gloo ranks
    of their own (they inherit the warm parent's imports): rank 0's result, with every rank's
    (``"ranks"``) and the pooled :mod:`grad_probe` trace (``"trace"``; the schedule class that ran
    is checked here); every rank must log the same steps (``WorkerError`` if a rank raises).

    One fork per cell: a second FSDP trainer in the same process over an equal mesh meets the first
    one's mesh objects in torch's FSDP ("Expected param's DTensor mesh to be the same mesh passed
    to fully_shard", measured).
    """
    warm_parent()
    probed = run_forked(grad_probe.probed(train), WORLD, cell, timeout_s=timeout_s)
    per_rank = [r for r, _ in probed]
    for rank, result in enumerate(per_rank):
        if result["records"] != per_rank[0]["records"]:
            raise AssertionError(f"rank {rank} logged {result}, rank 0 {per_rank[0]}")
    (trace,) = grad_probe.merge([t for _, t in probed])
    grad_probe.check_schedules([cell.config()], [trace])
    return {**per_rank[0], "ranks": per_rank, "trace": trace}


def _reference(rank: int, world: int, global_batch: int) -> tuple[tuple[tuple[float, float], ...], dict[str, float]]:
    records, trace = reference_with_trace(global_batch, steps=STEPS)
    return records, trace.grad_norms


class _Records(tuple):  # type: ignore[type-arg]
    """The reference's per-step records (a tuple, as before) with its step-1 gradient norms."""

    grad_norms: dict[str, float]


@functools.cache
def pp_reference(global_batch: int) -> tuple[tuple[float, float], ...]:
    """:func:`parity_helpers.reference` of :data:`STEPS` steps (with ``.grad_norms``: each parameter's
    at step 1), computed in a forked child: a backward in this process after the in-process setup
    tests' DTensor sharding propagation would make torch refuse autograd in every rank forked later
    ("Unable to handle autograd's threading in combination with fork-based multiprocessing", measured)."""
    warm_parent()
    records, norms = run_forked(_reference, 1, global_batch, timeout_s=120)[0]
    out = _Records(records)
    out.grad_norms = norms
    return out


def check_pp_checkpoint_round_trip(backend: str, folder: Any) -> None:
    """Save at step 2 of PP 2 x FSDP 2 Interleaved1F1B (two stages a rank) under ``backend``; assert
    that the checkpoint holds the whole model's FQNs (no stage prefix) and that one process without
    PP resumes it on the reference's steps 3-4."""
    import torch.distributed.checkpoint as dcp
    from checkpoint_helpers import ck_config
    from parity_helpers import run_config

    from torchtitan_spmd.models import get_model_spec

    saved = ck_config(backend, "single", folder, steps=2, interval=2, last_save_model_only=False)
    for key, value in {"data_parallel_shard_degree": 2, "pipeline_parallel_degree": 2,
                       "pipeline_parallel_schedule": "Interleaved1F1B"}.items():
        setattr(saved.parallelism, key, value)
    saved.training.local_batch_size = 2  # global batch 4, as the one-process run's
    run_config(saved, WORLD)
    keys = set(dcp.FileSystemReader(str(folder / "checkpoint" / "step-2")).read_metadata().state_dict_metadata)
    spec = get_model_spec("llama3")
    names = {n for n, _ in spec.build(spec.flavors["tiny"]).named_parameters()}
    model_keys = {k for k in keys if k.split(".")[0] in {"tok_embeddings", "layers", "norm", "output"}}
    assert model_keys == names, sorted(model_keys ^ names)
    got = run_config(ck_config(backend, "single", folder, steps=STEPS, interval=2), 1)
    assert len(got) == 2
    assert_matches_reference(got, pp_reference(4)[2:])


def assert_matches_reference(got: Sequence[tuple[float, float]], ref: Sequence[tuple[float, float]],
                             trace: grad_probe.TrainerTrace | None = None, *, what: str = "") -> None:
    """Per-step loss within ``parity_helpers.TOL`` and gradient norm within ``NORM_TOL`` of ``ref``; with
    ``trace`` (the run's, pooled over every stage), each parameter's step-1 gradient norm within
    ``grad_probe.GRAD_TOL`` of ``ref.grad_norms`` (:func:`pp_reference`)."""
    from parity_helpers import NORM_TOL, TOL, max_rel

    if trace is not None:
        diff = grad_probe.compare_grad_norms(trace.grad_norms, ref.grad_norms, what=what)  # type: ignore[attr-defined]
        print(f"\n{what}: per-tensor gradient norms at step 1: max rel diff {diff:.1e}")
    assert max_rel([g[0] for g in got], [r[0] for r in ref]) < TOL, (got, ref)
    assert max_rel([g[1] for g in got], [r[1] for r in ref]) < NORM_TOL, (got, ref)
