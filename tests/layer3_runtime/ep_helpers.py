"""Helpers for the expert-parallelism tests: ``moe_tiny`` on 4 real forked gloo ranks.

One fork per trainer: a second ``full_dtensor`` trainer in the same ranks meets DTensor's
sharding cache of the first one's equal meshes (``fully_shard``: "different mesh objects").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moe_helpers import moe_config
from parity_helpers import warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

WORLD = 4
#: name -> expert_parallel_degree on FSDP 4
EP_LAYOUTS: dict[str, int] = {"fsdp4_ep4": 4, "fsdp4_ep2": 2}


def ep_config(backend: str, ep: int, **debug: Any) -> JobConfig:
    """The MoE parity config (``moe_tiny``, FSDP 4, 6 steps, fp32, deterministic) with ``ep``."""
    cfg = moe_config(backend, "fsdp4", **debug)
    cfg.parallelism.expert_parallel_degree = ep
    return cfg


def checkpointed(cfg: JobConfig, folder: Path, interval: int = 2) -> JobConfig:
    """``cfg`` saving every ``interval`` steps into ``folder/checkpoint`` (and loading the newest there)."""
    cfg.job.dump_folder = str(folder)
    cfg.checkpoint.enable = True
    cfg.checkpoint.interval = interval
    return cfg


def _expert_shards(trainer: Any) -> list[tuple[str, list[int], list[int], list[str]]]:
    """Per expert weight of this rank: (fqn, local shape, global shape, mesh dims it is sharded over)."""
    from torch.distributed.tensor import DTensor

    from torchtitan_spmd.techniques.expert_parallel import expert_modules

    out = []
    for fqn, experts in expert_modules(trainer.model):
        for name in ("w1", "w2", "w3"):
            p = getattr(experts, name)
            assert isinstance(p, DTensor), type(p)
            names = p.device_mesh.mesh_dim_names or ()
            sharded = [names[i] for i, pl in enumerate(p.placements) if not pl.is_replicate()]
            out.append((f"{fqn}.{name}", list(p.to_local().shape), list(p.shape), sharded))
    return out


def _train(rank: int, world: int, cfg: JobConfig) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    try:
        shards = _expert_shards(trainer)
        records = trainer.run()
        return {"steps": [(r.step, r.loss, r.grad_norm) for r in records], "shards": shards,
                "start_step": trainer.start_step}
    finally:
        trainer.close()


def run_many(cfgs: list[JobConfig]) -> list[list[dict[str, Any]]]:
    """Run each config's trainer on 4 forked ranks; per config, every rank's
    ``{"steps": [(step, loss, grad_norm)], "shards": ..., "start_step": ..., "trace": ...}`` (the
    :mod:`grad_probe` trace pooled over the ranks)."""
    import grad_probe

    warm_parent()
    out = []
    for cfg in cfgs:
        probed = run_forked(grad_probe.probed(_train), WORLD, cfg, timeout_s=300)
        (trace,) = grad_probe.merge([t for _, t in probed])
        grad_probe.check_schedules([cfg], [trace])
        out.append([{**r, "trace": trace} for r, _ in probed])
    return out


def records(result: dict[str, Any]) -> Any:
    """A rank's ``(loss, grad_norm)`` per step as a :class:`parity_helpers.Run` with the run's trace
    (:mod:`grad_probe`: per-parameter gradient norms, expert biases) for ``check_moe_parity``."""
    from parity_helpers import Run

    run = Run([(s[1], s[2]) for s in result["steps"]])
    run.trace = result["trace"]
    return run
