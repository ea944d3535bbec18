"""Pipeline-parallel benchmark: step time and peak RSS per rank, PP 2 against no PP at the same global batch.

    python bench/pp_bench.py                          # llama3 debugmodel, global batch 8, seq 256
    python bench/pp_bench.py --repeats 3 --steps 6 --microbatch-size 1

Jobs (default backend, fp32, no activation checkpointing, eager, gloo), interleaved ``--repeats`` times:

- ``single``: one process, local batch = the global batch;
- ``fsdp2``: two ranks, FSDP 2 (the same two ranks without pipelining);
- ``pp2_<schedule>``: two ranks, for each of ``--schedules`` (by default every torch schedule: one
  stage a rank for GPipe and 1F1B, two for the others), ``m = global batch / microbatch size``
  microbatches.

Step time: the median over the steps after the first of the slowest rank per step, then the median over
repeats. Peak RSS: ``VmHWM`` of the largest rank, reset right after the fork. The bubble column is the PP
step time over the ideal of a perfect two-way split of the one-process step (``single / 2``), next to
the schedule's ideal ``1 + (p - 1) / (v m)`` (``(m + p - 1) / m`` for one stage a rank, ``v = 1``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch._inductor  # noqa: E402,F401  (imported once in the parent, not per rank)

import torchtitan_spmd.train  # noqa: E402,F401
from torchtitan_spmd.config import JobConfig  # noqa: E402
from torchtitan_spmd.launcher import run_forked  # noqa: E402


def _config(job: str, args: argparse.Namespace) -> tuple[JobConfig, int]:
    par: dict[str, Any] = {"data_parallel_shard_degree": 1}
    world, local = 1, args.global_batch
    if job == "fsdp2":
        par, world, local = {"data_parallel_shard_degree": 2}, 2, args.global_batch // 2
    elif job.startswith("pp2_"):
        par = {"data_parallel_shard_degree": 1, "pipeline_parallel_degree": 2,
               "pipeline_parallel_schedule": job[4:], "pipeline_parallel_microbatch_size": args.microbatch_size}
        world = 2
    cfg = JobConfig.from_dict({
        "model": {"name": "llama3", "flavor": args.flavor},
        "training": {"steps": args.steps, "local_batch_size": local, "seq_len": args.seq_len, "device": "cpu",
                     "mixed_precision_param": "float32"},
        "activation_checkpoint": {"mode": "none"},
        "parallelism": {**par, "spmd_backend": "default"},
        "debug": {"seed": 0},
    })
    return cfg, world


def _read_kib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1])
    return float("nan")


def _rank(rank: int, world: int, cfg: JobConfig) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    with open("/proc/self/clear_refs", "w") as f:  # peak RSS from here on, not the parent's
        f.write("5")
    trainer = Trainer(cfg)
    times = []
    for step in range(1, cfg.training.steps + 1):
        start = time.perf_counter()
        trainer.step(step)
        times.append(time.perf_counter() - start)
    trainer.close()
    return {"times": times, "peak_mib": _read_kib("VmHWM") / 1024}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--microbatch-size", type=int, default=1)
    parser.add_argument("--schedules", default="GPipe,1F1B,Interleaved1F1B,LoopedBFS,InterleavedZeroBubble,"
                                               "ZBVZeroBubble,DualPipeV")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    jobs = ["single", "fsdp2", *(f"pp2_{s}" for s in args.schedules.split(","))]
    step_s: dict[str, list[float]] = {j: [] for j in jobs}
    peak: dict[str, list[float]] = {j: [] for j in jobs}
    for _ in range(args.repeats):
        for job in jobs:
            cfg, world = _config(job, args)
            per_rank = run_forked(_rank, world, cfg, timeout_s=900)
            slowest = [max(r["times"][i] for r in per_rank) for i in range(1, args.steps)]
            step_s[job].append(statistics.median(slowest))
            peak[job].append(max(r["peak_mib"] for r in per_rank))
    m, p = args.global_batch // args.microbatch_size, 2
    single = statistics.median(step_s["single"])
    print(f"llama3 {args.flavor}, global batch {args.global_batch} x seq {args.seq_len}, m = {m} microbatches, "
          f"p = {p}; median of {args.repeats} interleaved repeats")
    print("| job | ranks | step (s) | peak RSS per rank (MiB) | step / (single / 2) | ideal 1 + (p-1)/(v m) |")
    print("|---|---|---|---|---|---|")
    for job in jobs:
        t = statistics.median(step_s[job])
        ranks = 1 if job == "single" else 2
        ratio = f"{t / (single / 2):.2f}" if ranks == 2 else "-"
        ideal = "-"
        if job.startswith("pp2_"):  # v stages a rank: the bubble is (p - 1) / (v m) of the work
            v = 1 if job[4:] in ("GPipe", "1F1B") else 2
            ideal = f"{1 + (p - 1) / (v * m):.2f}"
        print(f"| {job} | {ranks} | {t:.3f} | {statistics.median(peak[job]):.0f} | {ratio} | {ideal} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
