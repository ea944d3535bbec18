"""Helpers for the MoE composition tests: several ``moe_tiny`` runs of one backend in one set of forked
gloo ranks (a fork costs seconds; the runs follow one another in it), each against the independent
reference (:mod:`torchtitan_spmd.reference`, float64)."""

from __future__ import annotations

import dataclasses
from typing import Any

import grad_probe
from moe_helpers import moe_config
from parity_helpers import LOCAL_BATCH, NORM_TOL, SEQ_LEN, TOL, Run, max_rel, warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked
from torchtitan_spmd.models.qwen3 import FLAVORS


@dataclasses.dataclass(frozen=True)
class Case:
    """One run: its name, its config, the reference's global batch (sequences a step), the loss
    tolerance and the gradient norm's (relative, every step)."""

    name: str
    config: JobConfig
    global_batch: int
    tol: float = TOL
    norm_tol: float = NORM_TOL


def tp_cases(backend: str) -> list[Case]:
    """The MoE x TP (and CP) runs of ``backend`` on 4 ranks (FSDP 2 x TP 2), 6 steps each:

    - ``sp``: sequence parallel, selective activation checkpointing (``spmd_types``: type-checked);
    - ``nosp_accum_full_ac``: sequence parallel off, two gradient-accumulation microbatches, full
      activation checkpointing, ``debug.moe_force_load_balance`` (the tokens per expert are known);
    - ``cp2_tp2`` (``full_dtensor``, ``spmd_types``): context parallel 2 x TP 2, ring attention, the
      router per token on this rank's sequence shard, the counts summed over ``cp``;
    - ``sp_bf16`` (``default``): bf16 mixed precision, 3 steps, the loss within 2e-4.
    """
    sp = moe_config(backend, "fsdp4")
    sp.parallelism.data_parallel_shard_degree, sp.parallelism.tensor_parallel_degree = 2, 2
    sp.activation_checkpoint.mode = "selective"
    if backend == "spmd_types":
        sp.debug.spmd_typechecking = True
    nosp = moe_config(backend, "fsdp4", moe_force_load_balance=True)
    nosp.parallelism.data_parallel_shard_degree, nosp.parallelism.tensor_parallel_degree = 2, 2
    nosp.parallelism.enable_sequence_parallel = False
    nosp.training.global_batch_size = 4 * LOCAL_BATCH
    nosp.activation_checkpoint.mode = "full"
    cases = [Case("sp", sp, 2 * LOCAL_BATCH), Case("nosp_accum_full_ac", nosp, 4 * LOCAL_BATCH)]
    if backend != "default":  # context parallelism runs under full_dtensor and spmd_types (no³ under default)
        cp = moe_config(backend, "fsdp4")
        cp.parallelism.data_parallel_shard_degree, cp.parallelism.tensor_parallel_degree = 1, 2
        cp.parallelism.context_parallel_degree = 2
        cases.append(Case("cp2_tp2", cp, LOCAL_BATCH))
    else:  # bf16 parameters (FSDP2's policy, fp32 reduce), 3 steps: loss within 2e-4 (the FSDP 4 bf16
        # check's bound; measured 1.1e-4), gradient norm within 1e-2 (measured 3.2e-3)
        bf16 = moe_config(backend, "fsdp4")
        bf16.parallelism.data_parallel_shard_degree, bf16.parallelism.tensor_parallel_degree = 2, 2
        bf16.training.mixed_precision_param, bf16.training.steps = "bfloat16", 3
        cases.append(Case("sp_bf16", bf16, 2 * LOCAL_BATCH, tol=2e-4, norm_tol=1e-2))
    return cases


def compile_cases() -> list[Case]:
    """MoE x ``torch.compile`` of the blocks (``aot_eager``: the graphs without inductor's minutes of
    codegen) on one process under ``default``, 6 steps each: routed with selective activation
    checkpointing; forced balance with full activation checkpointing (the counts known)."""
    cases = []
    for name, ac, force in (("compile_selective_ac", "selective", False), ("compile_full_ac_forced", "full", True)):
        cfg = moe_config("default", "single", moe_force_load_balance=force)
        cfg.activation_checkpoint.mode = ac
        cfg.compile.enable, cfg.compile.backend, cfg.compile.components = True, "aot_eager", ["model"]
        cases.append(Case(name, cfg, LOCAL_BATCH))
    return cases


