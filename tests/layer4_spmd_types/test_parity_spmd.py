"""Layer 4 parity: the spmd_types backend matches the independent reference, step by step.

Same harness, configs, model, reference and tolerances as layer 3 (``tests/layer3_runtime``):
real gloo ranks (forked), fp32, deterministic, 10 steps of the tiny Llama. Each
run type-checks its first full train step (forward, loss, backward, clipping,
optimizer step) under ``debug.spmd_typechecking`` and runs the other nine
unchecked, so every config proves the checker passes at the price of one slow step.
Layer 3 proves ``default`` and ``full_dtensor`` match the same reference to the
same tolerances, so the three backends agree with each other;
``test_parity_cli.py`` also compares them directly.
"""

from __future__ import annotations

import pytest
from spmd_helpers import (  # first: it puts layer 3's helpers on the path
    PARITY_CONFIGS,
    data_parallel_degree,
    job_config,
    run_mixed,
    torch_at_least,
)

# isort: split
from parity_helpers import check_parity

pytestmark = [pytest.mark.multiproc, pytest.mark.backend("spmd_types")]

TYPED_STEPS = 1


@pytest.mark.parametrize("config_name", sorted(PARITY_CONFIGS))
def test_spmd_types_parity_with_the_reference(config_name: str) -> None:
    world, parallelism = PARITY_CONFIGS[config_name]
    dp = data_parallel_degree(parallelism, world)
    if dp > 1 and not torch_at_least("2.14"):
        pytest.skip("FSDP over spmd_types-annotated tensors needs torch >= 2.14")
    cfg = job_config("spmd_types", parallelism, spmd_typechecking=True)
    got = run_mixed(cfg, world, typed_steps=TYPED_STEPS)
    assert [g[3] for g in got] == [True] * TYPED_STEPS + [False] * (len(got) - TYPED_STEPS)
    loss_diff, norm_diff = check_parity(got, config_name)
    # Per-step seconds (rank 0) for the record: the first (type-checked) step, then steady state.
    steady = sorted(g[2] for g in got[TYPED_STEPS + 1 :])
    print(f"\n{config_name}: typed step {got[0][2]:.2f}s, median untyped step {steady[len(steady) // 2]:.3f}s, "
          f"max rel diff loss {loss_diff:.1e} grad_norm {norm_diff:.1e}")
