"""Cross-group traffic of torchft replica groups: synchronous against DiLoCo (issue 43).

2 replica groups x 2 ranks (FSDP 2 inside each), the llama3 debug model (``llama3_debugmodel``:
6.07M parameters, local batch 4 x 256), ``--steps`` steps, the Lighthouse on loopback. For each
mode it prints the bytes each rank handed to torchft's cross-group all-reduce per step (the
payload: gradient shards and the loss, or DiLoCo's pseudo-gradients every ``sync_steps``), the
mean step time and the losses.

    PYTHONPATH=. python bench/ft_bench.py --steps 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("RUST_LOG", "warn")

from torchtitan_spmd.models.llama3.config_registry import llama3_debugmodel  # noqa: E402
from torchtitan_spmd.tools.ft_launch import ForkedGroup, start_lighthouse  # noqa: E402


def _train(rank: int, world: int, cfg: Any) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    times: list[float] = []
    inner = trainer.step

    def step(n: int) -> Any:
        t0 = time.perf_counter()
        record = inner(n)
        times.append(time.perf_counter() - t0)
        return record

    trainer.step = step  # type: ignore[method-assign]
    try:
        records = trainer.run()
        return {"losses": [r.loss for r in records], "times": times, "bytes": trainer.ft.allreduce_bytes,
                "steps": len(records)}
    finally:
        trainer.close()


def _config(replica_id: int, steps: int, **ft: Any) -> Any:
    cfg = llama3_debugmodel()
    cfg.training.steps = steps
    cfg.parallelism.data_parallel_shard_degree = 2
    cfg.job.dump_folder = f"/tmp/ft_bench/group{replica_id}"
    cfg.fault_tolerance.enable = True
    cfg.fault_tolerance.group_size = 2
    cfg.fault_tolerance.replica_id = replica_id
    for key, value in ft.items():
        setattr(cfg.fault_tolerance, key, value)
    cfg.validate()
    return cfg


def run(steps: int, **ft: Any) -> list[dict[str, Any]]:
    lighthouse = start_lighthouse(2)
    try:
        groups = [ForkedGroup(_train, 2, _config(i, steps, **ft), lighthouse=lighthouse.address(), timeout_s=1800)
                  for i in range(2)]
        return [g.result() for g in groups]
    finally:
        lighthouse.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    import torchtitan_spmd.train  # noqa: F401  - imported once, inherited by the forked ranks

    for name, ft in (("synchronous", {}), ("DiLoCo sync_steps 5", {"semi_sync_method": "diloco", "sync_steps": 5})):
        out = run(args.steps, **ft)
        rank0 = out[0][0]
        per_rank = [r["bytes"] / r["steps"] for g in out for r in g]
        print(f"{name}: {statistics.mean(per_rank) / 1e6:.2f} MB per rank per step handed to the cross-group "
              f"all-reduce ({sum(r['bytes'] for g in out for r in g) / args.steps / 1e6:.2f} MB over the 4 ranks); "
              f"step {statistics.mean(rank0['times'][1:]):.2f} s (mean after the first); "
              f"losses group 0 {[round(x, 4) for x in rank0['losses']]}", flush=True)


if __name__ == "__main__":
    main()
