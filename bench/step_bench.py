"""Step-time benchmark: the SPMD backends on the same job, interleaved in one run.

    python bench/step_bench.py                       # 4 gloo ranks, FSDP 2 x TP 2, llama3 debugmodel
    python bench/step_bench.py --steps 8 --variants default,full_dtensor
    python bench/step_bench.py --model qwen3
    python bench/step_bench.py --variants spmd_types,spmd_types+typecheck --baseline spmd_types
    python bench/step_bench.py --variants spmd_types+typecheck1,spmd_types --steps 20 \
        --baseline spmd_types                         # a run type-checking its first step

Every rank builds one trainer per variant (same model, data and seed), then the
steps are interleaved: step 1 of every variant, then step 2 of every variant,
and so on, so machine noise hits all variants alike; the order rotates every
step, as the first variant of a round runs slower. The first ``--warmup``
steps (DTensor's sharding-propagation caches, first collectives) are dropped.
A variant is a backend name, optionally with ``+typecheck`` to turn on
``debug.spmd_typechecking`` (every step) or ``+typecheckN`` to type-check only
the first N steps (``debug.spmd_typechecking_steps=N``). Prints a markdown table
per variant: the median step time, its ratio to the baseline variant
(``--baseline``, by default ``default``), the median CPU time of a step summed over
the ranks (steadier than wall time on a shared machine), the first step, and the
whole run (every step, warm-up included) in wall and CPU time; a step's wall time
is its slowest rank's.

The checker's decisions are remembered process-wide (see the spmd_types
representation's ``typecheck`` module): with several type-checked variants in one
run, the later ones' first steps reuse the earlier ones' decisions, so for a
whole-run figure give one type-checked variant per run.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch._inductor  # noqa: E402,F401  (imported once in the parent, not per rank)

import torchtitan_spmd.train  # noqa: E402,F401
from torchtitan_spmd.config import JobConfig  # noqa: E402
from torchtitan_spmd.distributed.representation import get_representation  # noqa: E402
from torchtitan_spmd.launcher import run_forked  # noqa: E402

ALL_VARIANTS = ("default", "full_dtensor", "spmd_types", "spmd_types+typecheck")


def _config(variant: str, args: argparse.Namespace) -> JobConfig:
    backend, _, extra = variant.partition("+")
    typecheck = re.fullmatch(r"typecheck(\d*)", extra)
    if extra and typecheck is None:
        raise ValueError(f"variant {variant!r}: the only suffixes are '+typecheck' and '+typecheckN' (N >= 1).")
    checked_steps = int(typecheck.group(1)) if typecheck is not None and typecheck.group(1) else None
    return JobConfig.from_dict(
        {
            "model": {"name": args.model, "flavor": args.flavor},
            "training": {"steps": args.steps, "local_batch_size": args.local_batch_size,
                         "seq_len": args.seq_len, "device": "cpu", "mixed_precision_param": "float32"},
            "activation_checkpoint": {"mode": "none"},  # fp32, no recompute: bench/feature_bench.py has those
            "parallelism": {"data_parallel_shard_degree": args.dp_shard,
                            "tensor_parallel_degree": args.tp, "spmd_backend": backend},
            "debug": {"seed": 0, "spmd_typechecking": typecheck is not None,
                      # only when asked for: step_bench_ab also runs this file on older checkouts
                      **({} if checked_steps is None else {"spmd_typechecking_steps": checked_steps})},
        }
    )


def _worker(rank: int, world: int, variants: list[str],
            args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    from torchtitan_spmd.train import Trainer

    trainers = {v: Trainer(_config(v, args)) for v in variants}
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    order = list(trainers)
    for step in range(1, args.steps + 1):
        # Rotate who goes first: the first variant of a round was measured about 5 % slower
        # than the same variant second (spmd_types vs spmd_types+typecheck1, 50 steps).
        for variant in order[step % len(order):] + order[:step % len(order)]:
            trainer = trainers[variant]
            start, cpu = time.perf_counter(), time.process_time()
            trainer.step(step)
            times[variant].append((time.perf_counter() - start, time.process_time() - cpu))
    return times


def available_variants() -> list[str]:
    """The variants whose backend has a runtime in this build."""
    out = []
    for variant in ALL_VARIANTS:
        try:
            get_representation(variant.partition("+")[0])
        except ValueError:
            continue
        out.append(variant)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(available_variants()))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model", default="llama3", help="model family (model.name)")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--local-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dp-shard", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--baseline", default=None,
                        help="the variant the ratios are to (default: 'default' if run, else the first)")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    baseline = args.baseline or ("default" if "default" in variants else variants[0])
    if baseline not in variants:
        parser.error(f"--baseline {baseline!r} is not one of the variants {variants}.")
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}).")
    checked = [v for v in variants if "+typecheck" in v]
    if len(checked) > 1:
        print(f"note: {', '.join(checked[1:])} reuse the type checker's decisions of {checked[0]} "
              "(one process): their whole-run figures leave out their first-step checking.")
    world = args.dp_shard * args.tp
    start = time.perf_counter()
    per_rank = run_forked(_worker, world, variants, args, timeout_s=3600)
    wall = time.perf_counter() - start
    # A step ends when its slowest rank ends: take the max over ranks per step.
    medians, runs, cpus, firsts, run_cpus = {}, {}, {}, {}, {}
    for v in variants:
        steps = [max(r[v][i][0] for r in per_rank) for i in range(args.steps)]
        cpu = [sum(r[v][i][1] for r in per_rank) for i in range(args.steps)]
        medians[v], cpus[v] = statistics.median(steps[args.warmup:]), statistics.median(cpu[args.warmup:])
        runs[v], firsts[v], run_cpus[v] = sum(steps), steps[0], sum(cpu)
    print(f"\n{world} gloo ranks, dp_shard={args.dp_shard} x tp={args.tp}, {args.model} {args.flavor}, "
          f"local batch {args.local_batch_size} x seq {args.seq_len}, {args.steps - args.warmup} "
          f"measured steps after {args.warmup} warm-up, interleaved; wall {wall:.0f} s\n")
    print(f"| variant | median step (s) | ratio to {baseline} | CPU s/step, all ranks | ratio to {baseline} "
          f"| step 1 (s) | whole run (s) | ratio to {baseline} | whole run CPU (s) | ratio to {baseline} |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for v in variants:
        print(f"| {v} | {medians[v]:.3f} | {medians[v] / medians[baseline]:.2f}x | {cpus[v]:.2f} | "
              f"{cpus[v] / cpus[baseline]:.2f}x | {firsts[v]:.2f} | {runs[v]:.1f} | {runs[v] / runs[baseline]:.2f}x | "
              f"{run_cpus[v]:.1f} | {run_cpus[v] / run_cpus[baseline]:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
