"""Layer 3: pipeline parallelism's features beyond the schedules, under ``default``, against the
independent reference (``torchtitan_spmd/reference.py``: no pipeline code, float64).

Real gloo ranks (PP 2 x FSDP 2, 4 forked processes), every 4-rank case in one launch
(``pipeline_feature_helpers.run_cells``), the tiny models, 4 steps:

- CSV schedules (``pipeline_parallel_schedule_csv``, torch's ``_PipelineScheduleRuntime``):
  the shipped ``tests/assets/pp_schedules`` files, one stage a rank with full backwards and two
  stages a rank with split (input / weight) backwards, and with gradient accumulation, match the
  reference; a CSV that is not a schedule of the run is a setup error naming the field, the file
  and what is wrong;
- the seed checkpoint (``checkpoint.create_seed_checkpoint``, one process, no parallelism, as
  upstream) loads under PP 2 (one stage a rank, and two a rank): the reference started from the
  same checkpoint (its own DCP read) gives the same losses, different from the run's own seed's;
  writing a seed under PP is the one-process error;
- ``compile.enable`` per stage part (``aot_eager``): Dynamo captures each rank's blocks and the
  last stage's loss; the losses are the reference's and, two stages a rank, eager's within 1e-4;
- MoE (qwen3 ``moe_tiny``, no EP) under PP 2 x FSDP 2, one stage a rank, two, and a stage
  holding no MoE block: the reference's losses, and the logged tokens per expert (every stage's
  blocks pooled) those of FSDP 4 without PP on the same global batch, on every rank;
- the 4-D cell on 8 ranks: PP 2 x FSDP 2 x TP 2 (+ SP), 1F1B, on the reference (its own launch).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from parity_helpers import NORM_TOL, TOL, max_rel, reference
from pipeline_feature_helpers import SCHEDULES, STEPS, Cell, pp2, pp_config, run_cells

from torchtitan_spmd.config import JobConfig

pytestmark = pytest.mark.multiproc

#: name -> the 4-rank config; all in one launch (the ``cells`` fixture)
CELLS: dict[str, Callable[[Path], JobConfig]] = {
    # upstream's abstract names size the stages: one a rank; two a rank, loop placement
    "csv_single": lambda _: pp_config(pp2("PipelineScheduleSingle",
                                          pipeline_parallel_schedule_csv=str(SCHEDULES / "pp2_1f1b.csv"))),
    "csv_looped_zero_bubble": lambda _: pp_config(pp2(
        "PipelineScheduleMulti", pipeline_parallel_schedule_csv=str(SCHEDULES / "pp2_looped_zero_bubble.csv"))),
    # two gradient-accumulation steps (global 8 = 2 rows x 2 data-parallel ranks x 2): two schedule runs a step
    "csv_single_accumulation": lambda _: pp_config(pp2(
        "1F1B", pipeline_parallel_schedule_csv=str(SCHEDULES / "pp2_1f1b.csv")), global_batch=8),
    "seed_1f1b": lambda root: _from_seed(root, "1F1B"),
    # compile.backend aot_eager: Dynamo's and AOT autograd's graphs without inductor's C++ code
    # generation (minutes a rank on 2 cores), as test_training_features.py
    "compile_1f1b": lambda _: _compiled("1F1B", ["model", "loss"]),
    "compile_interleaved1f1b": lambda _: _compiled("Interleaved1F1B", ["model"]),
    "eager_interleaved1f1b": lambda _: pp_config(pp2("Interleaved1F1B")),
    "moe_1f1b": lambda _: _moe(pp2("1F1B")),
    "moe_interleaved1f1b": lambda _: _moe(pp2("Interleaved1F1B")),
    # pp rank 1 holds no MoE block
    "moe_blockless_stage": lambda _: _moe(pp2("1F1B", module_fqns_per_model_part=[
        ["tok_embeddings", "layers.0", "layers.1"], ["norm", "output"]])),
    "moe_fsdp4": lambda _: _moe({"data_parallel_shard_degree": 4}, local_batch=1),
    "seed_interleaved1f1b": lambda root: _from_seed(root, "Interleaved1F1B"),
}

#: The seed checkpoint's own debug.seed (the runs use the harness's 1234): other weights.
SEED_SEED = 99


def _moe(parallelism: dict[str, Any], local_batch: int = 2) -> JobConfig:
    return pp_config(parallelism, local_batch=local_batch, model="qwen3", flavor="moe_tiny")


def _compiled(schedule: str, components: list[str]) -> JobConfig:
    cfg = pp_config(pp2(schedule))
    cfg.compile.enable, cfg.compile.backend, cfg.compile.components = True, "aot_eager", components
    return cfg


def _seed_path(root: Path) -> Path:
    return root / "seed" / "checkpoint" / "step-0"


def _from_seed(root: Path, schedule: str) -> JobConfig:
    cfg = pp_config(pp2(schedule))
    cfg.job.dump_folder = str(root / f"from-seed-{schedule}")
    cfg.checkpoint.enable, cfg.checkpoint.load_only = True, True
    cfg.checkpoint.initial_load_path = str(_seed_path(root))
    return cfg


def _write_seed(rank: int, world: int, root: str) -> None:
    from torchtitan_spmd.train import Trainer

    cfg = pp_config({"data_parallel_shard_degree": 1})
    cfg.debug.seed = SEED_SEED
    cfg.job.dump_folder = str(Path(root) / "seed")
    cfg.checkpoint.enable, cfg.checkpoint.create_seed_checkpoint = True, True
    trainer = Trainer(cfg)
    try:
        assert trainer.run() == []
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cells' folder (the seed checkpoint, the runs' dump folders)."""
    return tmp_path_factory.mktemp("pp-features")


