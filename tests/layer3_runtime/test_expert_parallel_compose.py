"""Layer 3: expert parallelism composed with tensor, context and pipeline parallelism and compile,
on 4 real forked gloo ranks, against the independent float64 reference (loss within 1e-5,
gradient norm within 1e-4, every step; ``moe_tiny``).

Per backend, in one set of forks (6 steps each):

- ``ep2_sp``: FSDP 2 x TP 2 x EP 2 (``ep`` takes the ``tp`` ranks, the experts ``Shard(0)`` on
  them and FSDP over ``efsdp`` = the ``dp_shard`` pairs), sequence parallel on, selective
  activation checkpointing (``spmd_types``: type-checked, no AC: the checker's typed combine and
  selective AC's recompute do not mix);
- ``ep2_nosp_forced``: the same without sequence parallelism, two gradient-accumulation
  microbatches, full activation checkpointing, ``debug.moe_force_load_balance``: every expert's
  logged count is the global step's tokens x top-k / experts (counted once: not again over the
  TP ranks, which route the same tokens and each dispatch only their slice);
- ``fsdp2_tp2_ep4`` (``default``): EP 4 over ``dp_shard x tp`` (two experts a rank, no ``efsdp``);
- ``ep2_tp2_compile`` (``default``): the blocks compiled (``aot_eager``, not ``fullgraph`` under
  EP: the experts' FSDP hooks break the graph); Dynamo compiled graphs;
- ``fsdp2_cp2_ep2`` (``full_dtensor``, ``spmd_types`` type-checked): CP 2 x EP 2 (``ep`` over the
  ``cp`` ranks), ring attention; ``cp2_tp2_ep4`` (``full_dtensor``): CP 2 x TP 2 x EP 4;
- ``fsdp2_tp2_ep4_typed`` (``spmd_types``, type-checked): EP 4 over ``dp_shard x tp``, the only EP
  degree on 4 ranks that borrows from both (the tokens ``V`` on ``dp_shard``, ``R`` on ``tp``: it
  failed with "Axes {mesh_dp_shard, mesh_tp} would need to be flattened" before the counts were
  re-typed onto the expert side's mesh).

Each fp32 case also compares every parameter's gradient norm at step 1, every layer's expert bias
after every step and the fewest and most tokens any expert got with the reference.

And PP 2 x FSDP 2 x EP 2 (1F1B) under each backend against the reference (4 steps).
"""

from __future__ import annotations

from typing import Any

import pytest
from moe_compose_helpers import Case, check_against_the_reference, check_counted_once, run_cases
from moe_helpers import moe_config
from parity_helpers import LOCAL_BATCH, NORM_TOL, TOL, max_rel, skip_full_dtensor_on_old_torch
from pipeline_feature_helpers import pp2, pp_config, run_cells

from torchtitan_spmd.config import JobConfig

BACKENDS = ("default", "full_dtensor", "spmd_types")


def _ep(backend: str, dp_shard: int, ep: int, *, tp: int = 1, cp: int = 1, **debug: Any) -> JobConfig:
    cfg = moe_config(backend, "fsdp4", **debug)
    par = cfg.parallelism
    par.data_parallel_shard_degree, par.tensor_parallel_degree, par.context_parallel_degree = dp_shard, tp, cp
    par.expert_parallel_degree = ep
    return cfg


