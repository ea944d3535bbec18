"""The validator under pipeline and context parallelism, on real forked gloo ranks.

Each test runs ``validator.steps`` validation batches through the library's validator (under
PP: torch's schedule forward only, the loss on the last stage; under CP: each rank's slice of
every sequence at its global positions, ring attention) and compares the loss with the
float64 reference (:mod:`torchtitan_spmd.reference`, which shares no code with the runtime)
run in this process on the same global validation batches: the token-weighted mean, every
non-ignored label of every batch counted once (:mod:`validation_helpers`).
"""

from __future__ import annotations

from typing import Any

import pytest
from validation_helpers import check, job, validate_on_rank

from torchtitan_spmd.launcher import run_forked


@pytest.mark.multiproc
@pytest.mark.backend("default")
def test_validation_under_pp_runs_the_schedule_forward_only_token_weighted(tmp_path: Any) -> None:
    """pp 2, Interleaved1F1B (two stages a rank: both stage views in eval mode), 2 microbatches
    with different label counts: the loss on the last stage, agreed over pp, is the reference's."""
    cfg = job(str(tmp_path), {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "Interleaved1F1B",
                              "pipeline_parallel_microbatch_size": 1})
    check(run_forked(validate_on_rank, 2, cfg, timeout_s=300), cfg)


@pytest.mark.multiproc
@pytest.mark.backend("full_dtensor")
def test_validation_under_cp_runs_in_the_training_steps_cp_layout(tmp_path: Any) -> None:
    """cp 2 (headtail: rank 0 holds chunks 0 and 3 of every sequence), full_dtensor: the ring
    attention at the global positions, the masked labels split unevenly over cp."""
    cfg = job(str(tmp_path), {"context_parallel_degree": 2, "spmd_backend": "full_dtensor"})
    check(run_forked(validate_on_rank, 2, cfg, timeout_s=300), cfg)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_a_v_shaped_schedule_with_the_validator_is_a_setup_error(tmp_path: Any, schedule: str) -> None:
    """torch 2.14.1's schedule.eval of a V-shaped schedule runs its backward actions and fails
    mid-run (measured): named at setup instead, before any process group or model."""
    from torchtitan_spmd.train import validate_job

    cfg = job(str(tmp_path), {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": schedule})
    with pytest.raises(ValueError, match=rf"validator.enable=True with parallelism.pipeline_parallel_schedule="
                                         rf"'{schedule}'.*V-shaped"):
        validate_job(cfg, 2, "cpu")
