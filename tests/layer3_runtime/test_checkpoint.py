"""Layer 3: checkpointing (torch DCP) -- exact resume, resharding, crash safety, async, errors.

Every run is the real Trainer on forked gloo ranks (the tiny model, fp32, deterministic).
The base run saves under default FSDP 2 x TP 2 at step 4 of 8; resumed runs must print
the same losses for steps 5-8 (identically in the same layout, within 1e-5 in another
layout or backend). The spmd_types rows of the matrix are in
``tests/layer4_spmd_types/test_checkpoint_spmd.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from checkpoint_helpers import (
    INTERVAL,
    LAYOUTS,
    STEPS,
    TOL,
    ck_config,
    load_full,
    max_rel_loss,
    resume_folder,
    run,
    save_base,
)
from parity_helpers import skip_full_dtensor_on_old_torch

from torchtitan_spmd.checkpoint.manager import COMPLETE_MARKER, find_checkpoints, purge_stale
from torchtitan_spmd.launcher import WorkerError

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("ckpt-base")
    return root, save_base(root)


# ------------------------------------------------------------------ resume and resharding
@pytest.mark.backend("default")
def test_resume_in_the_same_layout_prints_the_same_losses(base, tmp_path: Path) -> None:
    root, uninterrupted = base
    saved = json.loads((root / "checkpoint" / "step-4" / COMPLETE_MARKER).read_text())
    assert saved["step"] == 4 and not saved["model_only"] and saved["spmd_backend"] == "default"
    got = run(ck_config("default", "fsdp2_tp2", resume_folder(root, tmp_path)), 4)
    assert got["start_step"] == INTERVAL and got["loaded"]["step"] == INTERVAL
    assert got["records"] == uninterrupted["records"][INTERVAL:]  # bit-identical floats
    assert got["log_lines"] == uninterrupted["log_lines"][INTERVAL:]  # so the printed lines too
    # the RNG state the base run had when it saved, not the freshly seeded one
    assert got["rng_after_load"] == uninterrupted["rng_before_run"]
    assert got["rng_after_load"] != uninterrupted["rng_after_load"]


#: (backend, layout) resumed from the base checkpoint; the spmd_types ones are layer 4's.
CROSS = [("default", "single"), ("default", "fsdp2"), ("full_dtensor", "fsdp2_tp2"), ("full_dtensor", "tp2")]


@pytest.mark.backend("default")  # the saving backend: one base run per session
@pytest.mark.parametrize(("resume_backend", "layout"), CROSS, ids=[f"{b}-{lay}" for b, lay in CROSS])
def test_resume_under_another_backend_or_layout(base, tmp_path: Path, resume_backend: str, layout: str) -> None:
    skip_full_dtensor_on_old_torch(resume_backend, "fsdp2_tp2" if layout == "fsdp2_tp2" else "tp2_sp")
    root, uninterrupted = base
    world, _ = LAYOUTS[layout]
    got = run(ck_config(resume_backend, layout, resume_folder(root, tmp_path)), world)
    assert got["start_step"] == INTERVAL
    assert max_rel_loss(got["records"], uninterrupted["records"][INTERVAL:]) < TOL


# ------------------------------------------------------------------ crash safety
def _two_rank(tmp_path: Path, **checkpoint: Any) -> Any:
    return ck_config("default", "fsdp2", tmp_path, interval=2, **checkpoint)


@pytest.fixture(scope="module")
def two_rank_sync(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The uninterrupted 2-rank run every crash and async test compares with (saves 2, 4, 6, 8)."""
    root = tmp_path_factory.mktemp("ckpt-sync")
    return root, run(_two_rank(root, keep_latest_k=0), 2)


@pytest.mark.backend("default")
@pytest.mark.parametrize("kill", [(1, "write", 4), (0, "publish", 4)], ids=["rank1-writing-shards", "rank0-before-rename"])
def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(two_rank_sync, tmp_path: Path, kill) -> None:
    """A rank SIGKILLs itself during the step-4 save; the next start loads step 2 and trains on
    to the uninterrupted run's losses, and the unfinished save is ignored, then cleaned up."""
    _, uninterrupted = two_rank_sync
    with pytest.raises(WorkerError, match=f"rank {kill[0]}: exited without a result"):
        run(_two_rank(tmp_path, keep_latest_k=2), 2, kill=kill)
    folder = tmp_path / "checkpoint"
    complete, incomplete = find_checkpoints(str(folder))
    assert sorted(complete) == [2]
    assert [os.path.basename(p) for p in incomplete] == ["step-4.partial"]
    if kill[1] == "publish":  # DCP had finished: only the marker and the rename were missing
        assert (folder / "step-4.partial" / ".metadata").is_file()
    resumed = run(_two_rank(tmp_path, keep_latest_k=2), 2)
    assert resumed["loaded"]["step"] == 2 and resumed["loaded"]["ignored"] == [str(folder / "step-4.partial")]
    assert resumed["records"] == uninterrupted["records"][2:]
    assert sorted(os.listdir(folder)) == ["step-6", "step-8"]  # keep_latest_k=2; the partial is gone


