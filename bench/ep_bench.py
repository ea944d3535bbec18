"""Expert-parallelism cost: ``qwen3_moe_debug`` at EP 1 / 2 / 4 on 4 forked gloo ranks (FSDP 4).

    python bench/ep_bench.py --eps 1,2,4 --steps 3 --layers 2 --profile

The ``qwen3_moe_debug`` job (upstream's ``debugmodel_moe``: 64 experts of width 768, top-8;
local batch 4 x 256, fp32, selective AC, the ``default`` backend) on FSDP 4 with
``expert_parallel_degree`` EP. ``--layers`` replaces the flavour's 8 layers (the full model takes
about 100 s a step at FSDP 4 on a 2-core machine; the per-layer cost is what EP changes); say so
when quoting. Per EP: the median step time after the first step (slowest rank per step), the peak
resident set (``VmHWM``, reset after the fork) of the largest rank, and with ``--profile`` one more
step under ``torch.profiler``: the share of the step the calling thread spends in the all-to-alls
(the self CPU time of the ops whose name has ``all_to_all``/``alltoall``, and of
``wait_tensor``, over the step's wall time), slowest rank.
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

WORLD = 4


def _a2a_seconds(prof: Any) -> float:
    total_us = 0.0
    for evt in prof.key_averages():
        name = evt.key.lower()
        if "all_to_all" in name or "alltoall" in name or "wait_tensor" in name:
            total_us += evt.self_cpu_time_total
    return total_us / 1e6


def time_steps(trainer: Any, steps: int, profile: bool) -> tuple[dict[str, Any], Any]:
    """Run ``steps`` steps of ``trainer`` (then, with ``profile``, one more under torch's profiler)
    and close it: ``({"times", "peak_mib", "loss"[, "a2a_s", "profiled_s"]}, the last step's record)``.
    ``bench/deepseek_ep_bench.py`` uses it too."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    times = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        record = trainer.step(step)
        times.append(time.perf_counter() - start)
    out: dict[str, Any] = {"times": times, "peak_mib": _read_kib("VmHWM") / 1024, "loss": record.loss}
    if profile:
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            trainer.step(steps + 1)
            wall = time.perf_counter() - start
        out["a2a_s"], out["profiled_s"] = _a2a_seconds(prof), wall
    trainer.close()
    return out, record


def _worker(rank: int, world: int, ep: int, steps: int, layers: int, profile: bool) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    with open("/proc/self/clear_refs", "w") as f:  # peak RSS from here on, not the parent's
        f.write("5")
    qwen3.FLAVORS["debugmodel_moe"] = dataclasses.replace(qwen3.FLAVORS["debugmodel_moe"], n_layers=layers)
    cfg = config_registry.qwen3_moe_debug()
    cfg.parallelism.data_parallel_shard_degree = world
    cfg.parallelism.expert_parallel_degree = ep
    cfg.training.device = "cpu"
    cfg.training.steps = steps + 1
    cfg.debug.seed = 0
    out, _ = time_steps(Trainer(cfg), steps, profile)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eps", default="1,2,4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8, help="layers of debugmodel_moe (8: the flavour's)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    print(f"qwen3_moe_debug with {args.layers} layer(s), FSDP {WORLD}, default backend, {args.steps} steps")
    print("| EP | step time (median after the first, s) | first step (s) | peak RSS, largest rank (MiB) "
          "| all-to-all share of a profiled step | loss after |")
    print("|---|---|---|---|---|---|")
    for ep in (int(e) for e in args.eps.split(",")):
        per_rank = run_forked(_worker, WORLD, ep, args.steps, args.layers, args.profile, timeout_s=7200)
        slowest = [max(r["times"][i] for r in per_rank) for i in range(args.steps)]
        share = "-"
        if args.profile:
            worst = max(per_rank, key=lambda r: r["a2a_s"] / r["profiled_s"])
            share = f"{100 * worst['a2a_s'] / worst['profiled_s']:.1f}% ({worst['a2a_s']:.2f} of {worst['profiled_s']:.2f} s)"
        median = statistics.median(slowest[1:]) if len(slowest) > 1 else slowest[0]
        print(f"| {ep} | {median:.2f} | {slowest[0]:.2f} | {max(r['peak_mib'] for r in per_rank):.0f} | {share} | "
              f"{per_rank[0]['loss']:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
