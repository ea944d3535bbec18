"""The trainer on a JSON lines dataset with a Hugging Face tokenizer, on forked gloo ranks.

20 steps of ``debugmodel`` (its vocabulary sized to the tokenizer: 2048) on FSDP 2 read
the fixture's JSON lines (``tests/assets/c4_test/data.json``) through ``datasets``,
tokenised by torchtitan's test tokenizer; the loss falls, and rank 0's TensorBoard events
hold every step's loss, grad norm and lr. The checkpoint of step 10, resumed under TP 2
(one data-parallel rank reading the whole global batch), continues on the same curve.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from hf_data_helpers import ASSETS, NEEDS_HF, hf_cache, read_scalars  # noqa: F401 (a fixture)
from parity_helpers import warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

pytestmark = [pytest.mark.multiproc, pytest.mark.backend("default"), pytest.mark.usefixtures("hf_cache"), NEEDS_HF]

STEPS, RESUME_AT, GLOBAL_BATCH, SEQ_LEN = 20, 10, 4, 64
TOL = 1e-5

#: name -> (world size, parallelism); each reads GLOBAL_BATCH sequences a step.
LAYOUTS: dict[str, tuple[int, dict[str, int]]] = {
    "fsdp2": (2, {"data_parallel_shard_degree": 2}),
    "tp2": (2, {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2}),
}


def config(layout: str, dump_folder: Path) -> JobConfig:
    world, par = LAYOUTS[layout]
    dp = world // par.get("tensor_parallel_degree", 1)
    return JobConfig.from_dict({
        "job": {"dump_folder": str(dump_folder)},
        "hf_assets_path": str(ASSETS / "tokenizer"),
        "model": {"name": "llama3", "flavor": "debugmodel"},
        "training": {"steps": STEPS, "local_batch_size": GLOBAL_BATCH // dp, "seq_len": SEQ_LEN, "device": "cpu",
                     "mixed_precision_param": "float32"},
        "dataloader": {"dataset": "json", "dataset_path": str(ASSETS / "c4_test" / "data.json")},
        "activation_checkpoint": {"mode": "none"},
        "optimizer": {"lr": 8e-4},
        "lr_scheduler": {"warmup_steps": 2},
        "parallelism": par,
        "checkpoint": {"enable": True, "interval": RESUME_AT, "last_save_model_only": True},
        "metrics": {"enable_tensorboard": True},
        "debug": {"seed": 7, "deterministic": True},
    })


def _train(rank: int, world: int, cfg: JobConfig) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    try:
        records = trainer.run()
        return {"start_step": trainer.start_step, "vocab": trainer.model_config.vocab_size,
                "records": [(r.step, r.loss, r.grad_norm, r.lr) for r in records]}
    finally:
        trainer.close()


def run(layout: str, dump_folder: Path) -> dict[str, Any]:
    warm_parent()
    import datasets  # noqa: F401  (imported once, before forking)
    import torch.distributed.checkpoint  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401

    world, _ = LAYOUTS[layout]
    per_rank = run_forked(_train, world, config(layout, dump_folder), timeout_s=300)
    assert all(r["records"] == per_rank[0]["records"] for r in per_rank), per_rank
    return per_rank[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> tuple[Path, dict[str, Any]]:
    request.getfixturevalue("hf_cache")  # before the forked ranks start
    root = tmp_path_factory.mktemp("hf-base")
    return root, run("fsdp2", root)


def test_a_jsonl_dataset_trains_with_the_loss_falling(base: tuple[Path, dict[str, Any]]) -> None:
    _, result = base
    assert result["vocab"] == 2048  # the tokenizer's 2020 ids, padded
    losses = [loss for _, loss, _, _ in result["records"]]
    assert [s for s, *_ in result["records"]] == list(range(1, STEPS + 1))
    assert abs(losses[0] - 7.62) < 0.1  # about ln(2048): an untrained model on this vocabulary
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses


def test_tensorboard_holds_every_step(base: tuple[Path, dict[str, Any]]) -> None:
    root, result = base
    scalars = read_scalars(root / "tb")
    for tag, column in (("loss_metrics/global_avg_loss", 1), ("grad_norm", 2), ("lr", 3)):
        got = scalars[tag]
        assert [s for s, _ in got] == list(range(1, STEPS + 1)), tag
        for (_, value), record in zip(got, result["records"], strict=True):
            assert abs(value - record[column]) <= 1e-6 * abs(record[column]), (tag, value, record)
    assert {"throughput(tps)", "memory/max_active(GiB)"} <= set(scalars)
    assert all(v > 0 for _, v in scalars["throughput(tps)"] + scalars["memory/max_active(GiB)"])


def test_a_resume_under_another_layout_continues_on_the_same_curve(base: tuple[Path, dict[str, Any]],
                                                                    tmp_path: Path) -> None:
    root, uninterrupted = base
    step = f"step-{RESUME_AT}"
    shutil.copytree(root / "checkpoint" / step, tmp_path / "checkpoint" / step)
    resumed = run("tp2", tmp_path)
    assert resumed["start_step"] == RESUME_AT
    want = uninterrupted["records"][RESUME_AT:]
    assert [s for s, *_ in resumed["records"]] == [s for s, *_ in want]
    for got, ref in zip(resumed["records"], want, strict=True):
        assert abs(got[1] - ref[1]) <= TOL * abs(ref[1]), (got, ref)
        assert abs(got[2] - ref[2]) <= 1e-4 * abs(ref[2]), (got, ref)


def test_the_tiny_model_on_fsdp2_matches_the_independent_reference_on_this_data() -> None:
    """Each rank's rows of the packed JSON lines, trained on FSDP 2, give the float64
    single-process reference's losses (which reads the whole global batch in one process)."""
    from parity_helpers import NORM_TOL, job_config, max_rel, run_config

    from torchtitan_spmd.reference import run_reference

    data = job_config("default", LAYOUTS["fsdp2"][1], local_batch=GLOBAL_BATCH // 2, steps=6).to_dict()
    data["hf_assets_path"] = str(ASSETS / "tokenizer")
    data["training"]["seq_len"] = SEQ_LEN
    for tokens in ("max_context_length", "num_tokens_per_microbatch_per_dp_rank", "num_tokens_per_train_step"):
        data["training"].pop(tokens, None)  # August's spellings of the batch fields follow seq_len
    data["dataloader"] = {"dataset": "c4_test", "dataset_path": str(ASSETS / "c4_test")}
    cfg = JobConfig.from_dict(data)
    got = run_config(cfg, 2)
    want = run_reference(cfg, global_batch=GLOBAL_BATCH)
    assert max_rel([loss for loss, _ in got], [loss for loss, _ in want]) < TOL, (got, want)
    assert max_rel([norm for _, norm in got], [norm for _, norm in want]) < NORM_TOL, (got, want)