@pytest.fixture(scope="module")
def cells(root: Path) -> dict[str, Cell]:
    """Every 4-rank case's per-step ``(loss, grad_norm, tokens/expert)``, one launch."""
    from torchtitan_spmd.launcher import run_forked

    run_forked(_write_seed, 1, str(root), timeout_s=120)  # upstream: a seed is written by one process
    return run_cells({name: build(root) for name, build in CELLS.items()}, 4)


def _check_reference(got: list[tuple[Any, ...]], ref: tuple[tuple[float, float], ...]) -> None:
    assert len(got) == len(ref) == STEPS
    assert max_rel([g[0] for g in got], [r[0] for r in ref]) < TOL, (got, ref)
    assert max_rel([g[1] for g in got], [r[1] for r in ref]) < NORM_TOL, (got, ref)
    assert got[-1][0] < got[0][0] - 0.1  # it trains


@pytest.mark.parametrize(("cell", "global_batch"), [("csv_single", 4), ("csv_looped_zero_bubble", 4),
                                                    ("csv_single_accumulation", 8)])
def test_a_csv_schedule_matches_the_reference(cells: dict[str, Cell], cell: str, global_batch: int) -> None:
    _check_reference(cells[cell].records, reference(global_batch, steps=STEPS))


@pytest.mark.parametrize(("cell", "eager"), [("compile_1f1b", "seed_1f1b"),
                                             ("compile_interleaved1f1b", "eager_interleaved1f1b")])
def test_compiled_stages_match_eager_and_the_reference(cells: dict[str, Cell], cell: str, eager: str) -> None:
    got = cells[cell]
    # tiny's stages on pp rank 0 / 1: [embedding, layers.0] / [layers.1, norm, output] (one a rank),
    # [embedding], [layers.1] / [layers.0], [norm, output] (two a rank): a block on every rank,
    # and the loss on the last stage's ranks (2, 3)
    loss_graphs = 1 if "loss" in CELLS_COMPONENTS[cell] else 0
    assert got.graphs == [1, 1, 1 + loss_graphs, 1 + loss_graphs], got.graphs
    assert all(n == 0 for n in cells[eager].graphs), cells[eager].graphs
    _check_reference(got.records, reference(4, steps=STEPS))
    if eager == "eager_interleaved1f1b":  # the same run eager (the seed cells start from other weights)
        assert max_rel([g[0] for g in got.records], [e[0] for e in cells[eager].records]) < COMPILE_TOL


#: What each compile cell compiles.
CELLS_COMPONENTS = {"compile_1f1b": ["model", "loss"], "compile_interleaved1f1b": ["model"]}
#: Compiled against eager (test_training_features.py's bound).
COMPILE_TOL = 1e-4


@pytest.mark.parametrize("cell", ["seed_1f1b", "seed_interleaved1f1b"])
def test_a_seed_checkpoint_written_without_pp_starts_a_pp_run(cells: dict[str, Cell],
                                                                root: Path, cell: str) -> None:
    from torchtitan_spmd.reference import run_reference

    cfg = CELLS[cell](root)
    ref = tuple(run_reference(cfg, global_batch=4))
    assert abs(ref[0][0] - reference(4, steps=STEPS)[0][0]) > 1e-3  # the seed's weights are not the run's own
    _check_reference(cells[cell].records, ref)


def test_a_seed_checkpoint_under_pp_is_the_one_process_error(fake_pg: Callable[[int], None], tmp_path: Path) -> None:
    from torchtitan_spmd.train import Trainer

    fake_pg(4)
    cfg = pp_config(pp2())
    cfg.job.dump_folder = str(tmp_path)
    cfg.checkpoint.enable, cfg.checkpoint.create_seed_checkpoint = True, True
    with closing(Trainer(cfg)) as trainer, pytest.raises(
            ValueError, match="create_seed_checkpoint needs one process.*this run has 4"):
        trainer.run()
    assert not (tmp_path / "checkpoint" / "step-0").exists()


@pytest.mark.parametrize("cell", ["moe_1f1b", "moe_interleaved1f1b", "moe_blockless_stage"])
def test_moe_under_pp_matches_the_reference_and_logs_every_stages_load(cells: dict[str, Cell], cell: str) -> None:
    from torchtitan_spmd.reference import run_reference

    ref = tuple(run_reference(_moe({"data_parallel_shard_degree": 1}, local_batch=4), global_batch=4))
    _check_reference(cells[cell].records, ref)
    without_pp = [r[2] for r in cells["moe_fsdp4"].records]
    assert all(load is not None for load in without_pp), without_pp
    assert [r[2] for r in cells[cell].records] == without_pp  # every rank logged it (run_cells)