def ep_cases(backend: str) -> list[Case]:
    """The EP x TP / CP / compile runs of ``backend`` on 4 ranks (see the module docstring)."""
    sp = _ep(backend, 2, 2, tp=2)
    sp.activation_checkpoint.mode = "selective"
    if backend == "spmd_types":
        sp.debug.spmd_typechecking, sp.activation_checkpoint.mode = True, "none"
    nosp = _ep(backend, 2, 2, tp=2, moe_force_load_balance=True)
    nosp.parallelism.enable_sequence_parallel = False
    nosp.training.global_batch_size = 4 * LOCAL_BATCH
    nosp.activation_checkpoint.mode = "full"
    cases = [Case("ep2_sp", sp, 2 * LOCAL_BATCH), Case("ep2_nosp_forced", nosp, 4 * LOCAL_BATCH)]
    if backend == "default":  # (context parallelism does not run under default)
        cases.append(Case("fsdp2_tp2_ep4", _ep(backend, 2, 4, tp=2), 2 * LOCAL_BATCH))
        compiled = _ep(backend, 2, 2, tp=2)
        compiled.compile.enable, compiled.compile.backend, compiled.compile.components = True, "aot_eager", ["model"]
        cases.append(Case("ep2_tp2_compile", compiled, 2 * LOCAL_BATCH))
    else:
        cp = _ep(backend, 2, 2, cp=2)
        if backend == "spmd_types":
            cp.debug.spmd_typechecking = True
        cases.append(Case("fsdp2_cp2_ep2", cp, 2 * LOCAL_BATCH))
    if backend == "full_dtensor":
        cases.append(Case("cp2_tp2_ep4", _ep(backend, 1, 4, tp=2, cp=2), LOCAL_BATCH))
    if backend == "spmd_types":  # the EP degree that borrows from both dp_shard and tp, type-checked
        cases.append(Case("fsdp2_tp2_ep4_typed", _ep(backend, 2, 4, tp=2, spmd_typechecking=True), 2 * LOCAL_BATCH))
    return cases


@pytest.mark.slow(reason="four or five EP compositions (EP x TP/SP, accumulation + full AC, EP 4, compile or CP) "
                         "trained 6 steps each in one set of forks, each against the reference: one launch, "
                         "not one per case")
@pytest.mark.parametrize("backend", BACKENDS)
def test_ep_composed_matches_the_reference(backend: str) -> None:
    skip_full_dtensor_on_old_torch(backend, "fsdp4")
    if backend == "spmd_types":
        from torchtitan_spmd.distributed.representation import torch_at_least

        if not torch_at_least("2.14"):
            pytest.skip("spmd_types with FSDP needs torch >= 2.14")
    cases = ep_cases(backend)
    got = run_cases(cases, 4)
    check_against_the_reference(backend, cases, got)
    check_counted_once(cases, got)
    for case in cases:  # Dynamo compiled graphs in exactly the compiled runs
        assert (sum(g[3] for g in got[case.name]) > 0) == case.config.compile.enable, case.name


def _pp_ep(backend: str, local_batch: int = 2, **parallelism: Any) -> JobConfig:
    cfg = pp_config(parallelism, local_batch=local_batch, model="qwen3", flavor="moe_tiny")
    cfg.parallelism.spmd_backend = backend
    return cfg


def test_ep_with_pp_matches_the_reference() -> None:
    """PP 2 x FSDP 2 x EP 2 (1F1B; ``ep`` over the ``dp_shard`` pair of each stage, every stage's
    experts exchanged within it) under each backend, one launch: the reference's losses and
    gradient norms (4 steps, global batch 4), and every backend logging the same expert load."""
    from torchtitan_spmd.reference import run_reference

    cells = {b: _pp_ep(b, **pp2("1F1B", expert_parallel_degree=2)) for b in BACKENDS}
    got = run_cells(cells, 4)
    ref = tuple(run_reference(_pp_ep("default", local_batch=4, data_parallel_shard_degree=1), global_batch=4))
    for backend, cell in got.items():
        loss, norm = [r[0] for r in cell.records], [r[1] for r in cell.records]
        loss_diff, norm_diff = max_rel(loss, [r[0] for r in ref]), max_rel(norm, [r[1] for r in ref])
        print(f"\nEP x PP {backend}: max rel diff loss {loss_diff:.1e} grad_norm {norm_diff:.1e}")
        assert loss_diff < TOL, (backend, loss, ref)
        assert norm_diff < NORM_TOL, (backend, norm, ref)
        assert all(r[2] is not None for r in cell.records)
    assert len({tuple(r[2] for r in cell.records) for cell in got.values()}) == 1
