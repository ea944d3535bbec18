"""Layer 4: checkpoints under spmd_types -- its rows of the cross matrix, and the seed
checkpoint through the parity command.

The base checkpoint is the issue's (default FSDP 2 x TP 2, step 4 of 8; see
``tests/layer3_runtime/test_checkpoint.py``). Under spmd_types without FSDP every state
is a plain local shard: it reaches DCP through the representation's DTensor view, for
the model and for the optimizer's moments alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from spmd_helpers import requires_torch, warm_parent  # first: it puts layer 3's helpers on the path

# isort: split
from checkpoint_helpers import (
    INTERVAL,
    LAYOUTS,
    TOL,
    ck_config,
    load_full,
    max_rel_loss,
    resume_folder,
    run,
    save_base,
)

from torchtitan_spmd import parity

pytestmark = [pytest.mark.backend("spmd_types"), pytest.mark.multiproc]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("ckpt-base")
    return root, save_base(root)


@pytest.mark.parametrize("layout", [
    pytest.param("fsdp2_tp2", marks=requires_torch("2.14", "FSDP over spmd_types-annotated parameters")),
    "tp2",
])
def test_resume_default_checkpoint_under_spmd_types(base, tmp_path: Path, layout: str) -> None:
    import torch
    root, uninterrupted = base
    world, _ = LAYOUTS[layout]
    got = run(ck_config("spmd_types", layout, resume_folder(root, tmp_path), last_save_model_only=False), world)
    assert got["start_step"] == INTERVAL
    assert max_rel_loss(got["records"], uninterrupted["records"][INTERVAL:]) < TOL
    # what spmd_types saved at step 8 (its local shards, as global tensors) is the base run's step 8
    mine = load_full(tmp_path / "checkpoint" / "step-8")
    theirs = load_full(root / "checkpoint" / "step-8")
    model_keys = [k for k in theirs if isinstance(theirs[k], torch.Tensor)]
    assert len(model_keys) > 10
    for key in model_keys:
        torch.testing.assert_close(mine[key], theirs[key], rtol=1e-4, atol=1e-5, msg=key)
    moments = [k for k in theirs["optimizer"] if k.startswith("state.") and k.endswith(".exp_avg")]
    assert len(moments) == len(model_keys)
    for key in moments:
        torch.testing.assert_close(mine["optimizer"][key], theirs["optimizer"][key], rtol=1e-3, atol=1e-6, msg=key)
    assert mine["dataloader"] == theirs["dataloader"] and mine["train_state"] == theirs["train_state"]


def _loss_one_process(rank: int, world: int, argv: list[str]) -> float:
    from torchtitan_spmd.config import ConfigManager
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(ConfigManager().parse_args(argv))
    try:
        return trainer.run()[0].loss
    finally:
        trainer.close()


def test_parity_starts_every_backend_from_one_seed_checkpoint(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from torchtitan_spmd.launcher import run_forked

    warm_parent()
    job = ["--module", "llama3", "--config", "llama3_tiny", "--training.steps", "2", "--training.device", "cpu",
           "--debug.deterministic"]
    seed_dir = tmp_path / "seed"
    seed_argv = [*job, "--job.dump_folder", str(seed_dir), "--debug.seed", "7", "--checkpoint.enable",
                 "--checkpoint.create_seed_checkpoint"]
    run_forked(lambda rank, world: _run_seed(seed_argv), 1)
    seed = seed_dir / "checkpoint" / "step-0"
    use_seed = ["--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.initial_load_path", str(seed)]
    run_args = [*job, "--job.dump_folder", str(tmp_path / "runs"), "--debug.seed", "0"]

    assert parity.main([*run_args, "--checkpoint.enable", "--no-plot"]) == 2
    assert "--checkpoint.load_only" in capsys.readouterr().err

    assert parity.main([*run_args, *use_seed, "--parallelism.tensor_parallel_degree", "2", "--no-plot",
                        "--tol", "1e-5"]) == 0
    out = capsys.readouterr().out
    first = [float(x) for x in next(line.split() for line in out.splitlines() if line.split()[:1] == ["1"])[1:4]]
    with_seed = run_forked(_loss_one_process, 1, [*run_args, *use_seed])[0]
    without = run_forked(_loss_one_process, 1, run_args)[0]
    assert all(abs(x - with_seed) <= 1e-5 * with_seed for x in first), (first, with_seed)
    assert abs(with_seed - without) > 1e-3  # the seed's weights (debug.seed 7), not this run's own


def _run_seed(argv: list[str]) -> None:
    from torchtitan_spmd.config import ConfigManager
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(ConfigManager().parse_args(argv))
    try:
        assert trainer.run() == []
    finally:
        trainer.close()