def _worker(rank: int, world: int, configs: list[JobConfig]) -> list[list[tuple[Any, ...]]]:
    from torch._dynamo.utils import counters

    from torchtitan_spmd.techniques.fsdp import clear_dtensor_sharding_caches
    from torchtitan_spmd.train import Trainer

    out = []
    for cfg in configs:
        # A later trainer in the process: DTensor's propagation caches key on mesh equality.
        clear_dtensor_sharding_caches()
        trainer = Trainer(cfg)
        try:
            graphs = int(counters["stats"]["unique_graphs"])
            out.append([(r.loss, r.grad_norm, None if r.expert_load is None else (r.expert_load.min, r.expert_load.max),
                         int(counters["stats"]["unique_graphs"]) - graphs) for r in trainer.run()])
        finally:
            trainer.close()
    return out


def run_cases(cases: list[Case], world: int) -> dict[str, list[tuple[Any, ...]]]:
    """Each case's per-step ``(loss, grad_norm, (min, max) tokens per expert, graphs Dynamo compiled
    in the run)`` of rank 0; every rank must log the same numbers (the graph counts may differ:
    under expert parallelism Dynamo breaks the graph at rank-dependent places)."""
    warm_parent()
    probed = run_forked(grad_probe.probed(_worker), world, [c.config for c in cases], timeout_s=600)
    per_rank = [r for r, _ in probed]

    def numbers(records: list[list[tuple[Any, ...]]]) -> list[list[tuple[Any, ...]]]:
        return [[step[:3] for step in run] for run in records]

    for rank, records in enumerate(per_rank):
        if numbers(records) != numbers(per_rank[0]):
            raise AssertionError(f"rank {rank} logged {records}, rank 0 logged {per_rank[0]}")
    traces = grad_probe.merge([t for _, t in probed])
    grad_probe.check_schedules([c.config for c in cases], traces)
    return {c.name: with_trace_of(got, trace) for c, got, trace in zip(cases, per_rank[0], traces, strict=True)}


def with_trace_of(records: list[Any], trace: grad_probe.TrainerTrace) -> Run:
    """``records`` as a :class:`parity_helpers.Run` carrying ``trace``."""
    run = Run(records)
    run.trace = trace
    return run


def reference_of(case: Case) -> tuple[tuple[float, float], ...]:
    """The reference's per-step ``(loss, grad_norm)`` for ``case`` (its routing switches, its global batch)."""
    from torchtitan_spmd.reference import run_reference

    cfg = moe_config("default", "single", moe_force_load_balance=case.config.debug.moe_force_load_balance)
    cfg.training.local_batch_size = case.global_batch
    return tuple(run_reference(cfg, global_batch=case.global_batch))


def check_against_the_reference(backend: str, cases: list[Case], got: dict[str, list[tuple[Any, ...]]]) -> None:
    """Every case's loss within its ``tol`` (``TOL``) and gradient norm within its ``norm_tol``
    (``NORM_TOL``) of the reference at every step, and it trains; fp32 cases also per tensor
    (``moe_helpers.check_moe_trace``: step-1 gradient norms, expert biases, tokens per expert)."""
    from moe_helpers import check_moe_trace, moe_reference_with_trace

    for case in cases:
        ref = reference_of(case)[:len(got[case.name])]
        if case.config.training.mixed_precision_param == "float32":  # per tensor: fp32 runs only
            ref_trace = moe_reference_with_trace(case.global_batch, case.config.debug.moe_force_load_balance)[1]
            check_moe_trace(got[case.name], ref_trace, f"moe compose {backend} {case.name}")
        loss, norm = [g[0] for g in got[case.name]], [g[1] for g in got[case.name]]
        loss_diff, norm_diff = max_rel(loss, [r[0] for r in ref]), max_rel(norm, [r[1] for r in ref])
        print(f"\nmoe compose {backend} {case.name}: max rel diff loss {loss_diff:.1e} grad_norm {norm_diff:.1e}")
        assert loss_diff < case.tol, (case.name, loss, ref)
        assert norm_diff < case.norm_tol, (case.name, norm, ref)
        assert loss[-1] < loss[0] - 0.1


def check_counted_once(cases: list[Case], got: dict[str, list[tuple[Any, ...]]]) -> None:
    """Under forced balance every expert gets exactly the global step's tokens x top-k / experts
    (summed over the data ranks, not again over the TP ranks that route the same tokens)."""
    (case,) = [c for c in cases if c.config.debug.moe_force_load_balance]
    tiny = FLAVORS["moe_tiny"]
    each = case.global_batch * SEQ_LEN * tiny.top_k // tiny.num_experts
    assert [g[2] for g in got[case.name]] == [(each, each)] * len(got[case.name])
