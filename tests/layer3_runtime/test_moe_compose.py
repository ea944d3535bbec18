"""Layer 3: the MoE flavour (``moe_tiny``) composed with tensor and context parallelism, under every backend.

Real forked gloo ranks (4: FSDP 2 x TP 2; CP 2 x TP 2), fp32, 6 steps, against the independent reference
(float64: the MoE restated densely, no shared code), loss within 1e-5 and gradient norm within
1e-4 at every step. The experts are tensor-parallel as upstream's with ``ep = 1`` (``w1``/``w3``
column-wise, ``w2`` row-wise, the block's partial output reduced once), the router's gate
replicated. The runs of one backend share one set of forked ranks:

- sequence parallel with selective activation checkpointing (``spmd_types``: type-checked);
- sequence parallel off, two gradient-accumulation microbatches, full activation checkpointing and
  ``debug.moe_force_load_balance``: every expert gets exactly the global step's tokens x top-k /
  experts, counted once although every TP rank routes the same tokens;
- (``full_dtensor``, ``spmd_types``: the backends that run context parallelism) CP 2 x TP 2: each
  rank routes the tokens of its sequence shard, the counts summed over ``cp``.
"""

from __future__ import annotations

import pytest
from moe_compose_helpers import reference_of, run_cases, tp_cases
from parity_helpers import NORM_TOL, SEQ_LEN, TOL, max_rel, skip_full_dtensor_on_old_torch
from version_helpers import torch_at_least

from torchtitan_spmd.models.qwen3 import FLAVORS

pytestmark = pytest.mark.multiproc

BACKENDS = ("default", "full_dtensor", "spmd_types")


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def tp_runs(backend: str) -> tuple[list, dict]:
    skip_full_dtensor_on_old_torch(backend, "fsdp2_tp2")
    if backend == "spmd_types" and not torch_at_least("2.14"):
        pytest.skip("spmd_types with FSDP needs torch >= 2.14")
    cases = tp_cases(backend)
    return cases, run_cases(cases, 4)


def test_moe_with_tp_and_cp_matches_the_reference(backend: str, tp_runs: tuple[list, dict]) -> None:
    cases, got = tp_runs
    for case in cases:
        ref = reference_of(case)
        loss, norm = [g[0] for g in got[case.name]], [g[1] for g in got[case.name]]
        loss_diff, norm_diff = max_rel(loss, [r[0] for r in ref]), max_rel(norm, [r[1] for r in ref])
        print(f"\nmoe x tp {backend} {case.name}: max rel diff loss {loss_diff:.1e} grad_norm {norm_diff:.1e}")
        assert loss_diff < TOL, (case.name, loss, ref)
        assert norm_diff < NORM_TOL, (case.name, norm, ref)
        assert loss[-1] < loss[0] - 0.1


def test_tokens_per_expert_are_counted_once_under_tp(backend: str, tp_runs: tuple[list, dict]) -> None:
    cases, got = tp_runs
    (case,) = [c for c in cases if c.config.debug.moe_force_load_balance]
    tiny = FLAVORS["moe_tiny"]
    each = case.global_batch * SEQ_LEN * tiny.top_k // tiny.num_experts
    assert [g[2] for g in got[case.name]] == [(each, each)] * len(got[case.name])
