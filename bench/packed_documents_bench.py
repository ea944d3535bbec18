"""Packed documents: the step time of ``attn_mask_type="block_causal"`` against ``causal``.

    python bench/packed_documents_bench.py                    # llama3 debugmodel, seq 2048, 1 process
    python bench/packed_documents_bench.py --steps 6 --rounds 2 --seq-len 2048

One process (no parallelism), fp32, no activation checkpointing, eager: the flavour ``debugmodel``
(causal: SDPA's ``is_causal``) and ``debugmodel_flex_attn`` (the same weights' shapes,
block-causal: SDPA with the boolean mask built from the per-document positions, the boundary
labels ignored), each in its own forked process, alternating ``--rounds`` times so both see the
same machine load. The step time is the median over the steps after the first; also the peak
resident set (``VmHWM``) of each run and the number of documents per window. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_spmd.train  # noqa: E402,F401  (imported once in the parent)
from torchtitan_spmd.config import JobConfig  # noqa: E402
from torchtitan_spmd.launcher import run_forked  # noqa: E402

FLAVORS = {"causal": "debugmodel", "block_causal": "debugmodel_flex_attn"}


def _config(flavor: str, args: argparse.Namespace) -> JobConfig:
    return JobConfig.from_dict({
        "model": {"name": "llama3", "flavor": flavor},
        "training": {"steps": args.steps, "local_batch_size": args.local_batch_size, "seq_len": args.seq_len,
                     "device": args.device, "mixed_precision_param": "float32"},
        "activation_checkpoint": {"mode": "none"},
        "lr_scheduler": {"warmup_steps": 1},
        "parallelism": {"data_parallel_shard_degree": 1},
        "debug": {"seed": 0},
    })


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _worker(rank: int, world: int, flavor: str, args: argparse.Namespace) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    with open("/proc/self/clear_refs", "w") as f:  # peak RSS from here on, not the parent's
        f.write("5")
    trainer = Trainer(_config(flavor, args))
    times, losses = [], []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        record = trainer.step(step)
        times.append(time.perf_counter() - start)
        losses.append(record.loss)
    return {"times": times, "losses": losses, "rss": _peak_rss_mib()}


def _documents_per_window(args: argparse.Namespace) -> float:
    from torchtitan_spmd.data import build_dataloader

    loader = build_dataloader(dp_rank=0, dp_degree=1, local_batch_size=args.local_batch_size,
                              seq_len=args.seq_len, seed=0)
    tokens, _ = next(loader)
    return float((tokens == 257).sum(1).float().mean()) + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--local-batch-size", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in FLAVORS}
    for _ in range(args.rounds):
        for mask, flavor in FLAVORS.items():
            runs[mask].append(run_forked(_worker, 1, flavor, args, timeout_s=1800)[0])
    print(f"llama3 debugmodel, seq {args.seq_len} x local batch {args.local_batch_size}, 1 process, fp32, "
          f"{args.steps} steps x {args.rounds} rounds; about {_documents_per_window(args):.1f} documents a window\n")
    print("| attn_mask_type | median step (s), per round | peak RSS (MiB) | loss at the last step |")
    print("|---|---|---|---|")
    medians = {}
    for mask, rs in runs.items():
        per_round = [statistics.median(r["times"][1:]) for r in rs]
        medians[mask] = statistics.median(per_round)
        print(f"| {mask} | {', '.join(f'{t:.3f}' for t in per_round)} | {max(r['rss'] for r in rs):.0f} | "
              f"{rs[-1]['losses'][-1]:.4f} |")
    print(f"\nblock_causal / causal step time: {medians['block_causal'] / medians['causal']:.2f}x")


if __name__ == "__main__":
    main()
