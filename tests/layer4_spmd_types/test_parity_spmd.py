"""Layer 4 parity: the spmd_types backend matches a single-process run, step by step.

Same harness, configs, model and tolerance as layer 3 (``tests/layer3_runtime``):
real gloo ranks (forked), fp32, deterministic, 10 steps of the tiny Llama. Each
run type-checks its first full train step (forward, loss, backward, clipping,
optimizer step) under ``debug.spmd_typechecking`` and runs the other nine
unchecked, so every config proves the checker passes at the price of one slow step.
Layer 3 proves ``default`` and ``full_dtensor`` match the same single-process
reference to the same tolerance, so the three backends agree with each other;
``test_parity_cli.py`` also compares them directly.
"""

from __future__ import annotations

import pytest
from spmd_helpers import (
    LOCAL_BATCH,
    PARITY_CONFIGS,
    data_parallel_degree,
    job_config,
    max_rel,
    reference,
    run_mixed,
    torch_at_least,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.backend("spmd_types")]

TOL = 1e-5
TYPED_STEPS = 1


@pytest.mark.parametrize("config_name", sorted(PARITY_CONFIGS))
def test_spmd_types_parity_with_single_process(config_name: str) -> None:
    world, parallelism = PARITY_CONFIGS[config_name]
    dp = data_parallel_degree(parallelism, world)
    if dp > 1 and not torch_at_least("2.14"):
        pytest.skip("FSDP over spmd_types-annotated tensors needs torch >= 2.14")
    ref = reference(LOCAL_BATCH * dp)
    cfg = job_config("spmd_types", parallelism, spmd_typechecking=True)
    got = run_mixed(cfg, world, typed_steps=TYPED_STEPS)
    assert [g[3] for g in got] == [True] * TYPED_STEPS + [False] * (len(got) - TYPED_STEPS)
    loss, norm = [g[0] for g in got], [g[1] for g in got]
    ref_loss, ref_norm = [r[0] for r in ref], [r[1] for r in ref]
    assert max_rel(loss, ref_loss) < TOL, (loss, ref_loss)
    assert max_rel(norm, ref_norm) < TOL, (norm, ref_norm)
    # The run must actually train (guards against a frozen or no-op model).
    assert loss[-1] < loss[0] - 0.1
    # Per-step seconds (rank 0) for the record: the first (type-checked) step, then steady state.
    steady = sorted(g[2] for g in got[TYPED_STEPS + 1 :])
    print(f"\n{config_name}: typed step {got[0][2]:.2f}s, median untyped step {steady[len(steady) // 2]:.3f}s, "
          f"max rel diff loss {max_rel(loss, ref_loss):.1e} grad_norm {max_rel(norm, ref_norm):.1e}")
