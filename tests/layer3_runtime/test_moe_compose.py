"""Layer 3: the MoE flavour (``moe_tiny``) composed with tensor and context parallelism, ``default`` and ``full_dtensor``.

Real forked gloo ranks (4: FSDP 2 x TP 2; CP 2 x TP 2), fp32, 6 steps, against the independent reference
(float64: the MoE restated densely, no shared code), loss within 1e-5 and gradient norm within
1e-4 at every step. The experts are tensor-parallel as upstream's with ``ep = 1`` (``w1``/``w3``
column-wise, ``w2`` row-wise, the block's partial output reduced once), the router's gate
replicated. The runs of one backend share one set of forked ranks (the ``spmd_types`` rows, the
first run type-checked: ``tests/layer4_spmd_types/test_moe_compose_spmd.py``):

- sequence parallel with selective activation checkpointing;
- sequence parallel off, two gradient-accumulation microbatches, full activation checkpointing and
  ``debug.moe_force_load_balance``: every expert gets exactly the global step's tokens x top-k /
  experts, counted once although every TP rank routes the same tokens;
- (``full_dtensor``: ``default`` does not run context parallelism) CP 2 x TP 2: each
  rank routes the tokens of its sequence shard, the counts summed over ``cp``;
- (``default``) bf16 mixed precision, 3 steps, within 2e-4;
- ``torch.compile`` of the blocks (``fullgraph``, ``aot_eager``; one process, ``default``) with
  selective and with full activation checkpointing (forced balance: the counts not doubled by the
  recompute).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from moe_compose_helpers import (
    check_against_the_reference,
    check_counted_once,
    compile_cases,
    run_cases,
    tp_cases,
)
from parity_helpers import skip_full_dtensor_on_old_torch

pytestmark = pytest.mark.multiproc

BACKENDS = ("default", "full_dtensor")


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def tp_runs(backend: str) -> tuple[list, dict]:
    skip_full_dtensor_on_old_torch(backend, "fsdp2_tp2")
    cases = tp_cases(backend)
    return cases, run_cases(cases, 4)


@pytest.mark.slow(reason="its set-up trains the MoE x TP (and CP, bf16) cases 6 steps each in one set of forks, "
                         "read by this test and the counts test after it")
def test_moe_with_tp_and_cp_matches_the_reference(backend: str, tp_runs: tuple[list, dict]) -> None:
    check_against_the_reference(backend, *tp_runs)


def test_tokens_per_expert_are_counted_once_under_tp(tp_runs: tuple[list, dict]) -> None:
    check_counted_once(*tp_runs)


@pytest.mark.backend("default")
def test_moe_compiled_matches_the_reference() -> None:
    cases = compile_cases()
    got = run_cases(cases, 1)
    check_against_the_reference("default", cases, got)
    check_counted_once(cases, got)
    for case in cases:  # Dynamo compiled the blocks (fullgraph: one graph for the two blocks, more on recompiles)
        assert got[case.name][-1][3] >= 1, case.name


@pytest.mark.backend("default")
def test_expert_width_not_divisible_by_tp_is_a_setup_error(fake_pg: Callable[[int], None],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from moe_helpers import moe_config

    from torchtitan_spmd.models import qwen3
    from torchtitan_spmd.train import Trainer

    monkeypatch.setitem(qwen3.FLAVORS, "moe_tiny", dataclasses.replace(qwen3.FLAVORS["moe_tiny"], moe_hidden_dim=63))
    cfg = moe_config("default", "fsdp4")
    cfg.parallelism.data_parallel_shard_degree, cfg.parallelism.tensor_parallel_degree = 2, 2
    fake_pg(4)
    with pytest.raises(ValueError, match=r"model moe_hidden_dim=63 is not divisible by parallelism.tensor_parallel_degree=2"):
        Trainer(cfg)
