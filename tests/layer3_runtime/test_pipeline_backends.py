"""Layer 3: pipeline parallelism under ``full_dtensor`` on real gloo ranks, against the independent reference.

Each stage is a model part parallelized by the same plan; torch's pipelining sends and receives
plain local tensors, and a stage takes what it receives back into a DTensor with the layout the
plan declares for the stage boundary (``ShardingPlan.stage_boundary``). The reference
(``torchtitan_spmd/reference.py``, float64) has no pipeline code. Cells: PP 2 x FSDP 2 1F1B, PP 2 x TP 2 GPipe,
PP 2 x FSDP 2 Interleaved1F1B, PP 2 x CP 2 1F1B, and two that split each backward in two (input, then
weight gradients: torch's ``stage_backward_input`` detaches each stage output in place, which a
DTensor's ``to_local`` view refused before the boundary copied it): PP 2 x FSDP 2 ZBVZeroBubble, and
the looped zero-bubble CSV (``I``/``W`` actions). The ``spmd_types`` cells and type checking per
stage are in ``tests/layer4_spmd_types/test_pipeline_spmd.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pp_backend_helpers as pp
import pytest

FULL_DTENSOR_CELLS = {k: v for k, v in pp.PARITY_CELLS.items() if v.backend == "full_dtensor"}


@pytest.mark.multiproc
@pytest.mark.backend("full_dtensor")
@pytest.mark.parametrize("cell", list(FULL_DTENSOR_CELLS))
def test_full_dtensor_pipeline_matches_the_reference(cell: str) -> None:
    from torchtitan_spmd.distributed.representations import full_dtensor as fd

    if fd.DataParallelMeshDims is None:
        pytest.skip(f"full_dtensor with data parallelism needs torch >= {fd.FSDP_MIN_TORCH}")
    result = pp.run_cell(FULL_DTENSOR_CELLS[cell])
    pp.assert_matches_reference(result["records"], pp.pp_reference(FULL_DTENSOR_CELLS[cell].global_batch),
                                result["trace"], what=cell)


@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
@pytest.mark.parametrize(("plant", "needles"), [
    ("no_stage_boundary", ["declares no stage_boundary", "ShardingPlan.stage_boundary"]),
    ("wrong_stage_boundary", ["stage_boundary", "is not the layout tok_embeddings outputs"]),
])
def test_a_plan_without_the_stage_boundary_is_a_setup_error(fake_pg: Callable[[int], None], backend: str,
                                                             plant: str, needles: list[str]) -> None:
    import torchtitan_spmd.train as train_module

    fake_pg(4)
    cell = pp.Cell(backend, {"tensor_parallel_degree": 2, "pipeline_parallel_schedule": "GPipe"})
    with mock.patch.object(train_module, "get_model_spec", lambda name: pp.planted_spec(name, plant)):
        with pytest.raises(ValueError) as err:
            train_module.Trainer(cell.config())
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


@pytest.mark.multiproc
@pytest.mark.backend("full_dtensor")
def test_a_full_dtensor_pp_checkpoint_has_the_model_keys_and_resumes_without_pp(tmp_path: Path) -> None:
    pp.check_pp_checkpoint_round_trip("full_dtensor", tmp_path)
