"""Step time of experts sharded on dim 1 against dim 0 (issue 41), on 4 forked gloo ranks.

    PYTHONPATH=. python bench/expert_dim1_bench.py [--experts 2] [--ep 1] [--steps 6] [--rounds 2]

``qwen3_moe_debug`` (upstream's ``debugmodel_moe``: 64 experts of width 768, top-8) with its expert
count replaced by ``--experts`` (top-k capped at it) and 2 layers, FSDP 4 with
``--ep`` (``efsdp = 4 / ep``), local batch 2 x 256, fp32, no AC, the ``default`` backend. With 2
experts over 4 shard ranks the library shards the experts on dim 1; the dim-0 runs force FSDP2's
default (``expert_shard_dims`` answering 0: each rank padded to a whole expert). The two
placements run interleaved, ``--rounds`` times each; per run the median step after the first
(slowest rank per step) and rank 0's parameter elements.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch._inductor  # noqa: E402,F401  (imported once in the parent, not per rank)

import torchtitan_spmd.train  # noqa: E402,F401
from torchtitan_spmd.launcher import run_forked  # noqa: E402
from torchtitan_spmd.models import qwen3  # noqa: E402
from torchtitan_spmd.models.qwen3 import config_registry  # noqa: E402

WORLD = 4


def _run(rank: int, world: int, cfg: Any, dim0: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    import torchtitan_spmd.techniques.fsdp as fsdp
    from torchtitan_spmd.train import Trainer

    if dim0:  # this forked rank only: FSDP2's default placement for every expert
        original = fsdp.expert_shard_dims
        fsdp.expert_shard_dims = lambda *a, **k: dict.fromkeys(original(*a, **k), 0)  # type: ignore[assignment]
    trainer = Trainer(cfg)
    numel = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainer.model.parameters())
    times = []
    for step in range(1, cfg.training.steps + 1):
        start = time.perf_counter()
        trainer.step(step)
        times.append(time.perf_counter() - start)
    trainer.close()
    return {"times": times, "numel": numel}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=2)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    base = qwen3.FLAVORS["debugmodel_moe"]
    qwen3.FLAVORS["bench_dim1"] = dataclasses.replace(base, n_layers=2, num_experts=args.experts,
                                                      top_k=min(base.top_k, args.experts))
    cfg = config_registry.qwen3_moe_debug()
    cfg.model.flavor = "bench_dim1"
    cfg.training.steps, cfg.training.local_batch_size, cfg.training.seq_len = args.steps, 2, 256
    cfg.training.mixed_precision_param = "float32"
    cfg.activation_checkpoint.mode = "none"
    cfg.parallelism.data_parallel_shard_degree, cfg.parallelism.expert_parallel_degree = WORLD, args.ep
    cfg.validate()
    results: dict[str, list[float]] = {"dim 1": [], "dim 0": []}
    numel: dict[str, int] = {}
    for _ in range(args.rounds):
        for name in results:
            per_rank = run_forked(_run, WORLD, cfg, name == "dim 0", timeout_s=900)
            slowest = [max(r["times"][i] for r in per_rank) for i in range(1, args.steps)]
            results[name].append(statistics.median(slowest))
            numel[name] = per_rank[0]["numel"]
    for name, medians in results.items():
        print(f"{name}: median step {statistics.median(medians):.3f} s (runs {[round(m, 3) for m in medians]}), "
              f"rank 0 holds {numel[name]:,} parameter elements")


if __name__ == "__main__":
    main()
