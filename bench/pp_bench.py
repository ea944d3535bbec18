"""Pipeline-parallel benchmark: step time and peak RSS per rank, PP 2 against no PP at the same global batch.

    python bench/pp_bench.py                          # llama3 debugmodel, global batch 8, seq 256
    python bench/pp_bench.py --repeats 3 --steps 6 --microbatch-size 1
    python bench/pp_bench.py --global-batch 16 --seq-len 512 --microbatch-size 2 --repeats 3 --no-fsdp

Jobs (default backend, fp32, no activation checkpointing, eager, gloo), interleaved ``--repeats`` times:

- ``single``: one process, local batch = the global batch;
- ``fsdp2``: two ranks, FSDP 2 (the same two ranks without pipelining);
- ``pp2_<schedule>``: two ranks, for each of ``--schedules`` (by default every torch schedule: one
  stage a rank for GPipe and 1F1B, two for the others), ``m = global batch / microbatch size``
  microbatches.

Step time: the median over the steps after the first of the slowest rank per step, then the median over
repeats (the spread: the fastest and slowest repeat). Peak RSS: ``VmHWM`` of the largest rank, reset right
after the fork. ``step / (single / 2)`` is the PP step time over a perfect two-way split of the one-process
step, next to the schedule's ideal ``1 + (p - 1) / (v m)`` (``(m + p - 1) / m`` for one stage a rank,
``v = 1``).

The bubble, on a shared machine (``--pin``, the default: rank ``r`` on core ``r``, one thread each):
wall time also counts the waits for a core, and gloo's waits spin (a PP rank's CPU time is its wall
time), so each rank also times its pipeline waits: every ``wait`` on the schedule's batched sends and
receives (torch's ``schedules._wait_batch_p2p``, wrapped in the rank). ``bubble`` is the PP ranks'
mean of ``step / (step - waits)`` (median over the steps), the measured counterpart of the ideal
``1 + (p - 1) / (v m)``: the pipeline's idle time, with its P2P time and the peer's waits for a core.
The load average is printed with each repeat.
"""

from __future__ import annotations

import argparse
import os
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


def _rank(rank: int, world: int, cfg: JobConfig, pin: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.pipelining import schedules

    from torchtitan_spmd.train import Trainer

    if pin:  # rank r on core r (of the cores this process may use), one thread
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
        torch.set_num_threads(1)
    waited = [0.0]
    wait_batch_p2p = schedules._wait_batch_p2p

    def timed_wait(work: Any) -> None:  # every schedule's P2P waits go through this module function
        start = time.perf_counter()
        wait_batch_p2p(work)
        waited[0] += time.perf_counter() - start

    schedules._wait_batch_p2p = timed_wait
    with open("/proc/self/clear_refs", "w") as f:  # peak RSS from here on, not the parent's
        f.write("5")
    trainer = Trainer(cfg)
    times, waits = [], []
    for step in range(1, cfg.training.steps + 1):
        start, waited[0] = time.perf_counter(), 0.0
        trainer.step(step)
        times.append(time.perf_counter() - start)
        waits.append(waited[0])
    trainer.close()
    return {"times": times, "waits": waits, "peak_mib": _read_kib("VmHWM") / 1024}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def _v(job: str) -> int:
    """Stages a rank of a PP job."""
    return 1 if job[4:] in ("GPipe", "1F1B") else 2


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
    parser.add_argument("--no-fsdp", action="store_true", help="leave out the FSDP 2 job")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave the ranks on every core (torch's default threads)")
    args = parser.parse_args(argv)
    jobs = ["single", *([] if args.no_fsdp else ["fsdp2"]), *(f"pp2_{s}" for s in args.schedules.split(","))]
    step_s: dict[str, list[float]] = {j: [] for j in jobs}
    peak: dict[str, list[float]] = {j: [] for j in jobs}
    bubble: dict[str, list[float]] = {j: [] for j in jobs}  # mean over ranks of step / (step - P2P waits)
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1}: load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        for job in jobs:
            cfg, world = _config(job, args)
            per_rank = run_forked(_rank, world, cfg, args.pin, timeout_s=900)
            slowest = [max(r["times"][i] for r in per_rank) for i in range(1, args.steps)]
            step_s[job].append(statistics.median(slowest))
            peak[job].append(max(r["peak_mib"] for r in per_rank))
            bubble[job].append(statistics.mean(
                statistics.median(r["times"][i] / max(r["times"][i] - r["waits"][i], 1e-9)
                                  for i in range(1, args.steps)) for r in per_rank))
    m, p = args.global_batch // args.microbatch_size, 2
    single = statistics.median(step_s["single"])
    print(f"llama3 {args.flavor}, global batch {args.global_batch} x seq {args.seq_len}, microbatch size "
          f"{args.microbatch_size} (m = {m}), p = {p}, {'pinned: a core a rank' if args.pin else 'unpinned'}; "
          f"median [min-max] of {args.repeats} interleaved repeats")
    print("| job | ranks | step (s) | peak RSS per rank (MiB) | step / (single / 2) | bubble: step / (step - P2P "
          "waits) | ideal 1 + (p-1)/(v m) |")
    print("|---|---|---|---|---|---|---|")
    for job in jobs:
        t = statistics.median(step_s[job])
        ranks = 1 if job == "single" else 2
        ratio = f"{t / (single / 2):.2f}" if ranks == 2 else "-"
        measured = ideal = "-"
        if job.startswith("pp2_"):  # v stages a rank: the bubble is (p - 1) / (v m) of the work
            measured, ideal = _spread(bubble[job]), f"{1 + (p - 1) / (_v(job) * m):.3f}"
        print(f"| {job} | {ranks} | {_spread(step_s[job])} | {statistics.median(peak[job]):.0f} | {ratio} | "
              f"{measured} | {ideal} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
