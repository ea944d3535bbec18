"""The recipe-like run and the overhead of validation, the profiler and W&B (docs/benchmarks.md).

``python bench/run_features_bench.py OUT_DIR [--steps N]``: the llama3 debug model on 4 forked
CPU ranks (FSDP 4), one run with everything off and one run per feature, the runs interleaved
round-robin ``--rounds`` times so that load on a shared machine hits each alike. A step's time
is the trainer's own (``tokens / tokens_per_s``: data, forward, backward, optimizer), so
validation's own batches, which run between steps, are excluded, as the issue asks; the
profiler runs with windows that never open during the measured steps (``profile_freq`` past
the run). Then the recipe-like run (validator, profiler, TensorBoard and W&B offline together)
writes its files under OUT_DIR/recipe and its loss picture to OUT_DIR/loss.png.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from typing import Any

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

WORLD = 4


def job(folder: str, steps: int, world: int = WORLD, **over: Any) -> JobConfig:
    """The debug model, FSDP over ``world`` CPU ranks, fp32, with ``section__field=value`` overrides."""
    cfg: dict[str, Any] = {
        "job": {"dump_folder": folder},
        "model": {"name": "llama3", "flavor": "debugmodel"},
        "training": {"steps": steps, "local_batch_size": 2, "seq_len": 128, "device": "cpu",
                     "mixed_precision_param": "float32"},
        "activation_checkpoint": {"mode": "none"},
        "lr_scheduler": {"warmup_steps": 2},
        "parallelism": {"data_parallel_shard_degree": world},
        "debug": {"seed": 0},
    }
    for key, value in over.items():
        section, name = key.split("__")
        cfg.setdefault(section, {})[name] = value
    return JobConfig.from_dict(cfg)


def _run(rank: int, world: int, cfg: JobConfig) -> dict[str, Any]:
    import torch

    from torchtitan_spmd.train import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(cfg)
    try:
        records = trainer.run()
        tokens = cfg.training.local_batch_size * cfg.training.seq_len
        return {"step_s": [tokens / r.tokens_per_s for r in records], "loss": [(r.step, r.loss) for r in records],
                "validation": [(v.step, v.loss) for v in trainer.validations]}
    finally:
        trainer.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--world", type=int, default=WORLD,
                        help="ranks (4 oversubscribes a 2-core machine 2x: every helper thread or "
                             "process, W&B's service included, then takes CPU from a rank)")
    parser.add_argument("--shuffle", action="store_true",
                        help="a new random order of the runs each round (else the same order: the "
                             "baseline always first)")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        import wandb  # noqa: F401
        have_wandb = True
    except ImportError:
        have_wandb = False
    features: dict[str, dict[str, Any]] = {
        "everything off": {},
        "validator (freq 4, 2 batches)": {"validator__enable": True, "validator__freq": 4, "validator__steps": 2},
        "profiler, outside its windows": {"profiler__enable_profiling": True,
                                          "profiler__profile_freq": 10 * args.steps},
    }
    if have_wandb:
        features["W&B offline"] = {"metrics__enable_wandb": True}
    times: dict[str, list[float]] = {name: [] for name in features}
    order = list(enumerate(features.items()))
    for r in range(args.rounds):
        if args.shuffle:
            random.Random(r).shuffle(order)
        for i, (name, over) in order:
            out = run_forked(_run, args.world, job(os.path.join(args.out, f"r{r}_{i}"), args.steps, args.world,
                                                   **over), timeout_s=1800)[0]
            times[name] += out["step_s"][2:]  # the first two steps warm up
    base = statistics.median(times["everything off"])
    print("| run | median step (s) | overhead |")
    print("|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} | {100 * (med - base) / base:+.1f} % |")
    if not have_wandb:
        print("W&B: not installed here, not measured", file=sys.stderr)
    recipe = job(os.path.join(args.out, "recipe"), args.steps, args.world, validator__enable=True, validator__freq=2,
                 validator__steps=2, profiler__enable_profiling=True, profiler__profile_freq=5,
                 profiler__profiler_warmup=1, metrics__enable_tensorboard=True, metrics__enable_wandb=have_wandb)
    out = run_forked(_run, args.world, recipe, timeout_s=1800)[0]
    for root, _, files in sorted(os.walk(os.path.join(args.out, "recipe"))):
        for f in sorted(files):
            print(os.path.relpath(os.path.join(root, f), args.out))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no picture", file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(*zip(*out["loss"], strict=True), label="training loss")
    ax.plot(*zip(*out["validation"], strict=True), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("llama3 debugmodel, FSDP 4 on CPU, recipe-like run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "loss.png"), dpi=100)
    print(f"wrote {os.path.join(args.out, 'loss.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