def test_pp2_fsdp2_tp2_on_eight_ranks_matches_the_reference() -> None:
    got = run_cells({"pp2_fsdp2_tp2": pp_config(pp2("1F1B", tensor_parallel_degree=2))}, 8)["pp2_fsdp2_tp2"]
    _check_reference(got.records, reference(4, steps=STEPS))  # 2 data-parallel ranks x 2 rows


def _fake_cfg(csv: str, schedule: str = "1F1B", ac: str = "none") -> JobConfig:
    return JobConfig.from_dict({
        "model": {"flavor": "tiny"},
        "activation_checkpoint": {"mode": ac},
        "training": {"steps": 1, "local_batch_size": 2, "seq_len": 16, "device": "cpu"},
        "parallelism": {"data_parallel_shard_degree": 2, "pipeline_parallel_degree": 2,
                        "pipeline_parallel_schedule": schedule, "pipeline_parallel_schedule_csv": csv},
    })


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("0F0,0X1,0B0,0B1\n1F0,1B0,1F1,1B1\n", ["Invalid action string: 0X1"]),
        ("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n0F0\n", ["incorrect number of ranks - expected 2, actual 3"]),
        ("", ["incorrect number of ranks - expected 2, actual 0"]),
        ("0F0,0F1,0F2,0B0,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n", ["3", "microbatches for stage 0, expected 2"]),
        ("0F0,0F1,0B0,0B1\n2F0,2B0,2F1,2B1\n", ["stage 2 does not exist"]),
        ("0B0,0F0,0F1,0B1\n1F0,1B0,1F1,1B1\n", ["Full Backward for stage 0, microbatch 0 without first running "
                                                "Forward"]),
        # rank 0 waits for microbatch 0's gradient, rank 1 for microbatch 1's activations
        ("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", ["can't schedule sends/recvs"]),
        # the rows swapped: the file puts stage 0 on pp rank 1
        ("1F0,1B0,1F1,1B1\n0F0,0F1,0B0,0B1\n", ["places stage 0 on pp rank 1", "{0: 0, 1: 1}",
                                                "pipeline_parallel_schedule"]),
    ],
    ids=["action", "rows", "empty", "microbatches", "stage", "backward_first", "deadlock", "placement"],
)
def test_a_csv_that_is_not_a_schedule_of_the_run_is_a_setup_error(
        fake_pg: Callable[[int], None], tmp_path: Path, text: str, needles: list[str]) -> None:
    from torchtitan_spmd.train import Trainer

    csv = tmp_path / "schedule.csv"
    csv.write_text(text)
    fake_pg(4)
    with pytest.raises(ValueError) as err:
        Trainer(_fake_cfg(str(csv)))
    message = str(err.value)
    assert message.startswith(f"parallelism.pipeline_parallel_schedule_csv={str(csv)!r}: "), message
    for needle in needles:
        assert needle in message, (needle, message)
    assert "\n" not in message


def test_csv_setup_errors_of_the_fields(fake_pg: Callable[[int], None], tmp_path: Path) -> None:
    from torchtitan_spmd.train import Trainer

    fake_pg(4)
    with pytest.raises(ValueError, match=r"pipeline_parallel_schedule_csv='/no/such\.csv': no such file"):
        Trainer(_fake_cfg("/no/such.csv"))
    # split backwards (I, W) cannot run under selective activation checkpointing
    zero_bubble = str(SCHEDULES / "pp2_looped_zero_bubble.csv")
    with pytest.raises(ValueError, match="splits backwards in two.*activation_checkpoint.mode='selective'"):
        Trainer(_fake_cfg(zero_bubble, "PipelineScheduleMulti", ac="selective"))
    # the abstract classes only name the stage count with a CSV
    with pytest.raises(ValueError, match="'PipelineScheduleMulti': not a schedule.*'GPipe'"):
        Trainer(_fake_cfg("", "PipelineScheduleMulti"))
    with pytest.raises(ValueError, match="'Nope': unknown schedule.*'PipelineScheduleSingle'"):
        Trainer(_fake_cfg(zero_bubble, "Nope"))
    # a CSV for the loop placement of two stages a rank, with the stages of a single-stage schedule
    with pytest.raises(ValueError, match="stage 3 does not exist|stage 2 does not exist"):
        Trainer(_fake_cfg(zero_bubble, "1F1B"))
    # a concrete schedule name: its placement
    with closing(Trainer(_fake_cfg(zero_bubble, "interleaved1f1b", ac="full"))) as trainer:
        assert trainer.pipeline is not None and trainer.pipeline.stage_indices == [0, 2]
        assert type(trainer.pipeline.schedule).__name__ == "_PipelineScheduleRuntime"
