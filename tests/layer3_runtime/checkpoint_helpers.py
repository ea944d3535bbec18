"""Helpers for the checkpoint tests: the real Trainer on forked gloo ranks, checkpointing on.

The base run everything resumes from is the issue's: default backend, FSDP 2 x TP 2, the
tiny model, 8 steps, a checkpoint every 4 (fp32, deterministic). Other layouts keep its
global batch (4 samples), so their steps 5-8 see the same data.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

from parity_helpers import job_config, warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

STEPS = 8
INTERVAL = 4
GLOBAL_BATCH = 4
TOL = 1e-5

#: name -> (world size, parallelism); each keeps GLOBAL_BATCH samples a step.
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "fsdp2_tp2": (4, {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}),
    "fsdp2": (2, {"data_parallel_shard_degree": 2}),
    "tp2": (2, {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2}),
    "single": (1, {"data_parallel_shard_degree": 1}),
}


def local_batch(layout: str) -> int:
    world, par = LAYOUTS[layout]
    return GLOBAL_BATCH * par.get("tensor_parallel_degree", 1) // world


def ck_config(backend: str, layout: str, dump_folder: Path | str, *, steps: int = STEPS, model: str = "llama3",
              flavor: str = "tiny", **checkpoint: Any) -> JobConfig:
    """The parity harness's deterministic config, checkpointing into ``dump_folder/checkpoint``."""
    data = job_config(backend, LAYOUTS[layout][1], local_batch=local_batch(layout), steps=steps, model=model).to_dict()
    data["model"]["flavor"] = flavor
    data["job"]["dump_folder"] = str(dump_folder)
    data["checkpoint"].update({"enable": True, "interval": INTERVAL, **checkpoint})
    return JobConfig.from_dict(data)


def _arm_kill(rank: int, kill: tuple[int, str, int] | None) -> None:
    """Make this rank SIGKILL itself during the save of a step: ``(rank, where, step)``.

    ``where``: ``"write"`` -- right after its DCP shard file is written, before the
    collective that writes ``.metadata``; ``"publish"`` -- after DCP finished (so the
    ``.partial`` folder holds a complete DCP checkpoint), before the marker and the rename.
    """
    if kill is None or kill[0] != rank:
        return
    _, where, step = kill
    if where == "write":
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        original = FileSystemWriter.write_data

        def write_data(self: Any, plan: Any, planner: Any) -> Any:
            future = original(self, plan, planner)
            if os.path.basename(str(self.path)) in (f"step-{step}", f"step-{step}.partial"):
                future.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            return future

        FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    elif where == "publish":
        import torchtitan_spmd.checkpoint.manager as ck

        publish = ck._publish

        def killing_publish(partial: str, final: str, record: Any) -> None:
            if final.endswith(f"step-{step}"):
                os.kill(os.getpid(), signal.SIGKILL)
            publish(partial, final, record)

        ck._publish = killing_publish
    else:
        raise ValueError(where)


def _train(rank: int, world: int, cfg: JobConfig, kill: tuple[int, str, int] | None, train: bool,
           advance_rng: bool) -> dict[str, Any]:
    import torch

    from torchtitan_spmd.train import Trainer

    _arm_kill(rank, kill)
    trainer = Trainer(cfg)
    try:
        rng_after_load = torch.get_rng_state().tolist()
        if advance_rng:  # something drew random numbers: the checkpoint must carry the state on
            torch.rand(7)
        rng_before_run = torch.get_rng_state().tolist()
        records = trainer.run() if train else []
        return {
            "start_step": trainer.start_step,
            "records": [(r.step, r.loss, r.grad_norm) for r in records],
            "log_lines": [r.log_line().split("  tps:")[0] for r in records],
            "loaded": trainer.checkpointer.loaded,
            "rng_after_load": rng_after_load,
            "rng_before_run": rng_before_run,
        }
    finally:
        trainer.close()


def run(cfg: JobConfig, world: int, *, kill: tuple[int, str, int] | None = None, train: bool = True,
        advance_rng: bool = False) -> dict[str, Any]:
    """Rank 0's result of one run; every rank must report the same steps."""
    warm_parent()
    import torch.distributed.checkpoint  # noqa: F401  (import once, before forking)

    per_rank = run_forked(_train, world, cfg, kill, train, advance_rng, timeout_s=300)
    for rank, result in enumerate(per_rank):
        if result["records"] != per_rank[0]["records"]:
            raise AssertionError(f"rank {rank}: {result['records']}, rank 0: {per_rank[0]['records']}")
    return per_rank[0]


def save_base(root: Path) -> dict[str, Any]:
    """The uninterrupted base run (default, FSDP 2 x TP 2, 8 steps) into ``root``; its result."""
    world, _ = LAYOUTS["fsdp2_tp2"]
    result = run(ck_config("default", "fsdp2_tp2", root, last_save_model_only=False), world, advance_rng=True)
    assert [s for s, _, _ in result["records"]] == list(range(1, STEPS + 1))
    return result


def resume_folder(base_root: Path, dst: Path, step: int = INTERVAL) -> Path:
    """A fresh dump folder holding only the base run's ``step-<step>`` checkpoint."""
    shutil.copytree(base_root / "checkpoint" / f"step-{step}", dst / "checkpoint" / f"step-{step}")
    return dst


def load_full(path: Path | str) -> dict[str, Any]:
    """Everything a DCP checkpoint holds, as full tensors, in this (non-distributed) process."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is unavailable or uninitialized")
        return _load_state_dict_from_keys(checkpoint_id=str(path))


def max_rel_loss(got: list[tuple[int, float, float]], want: list[tuple[int, float, float]]) -> float:
    """Largest relative loss difference, after checking the step numbers agree."""
    assert [s for s, _, _ in got] == [s for s, _, _ in want], (got, want)
    return max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(got, want, strict=True))
