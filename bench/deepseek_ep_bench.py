"""DeepSeek-V3's expert-parallel cost: ``deepseek_v3_debugmodel`` at EP 1 / 2 / 4, and its tokens per
expert with and without the expert bias.

    python bench/deepseek_ep_bench.py --eps 1,2,4 --steps 3 --seq-len 64 --batch 2 --profile
    python bench/deepseek_ep_bench.py --eps "" --balance-steps 30

Part 1 (``--eps``): the ``deepseek_v3_debugmodel`` recipe (upstream's debug model: 6 layers, 1 dense,
MLA, 8 experts top-3 of width 256, 2 shared experts; fp32, the recipe's selective AC) on 4 forked
gloo ranks, FSDP 4 with ``expert_parallel_degree`` EP, ``--backend`` (``default``). The recipe's
4 x 256 tokens a rank take about half a minute a step on a loaded 2-core machine, so ``--seq-len``
and ``--batch`` shrink them; say so when quoting. Per EP: the median step time after the first
(slowest rank per step), the peak resident set of the largest rank (``VmHWM``, reset after the
fork), with ``--profile`` the all-to-all share of one more, profiled step (as ``bench/ep_bench.py``:
the self CPU time of the all-to-all and ``wait_tensor`` ops over the step's wall time, slowest
rank), and the last step's fewest / most tokens of any expert (all ranks, all MoE blocks).

Part 2 (``--balance-steps``): one process, the same recipe and shapes, ``load_balance_coeff`` 1e-3
(the flavour's, upstream's) against None (no bias): per chosen step the fewest / most tokens of any
expert (every MoE block pooled) and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch._inductor  # noqa: E402,F401  (imported once in the parent, not per rank)
from ep_bench import time_steps  # noqa: E402  (this folder: timed steps, peak RSS, all-to-all share)

import torchtitan_spmd.train  # noqa: E402,F401
from torchtitan_spmd.launcher import run_forked  # noqa: E402
from torchtitan_spmd.models import deepseek_v3  # noqa: E402
from torchtitan_spmd.models.deepseek_v3 import config_registry  # noqa: E402

WORLD = 4
SHOW = (1, 5, 10, 20, 30, 50, 100)


def _config(seq_len: int, batch: int, steps: int, backend: str) -> Any:
    cfg = config_registry.deepseek_v3_debugmodel()
    cfg.training.device, cfg.training.seq_len, cfg.training.local_batch_size = "cpu", seq_len, batch
    cfg.training.steps = steps
    cfg.parallelism.spmd_backend = backend
    cfg.debug.seed = 0
    return cfg


def _ep_worker(rank: int, world: int, ep: int, steps: int, seq_len: int, batch: int, backend: str,
               profile: bool) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    with open("/proc/self/clear_refs", "w") as f:  # peak RSS from here on, not the parent's
        f.write("5")
    cfg = _config(seq_len, batch, steps + 1, backend)
    cfg.parallelism.data_parallel_shard_degree = world
    cfg.parallelism.expert_parallel_degree = ep
    out, record = time_steps(Trainer(cfg), steps, profile)
    load = record.expert_load
    out["load"] = None if load is None else (load.min, load.max)
    return out


def _balance_worker(rank: int, world: int, steps: int, seq_len: int, batch: int,
                    coeff: float | None) -> list[tuple[int, int]]:
    from torchtitan_spmd.train import Trainer

    deepseek_v3.FLAVORS["debugmodel"] = dataclasses.replace(deepseek_v3.FLAVORS["debugmodel"],
                                                            load_balance_coeff=coeff)
    trainer = Trainer(_config(seq_len, batch, steps, "default"))
    loads = [(r.expert_load.min, r.expert_load.max) for r in trainer.run() if r.expert_load is not None]
    trainer.close()
    return loads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eps", default="1,2,4", help="EP degrees ('' : skip part 1)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--backend", default="default")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--balance-steps", type=int, default=0, help="part 2's steps (0: skip it)")
    args = parser.parse_args(argv)
    if args.eps:
        print(f"deepseek_v3_debugmodel, local batch {args.batch} x {args.seq_len}, FSDP {WORLD}, {args.backend}, "
              f"{args.steps} steps")
        print("| EP | step time (median after the first, s) | first step (s) | peak RSS, largest rank (MiB) "
              "| all-to-all share of a profiled step | tokens per expert, last step (min-max) | loss after |")
        print("|---|---|---|---|---|---|---|")
        for ep in (int(e) for e in args.eps.split(",")):
            per_rank = run_forked(_ep_worker, WORLD, ep, args.steps, args.seq_len, args.batch, args.backend,
                                  args.profile, timeout_s=7200)
            slowest = [max(r["times"][i] for r in per_rank) for i in range(args.steps)]
            share = "-"
            if args.profile:
                worst = max(per_rank, key=lambda r: r["a2a_s"] / r["profiled_s"])
                share = (f"{100 * worst['a2a_s'] / worst['profiled_s']:.1f}% "
                         f"({worst['a2a_s']:.2f} of {worst['profiled_s']:.2f} s)")
            median = statistics.median(slowest[1:]) if len(slowest) > 1 else slowest[0]
            load = per_rank[0]["load"]
            print(f"| {ep} | {median:.2f} | {slowest[0]:.2f} | {max(r['peak_mib'] for r in per_rank):.0f} | {share} "
                  f"| {load[0]}-{load[1]} | {per_rank[0]['loss']:.4f} |", flush=True)
    if args.balance_steps:
        shown = [s for s in SHOW if s <= args.balance_steps]
        print(f"\ntokens per expert (fewest-most, most/fewest), one process, local batch {args.batch} x "
              f"{args.seq_len}, every MoE block pooled")
        print("| load_balance_coeff | " + " | ".join(f"step {s}" for s in shown) + " |")
        print("|" + "---|" * (1 + len(shown)))
        for coeff in (1e-3, None):
            loads = run_forked(_balance_worker, 1, args.balance_steps, args.seq_len, args.batch, coeff,
                               timeout_s=7200)[0]
            cells = [f"{lo}-{hi} ({hi / lo:.1f}x)" if lo else f"{lo}-{hi} (inf)" for lo, hi in
                     (loads[s - 1] for s in shown)]
            print(f"| {coeff} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
