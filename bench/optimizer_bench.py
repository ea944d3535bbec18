"""AdamW kernel benchmark: ``optimizer.implementation`` for-loop vs foreach vs fused.

    python bench/optimizer_bench.py            # llama3 debugmodel's parameters, one process

One process, the model's parameters with random gradients; the three implementations
interleaved step by step (so machine noise hits them alike), median step time each,
and each one's parameters after the steps against for-loop's (max relative difference).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from torchtitan_spmd.config import OptimizerConfig  # noqa: E402
from torchtitan_spmd.models.llama3 import FLAVORS, Transformer  # noqa: E402
from torchtitan_spmd.train import build_optimizer  # noqa: E402

IMPLEMENTATIONS = ("for-loop", "foreach", "fused")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a rank of a 4-rank job: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = {}
    for impl in IMPLEMENTATIONS:
        torch.manual_seed(0)
        models[impl] = Transformer(FLAVORS[args.flavor])
    opts = {impl: build_optimizer(m, OptimizerConfig(implementation=impl)) for impl, m in models.items()}
    times: dict[str, list[float]] = {impl: [] for impl in IMPLEMENTATIONS}
    for _ in range(args.steps):
        grads = [torch.randn_like(p) for p in models["for-loop"].parameters()]
        for impl in IMPLEMENTATIONS:
            for p, g in zip(models[impl].parameters(), grads, strict=True):
                p.grad = g.clone()
            start = time.perf_counter()
            opts[impl].step()
            times[impl].append(time.perf_counter() - start)
    n = sum(p.numel() for p in models["for-loop"].parameters())
    ref = torch.cat([p.detach().flatten() for p in models["for-loop"].parameters()])
    print(f"AdamW over {n:,} parameters ({args.flavor}), {args.threads} thread(s), median of {args.steps - 2} "
          f"steps after 2; load average {os.getloadavg()[0]:.1f}\n")
    print("| implementation | median step (ms) | max abs. difference from for-loop |")
    print("|---|---|---|")
    for impl in IMPLEMENTATIONS:
        got = torch.cat([p.detach().flatten() for p in models[impl].parameters()])
        diff = (got - ref).abs().max().item()
        print(f"| {impl} | {1e3 * statistics.median(times[impl][2:]):.1f} | {diff:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
