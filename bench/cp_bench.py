"""Context-parallel benchmark: what a rank holds and how long a step takes, against one process.

    python bench/cp_bench.py memory     # peak RSS: seq 16384 over cp 4 vs one process at seq 4096
    python bench/cp_bench.py saved      # saved-for-backward bytes of one layer, cp 1/2/4/8 x seq 4k/16k
    python bench/cp_bench.py time       # step time: seq 16384 over cp 4 vs one process at seq 16384
    python bench/cp_bench.py memory --backends spmd_types --rotates alltoall --flavor debugmodel --layers 2

One forked gloo job per row (``cp`` ranks, no data or tensor parallelism, so the global
batch is one sequence), the ``llama3`` flavour ``--flavor`` (default ``tiny``) with
``--layers`` layers; ``training.seq_len`` sizes its RoPE tables. Per rank:

- **peak RSS**: ``getrusage(RUSAGE_SELF).ru_maxrss`` at the end of the job (a forked rank
  starts with the parent's resident pages: the imports, the same in every row), and the
  RSS before the first step, so the step's own growth shows;
- **saved for backward, one layer**: the bytes ``layers.0`` saves for backward (unique
  storages, counted by ``torch.autograd.graph.saved_tensors_hooks`` around its forward) in
  the last step -- the activations that must fit;
- **step time**: the median over the measured steps (after ``--warmup``): rank 0's wall time,
  and the busiest rank's CPU time (``time.process_time``, one thread per rank), which a
  loaded machine or ranks sharing cores distort far less than wall time.

The one-process rows are the same model without context parallelism (``spmd_backend="default"``,
nothing distributed). Times depend on
the machine and its load: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch._inductor  # noqa: E402,F401  (imported once in the parent, not per rank)
from torch.distributed.tensor import DTensor  # noqa: E402

import torchtitan_spmd.train  # noqa: E402,F401
from torchtitan_spmd.config import JobConfig  # noqa: E402
from torchtitan_spmd.launcher import run_forked  # noqa: E402
from torchtitan_spmd.models import llama3  # noqa: E402

FLAVOR = "cp_bench"
#: The backend of the one-process rows: nothing distributed, plain modules (full_dtensor on one
#: rank with a batch of 1 trips a DTensor view rule, see docs/benchmarks.md).
ONE_PROCESS = "default"


def _config(args: argparse.Namespace, *, seq_len: int, cp: int, backend: str, rotate: str,
            steps: int) -> JobConfig:
    return JobConfig.from_dict({
        "model": {"name": "llama3", "flavor": FLAVOR},
        "training": {"steps": steps, "local_batch_size": 1, "seq_len": seq_len,
                     "device": "cpu", "max_norm": 1.0, "mixed_precision_param": "float32"},
        "activation_checkpoint": {"mode": "none"},
        "parallelism": {"spmd_backend": backend, "data_parallel_shard_degree": 1,
                        "context_parallel_degree": cp, "context_parallel_rotate_method": rotate},
        "debug": {"seed": 0},
    })


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _rank(rank: int, world: int, cfg: JobConfig, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    trainer = torchtitan_spmd.train.Trainer(cfg)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()
        saved[s.data_ptr()] = s.nbytes()
        return t

    hooks: list[Any] = []

    def enter(*_: Any) -> None:
        ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        ctx.__enter__()
        hooks.append(ctx)

    def leave(*_: Any) -> None:
        hooks.pop().__exit__(None, None, None)

    layer = dict(trainer.model.named_modules())["layers.0"]
    layer.register_forward_pre_hook(enter)
    layer.register_forward_hook(leave)
    rss_setup = _rss_mib()
    times, cpu, last = [], [], 0
    for step in range(1, cfg.training.steps + 1):
        saved.clear()
        start, start_cpu = time.perf_counter(), time.process_time()
        record = trainer.step(step)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        last = sum(saved.values())
    trainer.close()
    return {"saved_layer_bytes": last, "step_s": times[warmup:] or times, "cpu_s": cpu[warmup:] or cpu,
            "loss": record.loss,
            "rss_setup_mib": rss_setup, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _run(args: argparse.Namespace, *, seq_len: int, cp: int, backend: str, rotate: str = "allgather",
         steps: int | None = None) -> dict[str, Any]:
    steps = steps if steps is not None else args.warmup + args.steps
    cfg = _config(args, seq_len=seq_len, cp=cp, backend=backend, rotate=rotate, steps=steps)
    per_rank = run_forked(_rank, cp, cfg, min(args.warmup, steps - 1), timeout_s=3600)
    return {
        "peak": max(r["peak_rss_mib"] for r in per_rank),
        "setup": max(r["rss_setup_mib"] for r in per_rank),
        "saved": max(r["saved_layer_bytes"] for r in per_rank),
        "step": statistics.median(per_rank[0]["step_s"]),
        "cpu": max(statistics.median(r["cpu_s"]) for r in per_rank),
        "loss": per_rank[0]["loss"],
    }


def memory(args: argparse.Namespace) -> None:
    """Peak RSS per rank of ``--seq-len`` over ``--cp`` ranks against one process at seq/cp."""
    seq, cp = args.seq_len, args.cp
    print(f"| backend | rotate | job | peak RSS per rank (MiB) | RSS after setup (MiB) | step growth (MiB) "
          f"| saved by layer 0 (MiB) | peak / one process at seq {seq // cp} |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for backend in args.backends.split(","):
        base = _run(args, seq_len=seq // cp, cp=1, backend=ONE_PROCESS)
        print(f"| {ONE_PROCESS} | - | 1 process, seq {seq // cp} | {base['peak']:.0f} | {base['setup']:.0f} | "
              f"{base['peak'] - base['setup']:.0f} | {base['saved'] / 2**20:.1f} | 1.00 |", flush=True)
        for rotate in args.rotates.split(","):
            got = _run(args, seq_len=seq, cp=cp, backend=backend, rotate=rotate)
            print(f"| {backend} | {rotate} | cp {cp}, seq {seq} | {got['peak']:.0f} | {got['setup']:.0f} | "
                  f"{got['peak'] - got['setup']:.0f} | {got['saved'] / 2**20:.1f} | "
                  f"{got['peak'] / base['peak']:.3f} |", flush=True)


def saved(args: argparse.Namespace) -> None:
    """Saved-for-backward bytes of one layer per rank, at each CP degree and sequence length."""
    seqs = [int(s) for s in args.seqs.split(",")]
    cps = [int(c) for c in args.cps.split(",")]
    print("| seq | " + " | ".join(f"cp {c} (MiB)" for c in cps) + " | bytes per local token |")
    print("|---:|" + "---:|" * (len(cps) + 1))
    for seq in seqs:
        cells, per_token = [], set()
        for cp in cps:
            got = _run(args, seq_len=seq, cp=cp, backend=args.backends.split(",")[0] if cp > 1 else ONE_PROCESS,
                       steps=1)
            cells.append(f"{got['saved'] / 2**20:.2f}")
            per_token.add(round(got["saved"] / (seq // cp)))
        print(f"| {seq} | " + " | ".join(cells) + f" | {', '.join(map(str, sorted(per_token)))} |", flush=True)


def step_time(args: argparse.Namespace) -> None:
    """Median step time of ``--seq-len`` over ``--cp`` ranks against one process at the same length."""
    print("| backend | rotate | job | median step, wall (s) | wall / one process | CPU time per step, "
          "busiest rank (s) | CPU / one process | loss after the steps |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for backend in args.backends.split(","):
        one = _run(args, seq_len=args.seq_len, cp=1, backend=ONE_PROCESS)
        print(f"| {ONE_PROCESS} | - | 1 process, seq {args.seq_len} | {one['step']:.2f} | 1.00 | {one['cpu']:.2f} "
              f"| 1.00 | {one['loss']:.7f} |", flush=True)
        for rotate in args.rotates.split(","):
            got = _run(args, seq_len=args.seq_len, cp=args.cp, backend=backend, rotate=rotate)
            print(f"| {backend} | {rotate} | cp {args.cp}, seq {args.seq_len} | {got['step']:.2f} | "
                  f"{got['step'] / one['step']:.2f} | {got['cpu']:.2f} | {got['cpu'] / one['cpu']:.2f} "
                  f"| {got['loss']:.7f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("memory", "saved", "time"))
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--seqs", default="4096,16384", help="saved: comma-separated sequence lengths")
    parser.add_argument("--cps", default="1,2,4,8", help="saved: comma-separated CP degrees")
    parser.add_argument("--backends", default="full_dtensor,spmd_types")
    parser.add_argument("--rotates", default="allgather,alltoall")
    parser.add_argument("--flavor", default="tiny", choices=sorted(llama3.FLAVORS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="measured steps")
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    import dataclasses

    llama3.FLAVORS[FLAVOR] = dataclasses.replace(llama3.FLAVORS[args.flavor], n_layers=args.layers)
    print(f"{args.what}: llama3 {args.flavor} widths, {args.layers} layers, batch 1, fp32, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start\n")
    {"memory": memory, "saved": saved, "time": step_time}[args.what](args)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
