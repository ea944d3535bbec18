"""MoE benchmarks: the cost of ``qwen3_moe_debug`` and the load balancing of ``qwen3_moe_tiny``.

    python bench/moe_bench.py cost --worlds 1,4 --steps 4       # step time, peak RSS per rank
    python bench/moe_bench.py balance --steps 50                # tokens/expert max/min over steps

``cost``: the ``qwen3_moe_debug`` job (upstream's ``debugmodel_moe``: 8 layers, 64 experts, top-8;
local batch 4 x 256, fp32, selective AC) on 1 process and on FSDP N (forked gloo ranks, the
``default`` backend): the median step time after the first step (slowest rank per step) and the
peak resident set (``VmHWM``, reset after the fork) of the largest rank.

``balance``: ``qwen3_moe_tiny`` on one process, with upstream's ``load_balance_coeff=1e-3``, a
larger one, and without load balancing (``load_balance_coeff=None``): the fewest and the most
tokens of any expert (both blocks pooled; 64 tokens x top-2 = 128 a block, 16 when even) at
chosen steps.
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
from feature_bench import _read_kib  # noqa: E402  (this folder: the peak RSS reader)

import torchtitan_spmd.train  # noqa: E402,F401
from torchtitan_spmd.launcher import run_forked  # noqa: E402
from torchtitan_spmd.models import qwen3  # noqa: E402
from torchtitan_spmd.models.qwen3 import config_registry  # noqa: E402


def _cost_worker(rank: int, world: int, steps: int) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    with open("/proc/self/clear_refs", "w") as f:  # peak RSS from here on, not the parent's
        f.write("5")
    cfg = config_registry.qwen3_moe_debug()
    cfg.parallelism.data_parallel_shard_degree = world
    cfg.training.device = "cpu"
    cfg.debug.seed = 0
    trainer = Trainer(cfg)
    times, loads = [], []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        record = trainer.step(step)
        times.append(time.perf_counter() - start)
        loads.append(record.expert_load)
    return {"times": times, "peak_mib": _read_kib("VmHWM") / 1024, "loss": record.loss, "loads": loads}


def _balance_worker(rank: int, world: int, steps: int, coeff: float | None) -> list[tuple[int, int]]:
    from torchtitan_spmd.train import Trainer

    qwen3.FLAVORS["moe_tiny"] = dataclasses.replace(qwen3.FLAVORS["moe_tiny"], load_balance_coeff=coeff)
    cfg = config_registry.qwen3_moe_tiny()
    cfg.training.steps = steps
    cfg.training.device = "cpu"
    cfg.debug.seed = 0
    cfg.activation_checkpoint.mode = "none"
    trainer = Trainer(cfg)
    return [(r.expert_load.min, r.expert_load.max) for r in trainer.run()]  # type: ignore[union-attr]


def cost(args: argparse.Namespace) -> None:
    print("| ranks | layout | step time (median, s) | first step (s) | peak RSS, largest rank (MiB) | loss after |")
    print("|---|---|---|---|---|---|")
    for world in (int(w) for w in args.worlds.split(",")):
        per_rank = run_forked(_cost_worker, world, args.steps, timeout_s=3600)
        slowest = [max(r["times"][i] for r in per_rank) for i in range(args.steps)]
        layout = "one process" if world == 1 else f"FSDP {world}"
        print(f"| {world} | {layout} | {statistics.median(slowest[1:]):.2f} | {slowest[0]:.2f} | "
              f"{max(r['peak_mib'] for r in per_rank):.0f} | {per_rank[0]['loss']:.4f} |", flush=True)


def balance(args: argparse.Namespace) -> None:
    marks = [s for s in (1, 5, 10, 20, 30, 40, 50) if s <= args.steps]
    print("| tokens/expert, min-max | " + " | ".join(f"step {s}" for s in marks) + " |")
    print("|---|" + "---|" * len(marks))
    for coeff in (None if c == "none" else float(c) for c in args.coeffs.split(",")):
        loads = run_forked(_balance_worker, 1, args.steps, coeff, timeout_s=3600)[0]
        ratios = [f"{lo}-{hi}" for lo, hi in (loads[s - 1] for s in marks)]
        name = f"load_balance_coeff={coeff:g}" if coeff else "none (load_balance_coeff=None)"
        print(f"| {name} | " + " | ".join(ratios) + " |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--worlds", default="1,4")
    c.add_argument("--steps", type=int, default=4)
    b = sub.add_parser("balance")
    b.add_argument("--steps", type=int, default=50)
    b.add_argument("--coeffs", default="1e-3,1e-2,none", help="load_balance_coeff values ('none': off)")
    args = parser.parse_args(argv)
    (cost if args.what == "cost" else balance)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