@pytest.mark.backend("default")
def test_async_save_writes_the_same_files_and_numbers_as_sync(two_rank_sync, tmp_path: Path) -> None:
    sync_root, sync = two_rank_sync
    got = run(_two_rank(tmp_path, keep_latest_k=0, async_mode="async"), 2)
    assert got["records"] == sync["records"]
    for step in (2, 4, 6, 8):
        a, b = sync_root / "checkpoint" / f"step-{step}", tmp_path / "checkpoint" / f"step-{step}"
        assert sorted(os.listdir(a)) == sorted(os.listdir(b))
        sa, sb = (load_full(p) for p in (a, b))
        assert len(sa) > 0
        _assert_same(sa, sb, f"step-{step}")


def _assert_same(a: Any, b: Any, where: str) -> None:
    import torch

    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    else:
        assert a == b, where


def test_find_and_purge_never_touch_the_only_complete_checkpoint(tmp_path: Path) -> None:
    def make(name: str, *, metadata: bool = True, marker: bool = True) -> None:
        (tmp_path / name).mkdir()
        if metadata:
            (tmp_path / name / ".metadata").write_bytes(b"x")
        if marker:
            (tmp_path / name / COMPLETE_MARKER).write_text(json.dumps({"step": 0, "model_only": False}))

    make("step-2")
    make("step-4", marker=False)  # DCP finished, never published
    make("step-6", metadata=False)  # shards only
    make("step-8.partial", marker=False)
    make("notes", marker=False)
    complete, incomplete = find_checkpoints(str(tmp_path))
    assert sorted(complete) == [2]
    assert sorted(map(os.path.basename, incomplete)) == ["step-4", "step-6", "step-8.partial"]
    assert purge_stale(str(tmp_path), 2) == []  # the only complete one, and a newer partial, stay
    make("step-1.partial", marker=False)
    make("step-10")
    make("step-12")
    deleted = purge_stale(str(tmp_path), 2)
    assert sorted(map(os.path.basename, deleted)) == ["step-1.partial", "step-2", "step-8.partial"]
    assert sorted(find_checkpoints(str(tmp_path))[0]) == [10, 12]
    assert purge_stale(str(tmp_path), 0) == []


