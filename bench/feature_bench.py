"""Training-feature benchmark: step time and peak memory per backend and feature setting.

    python bench/feature_bench.py                         # every backend x every variant
    python bench/feature_bench.py --backends default --variants ac_none,ac_full --steps 4

A variant is one setting on top of the base job (llama3 debugmodel, 4 gloo ranks,
FSDP 2 x TP 2, fp32, no activation checkpointing, eager):

- ``ac_none``, ``ac_full``, ``ac_selective``: ``activation_checkpoint.mode``;
- ``compile``: ``compile.enable`` with ``compile.backend`` (``--compile-backend``,
  inductor by default), model and loss;
- ``bf16``: ``training.mixed_precision_param=bfloat16``.

Each (backend, variant) runs in its own forked ranks, so the memory is its own: the
peak resident set (``VmHWM``, reset right after the fork; on CUDA
``torch.cuda.max_memory_allocated``) of the largest rank, measured over setup and
every step. The step time is the median over the steps after ``--warmup`` (the
first steps hold compilation and first-use caches), of the slowest rank per step;
the first step's time is printed too (compile cost). Prints a markdown table.
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

BACKENDS = ("default", "full_dtensor", "spmd_types")
VARIANTS = ("ac_none", "ac_full", "ac_selective", "compile", "bf16")


def _config(backend: str, variant: str, args: argparse.Namespace) -> JobConfig:
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}; valid variants: {', '.join(VARIANTS)}.")
    cfg = JobConfig.from_dict(
        {
            "model": {"name": args.model, "flavor": args.flavor},
            "training": {"steps": args.steps, "local_batch_size": args.local_batch_size,
                         "seq_len": args.seq_len, "device": args.device,
                         "mixed_precision_param": "bfloat16" if variant == "bf16" else "float32"},
            "activation_checkpoint": {"mode": variant[3:] if variant.startswith("ac_") else "none"},
            "compile": {"enable": variant == "compile", "backend": args.compile_backend,
                        "components": ["model", "loss"]},
            "parallelism": {"data_parallel_shard_degree": args.dp_shard,
                            "tensor_parallel_degree": args.tp, "spmd_backend": backend},
            "debug": {"seed": 0},
        }
    )
    return cfg


def _read_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _worker(rank: int, world: int, backend: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from torchtitan_spmd.train import Trainer

    with open("/proc/self/clear_refs", "w") as f:  # peak RSS from here on, not the parent's
        f.write("5")
    trainer = Trainer(_config(backend, variant, args))
    times = []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        trainer.step(step)
        times.append(time.perf_counter() - start)
    if trainer.device_type == "cuda":
        peak_mib = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mib = _read_kib("VmHWM") / 1024
    return {"times": times, "peak_mib": peak_mib}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--model", default="llama3", help="model family (model.name)")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--local-batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--dp-shard", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile-backend", default="inductor")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}).")
    backends = [b for b in args.backends.split(",") if b]
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        _config(backends[0], v, args)  # a bad variant fails here, before any rank starts
    world = args.dp_shard * args.tp
    print(f"{world} gloo ranks, dp_shard={args.dp_shard} x tp={args.tp}, {args.model} {args.flavor}, "
          f"local batch {args.local_batch_size} x seq {args.seq_len}, median of {args.steps - args.warmup} "
          f"steps after {args.warmup} warm-up; load average {os.getloadavg()[0]:.1f} at start\n")
    print("| backend | variant | median step (s) | first step (s) | peak RSS per rank (MiB) |")
    print("|---|---|---|---|---|")
    for backend in backends:
        for variant in variants:
            per_rank = run_forked(_worker, world, backend, variant, args, timeout_s=3600)
            steps = [max(r["times"][i] for r in per_rank) for i in range(args.steps)]
            peak = max(r["peak_mib"] for r in per_rank)
            print(f"| {backend} | {variant} | {statistics.median(steps[args.warmup:]):.2f} | "
                  f"{steps[0]:.2f} | {peak:.0f} |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
