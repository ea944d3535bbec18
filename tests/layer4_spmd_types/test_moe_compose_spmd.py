"""Layer 4: the MoE flavour (``moe_tiny``) with tensor and context parallelism under ``spmd_types``.

The runs and checks of ``tests/layer3_runtime/test_moe_compose.py`` (FSDP 2 x TP 2 with sequence
parallel and selective AC, type-checked at every step; without sequence parallel, with gradient
accumulation, full AC and forced balance; CP 2 x TP 2), in one set of forked ranks, against the
float64 reference. Under the checker the block's partial output must be reduced (``P@tp`` where the
residual stream is declared): a plan that drops the reduction is an ``SpmdTypeError``.
"""

from __future__ import annotations

import pytest
from spmd_helpers import torch_at_least  # first: puts tests/layer3_runtime on sys.path

# isort: split
from moe_compose_helpers import check_against_the_reference, check_counted_once, run_cases, tp_cases  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.backend("spmd_types")]


@pytest.fixture(scope="module")
def tp_runs() -> tuple[list, dict]:
    if not torch_at_least("2.14"):
        pytest.skip("FSDP over spmd_types-annotated tensors needs torch >= 2.14")
    cases = tp_cases("spmd_types")
    return cases, run_cases(cases, 4)


def test_moe_with_tp_and_cp_matches_the_reference(tp_runs: tuple[list, dict]) -> None:
    check_against_the_reference("spmd_types", *tp_runs)


def test_tokens_per_expert_are_counted_once_under_tp(tp_runs: tuple[list, dict]) -> None:
    check_counted_once(*tp_runs)