# ------------------------------------------------------------------ errors, seed, model-only
def _errors(rank: int, world: int, root: str, two_rank_root: str) -> dict[str, str]:
    """Each bad start's error message (one forked process: Trainer construction only)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_spmd.train import Trainer

    def message(cfg: Any) -> str:
        try:
            Trainer(cfg).close()
        except ValueError as err:
            return str(err)
        return "<no error>"

    empty = os.path.join(root, "empty")
    os.makedirs(os.path.join(empty, "not-a-checkpoint"))
    from_two = os.path.join(root, "from-two")
    os.makedirs(os.path.join(from_two, "checkpoint"))
    # a copy: a linked step folder is refused (no link in a checkpoint is followed: test_checkpoint_hostile.py)
    shutil.copytree(os.path.join(two_rank_root, "checkpoint", "step-4"), os.path.join(from_two, "checkpoint", "step-4"))
    trainer = Trainer(ck_config("default", "single", root, enable=False))
    weights = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    trainer.close()
    lacking, extra = os.path.join(root, "lacking"), os.path.join(root, "extra")
    dcp.save({k: v for k, v in weights.items() if k != "norm.weight"}, checkpoint_id=lacking)
    dcp.save({**weights, "layers.9.feed_forward.w1.weight": torch.zeros(2)}, checkpoint_id=extra)
    return {
        "lacking_key": message(ck_config("default", "single", os.path.join(root, "a"), initial_load_path=lacking)),
        "extra_key": message(ck_config("default", "single", os.path.join(root, "b"), initial_load_path=extra)),
        "not_a_checkpoint": message(ck_config("default", "single", empty, initial_load_path=os.path.join(empty, "not-a-checkpoint"))),
        "other_shape": message(ck_config("default", "single", from_two, flavor="debugmodel")),
        "missing_step": message(ck_config("default", "single", from_two, load_step=5)),
        "model_only_export": message(ck_config("default", "single", two_rank_root)),
        # another model size resuming into that folder: its shapes first, not the model-only refusal
        "other_size_model_only": message(ck_config("default", "single", two_rank_root, flavor="debugmodel")),
        "bad_exclude": message(ck_config("default", "single", from_two, exclude_from_loading=["optimzer"])),
        "loads_model_only_export_step": message(ck_config("default", "single", two_rank_root, load_step=6)),
    }


@pytest.mark.backend("default")
def test_load_errors_name_the_problem(two_rank_sync, tmp_path: Path) -> None:
    from torchtitan_spmd.launcher import run_forked

    two_root, _ = two_rank_sync
    msg = run_forked(_errors, 1, str(tmp_path), str(two_root), timeout_s=120)[0]
    assert "not-a-checkpoint' is not a checkpoint: it has no DCP .metadata file" in msg["not_a_checkpoint"]
    assert ("'tok_embeddings.weight' has shape (320, 64) there and (320, 256) in this model"
            in msg["other_shape"]), msg["other_shape"]
    # the model the marker recorded, and how to start afresh (issue 45)
    assert ("; its marker records the model 'llama3/tiny', this run's is 'llama3/debugmodel'; to start afresh, "
            f"give another --job.dump_folder or remove {tmp_path / 'from-two' / 'checkpoint'}") in msg["other_shape"], msg["other_shape"]
    other = msg["other_size_model_only"]
    assert other.startswith("checkpoint step-8: saved from another model: 'tok_embeddings.weight' has shape "
                            "(320, 64) there and (320, 256) in this model; its marker records the model "
                            "'llama3/tiny', this run's is 'llama3/debugmodel'; to start afresh"), other
    assert "saved from another model: it has no 'norm.weight' (it holds " in msg["lacking_key"]
    assert "; give checkpoint.initial_load_path a checkpoint of this model" in msg["lacking_key"]
    assert ("saved from another model: it holds 'layers.9.feed_forward.w1.weight', which this model lacks"
            in msg["extra_key"])
    assert "checkpoint.load_step=5: no complete checkpoint step-5" in msg["missing_step"]
    assert "complete ones: step-4." in msg["missing_step"]
    assert msg["model_only_export"].startswith("checkpoint step-8: holds only the model")
    assert "--checkpoint.load_step 6 (the newest full checkpoint)" in msg["model_only_export"]
    assert "exclude_from_loading: unknown ['optimzer']" in msg["bad_exclude"]
    assert msg["loads_model_only_export_step"] == "<no error>"


def _seed(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch

    from torchtitan_spmd.train import Trainer

    cfg = ck_config("default", "single", root, create_seed_checkpoint=True, export_dtype="bfloat16")
    trainer = Trainer(cfg)
    assert trainer.run() == []
    weights = {k: v.detach().to(torch.bfloat16) for k, v in trainer.model.state_dict().items()}
    trainer.close()
    saved = load_full(os.path.join(root, "checkpoint", "step-0"))
    same = sorted(saved) == sorted(weights) and all(
        saved[k].dtype == torch.bfloat16 and torch.equal(saved[k], weights[k]) for k in weights)
    return {"same": same, "files": sorted(os.listdir(os.path.join(root, "checkpoint", "step-0")))}


@pytest.mark.backend("default")
def test_seed_checkpoint_is_the_model_only_on_one_process(tmp_path: Path) -> None:
    from torchtitan_spmd.launcher import run_forked

    got = run_forked(_seed, 1, str(tmp_path), timeout_s=120)[0]
    assert got["same"] and ".metadata" in got["files"] and COMPLETE_MARKER in got["files"]
    marker = json.loads((tmp_path / "checkpoint" / "step-0" / COMPLETE_MARKER).read_text())
    assert marker["model_only"] and marker["step"] == 0 and marker["export_dtype"] == "bfloat16"
    # two processes may not write a seed
    with pytest.raises(WorkerError, match="create_seed_checkpoint needs one process"):
        run(ck_config("default", "fsdp2", tmp_path / "two", create_seed_checkpoint=True), 2)
    # a run starting from the seed loads the model only and starts at step 1
    started = run(ck_config("default", "fsdp2", tmp_path, steps=2, load_only=True), 2)
    assert started["loaded"]["model_only"] and started["start_step"] == 0
    assert [s for s, _, _ in started["records"]] == [1, 2]


def test_steps_do_not_change_the_data(tmp_path: Path) -> None:
    """Two runs with different training.steps read the same batches (the data depends only on
    the seed and the position)."""
    from torchtitan_spmd.launcher import run_forked

    def batches(rank: int, world: int, steps: int) -> list[list[int]]:
        from torchtitan_spmd.train import Trainer

        cfg = ck_config("default", "single", tmp_path, steps=steps, enable=False)
        trainer = Trainer(cfg)
        out = [next(trainer.dataloader)[0].flatten().tolist() for _ in range(3)]
        trainer.close()
        return out

    assert run_forked(batches, 1, 3)[0] == run_forked(batches, 1, STEPS * 100)[0]
