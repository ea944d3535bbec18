"""Layer 4: pipeline parallelism under ``spmd_types``, and type checking per stage.

- Parity with the independent float64 reference (no pipeline code in it) within 1e-5: PP 2 x FSDP 2
  1F1B, PP 2 x TP 2 GPipe, PP 2 x FSDP 2 Interleaved1F1B (two stages a rank), PP 2 x CP 2 1F1B,
  PP 2 x FSDP 2 ZBVZeroBubble (split backwards: input, then weight gradients) and PP 2 x TP 2
  Interleaved1F1B (four stages); all but the first with ``debug.spmd_typechecking``:
  each stage's forward and the loss type-checked on their own, a stage's inputs typed from the
  plan's ``stage_boundary`` (the checker decided ops inside the stages' own contexts:
  ``checked_in_stages > 0``; the trainer checks its token count outside the schedule too, so a
  count over the whole step would not tell).
- A plan that drops the rowwise reduction of ``layers.1.feed_forward.w2`` (stage 2 of 4, a middle
  stage): without the checker a silently wrong loss, with it an ``SpmdTypeError`` naming the module.
- An undeclared stage boundary (``stage_boundary=None``) is a setup error (see also layer 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from spmd_helpers import max_rel, requires_torch  # puts tests/layer3_runtime on sys.path

# isort: split
from pp_backend_helpers import (
    MISSING_REDUCE_MODULE,
    MISSING_REDUCE_TYPED,
    PARITY_CELLS,
    Cell,
    assert_matches_reference,
    check_pp_checkpoint_round_trip,
    planted_spec,
    pp_reference,
    run_cell,
    train_cell,
)

from torchtitan_spmd.launcher import WorkerError

pytestmark = [pytest.mark.backend("spmd_types"), requires_torch("2.14", "spmd_types with FSDP")]

TOL, NORM_TOL = 1e-5, 1e-4
SPMD_CELLS = {k: v for k, v in PARITY_CELLS.items() if v.backend == "spmd_types" and v.plant is None}


def _train_counting_checked_ops(rank: int, world: int, cell: Cell) -> dict[str, Any]:
    """:func:`train_cell`, how many ops went through the type checker (its decision cache:
    checked, or replayed; 0: nothing was checked), and how many of them inside the stages'
    own contexts (``StageBoundaries.context``: a stage's forward or the loss; the trainer's
    checked token count outside the schedule does not count there)."""
    from unittest import mock

    from torchtitan_spmd.distributed.representations.spmd_types.typecheck import DECISION_CACHE
    from torchtitan_spmd.techniques.pipeline_parallel import StageBoundaries

    def ops() -> int:
        return DECISION_CACHE.misses + DECISION_CACHE.unkeyed + DECISION_CACHE.hits

    from torchtitan_spmd.techniques.pipeline_parallel import _StepLoss

    in_stages, loss_calls, in_loss = [0], [0], [0]
    original, original_loss = StageBoundaries.context, _StepLoss.__call__

    @contextlib.contextmanager
    def counted(self: StageBoundaries) -> Iterator[None]:
        before = ops()
        with original(self):
            yield
        in_stages[0] += ops() - before

    def loss(self: _StepLoss, output: Any, target: Any) -> Any:
        before = ops()
        try:
            return original_loss(self, output, target)
        finally:
            loss_calls[0] += 1
            in_loss[0] += ops() - before

    DECISION_CACHE.clear()
    with mock.patch.object(StageBoundaries, "context", counted), mock.patch.object(_StepLoss, "__call__", loss):
        result = train_cell(cell)
    return {**result, "checked_ops": ops(), "checked_in_stages": in_stages[0], "loss_calls": loss_calls[0],
            "checked_in_loss": in_loss[0]}


def assert_every_rank_checked(result: dict[str, Any]) -> None:
    """Every rank's stages ran under the checker (each rank holds other stages: the last one and its
    loss included), and every rank that computed the loss checked it."""
    ranks = result["ranks"]
    # the loss runs in the stages' context too: the stages' forwards alone are the difference
    forwards = [r["checked_in_stages"] - r["checked_in_loss"] for r in ranks]
    assert all(f > 0 for f in forwards), f"ops checked in each rank's stage forwards: {forwards}"
    assert any(r["loss_calls"] for r in ranks), "no rank computed the loss"
    assert all(r["checked_in_loss"] > 0 for r in ranks if r["loss_calls"]), \
        [(r["loss_calls"], r["checked_in_loss"]) for r in ranks]


@pytest.mark.multiproc
@pytest.mark.parametrize("cell", list(SPMD_CELLS))
def test_spmd_types_pipeline_matches_the_reference(cell: str) -> None:
    result = run_cell(SPMD_CELLS[cell], train=_train_counting_checked_ops)
    if SPMD_CELLS[cell].typecheck:  # every stage (the last one and the loss too) ran under the checker
        assert_every_rank_checked(result)
    assert_matches_reference(result["records"], pp_reference(SPMD_CELLS[cell].global_batch), result["trace"],
                             what=cell)


@pytest.mark.multiproc
def test_a_missing_collective_in_a_middle_stage_is_a_wrong_loss_without_the_checker() -> None:
    cell = PARITY_CELLS["spmd_types-missing_reduce_in_stage2-unchecked"]
    got, ref = run_cell(cell)["records"], pp_reference(cell.global_batch)
    assert max_rel([g[0] for g in got], [r[0] for r in ref]) > 10 * TOL, (got, ref)  # measured: 8.8e-4


@pytest.mark.multiproc
def test_a_missing_collective_in_a_middle_stage_is_a_type_error_naming_the_module() -> None:
    with pytest.raises(WorkerError) as err:
        run_cell(MISSING_REDUCE_TYPED)
    message = str(err.value)
    assert "SpmdTypeError" in message, message[-3000:]
    assert f"{MISSING_REDUCE_MODULE} output" in message, message[-3000:]


@pytest.mark.multiproc
def test_spmd_typechecking_steps_turns_the_stages_checker_off() -> None:
    # The first of 4 steps checked: exactly the ops of a 1-step checked run (the stages' forwards
    # and losses of steps 2-4 unchecked).
    cell = SPMD_CELLS["spmd_types-pp2_tp2_gpipe-typed"]
    first_only = run_cell(dataclasses.replace(cell, typecheck_steps=1), train=_train_counting_checked_ops)
    one_step = run_cell(dataclasses.replace(cell, steps=1), train=_train_counting_checked_ops)
    assert len(first_only["records"]) == 4 and len(one_step["records"]) == 1
    assert first_only["checked_ops"] == one_step["checked_ops"] > 0, (first_only, one_step)
    assert first_only["checked_in_stages"] == one_step["checked_in_stages"] > 0, (first_only, one_step)


def test_an_undeclared_stage_boundary_is_a_setup_error(fake_world: Callable[..., None]) -> None:
    import torchtitan_spmd.train as train_module

    fake_world(4)
    cell = Cell("spmd_types", {"tensor_parallel_degree": 2, "pipeline_parallel_schedule": "GPipe"},
                typecheck=True)
    with mock.patch.object(train_module, "get_model_spec", lambda name: planted_spec(name, "no_stage_boundary")):
        with pytest.raises(ValueError, match="declares no stage_boundary.*ShardingPlan.stage_boundary"):
            train_module.Trainer(cell.config())


@pytest.mark.multiproc
def test_a_spmd_types_pp_checkpoint_has_the_model_keys_and_resumes_without_pp(tmp_path: Path) -> None:
    check_pp_checkpoint_round_trip("spmd_types", tmp_path)
