"""Does auxiliary-loss-free load balancing balance ``qwen3_moe_tiny``? With and without the expert bias.

    python bench/moe_balance_bench.py --steps 50

Each run: ``moe_tiny`` (2 blocks, 8 experts, top-2) on one process, fp32, no AC, seed 0, the
synthetic data, 50 steps, upstream's bias rule (after each step ``expert_bias += coeff *
sign(mean - count)``, centred; the library's :func:`~torchtitan_spmd.techniques.moe.update_expert_bias`)
with ``load_balance_coeff`` 1e-3 (upstream's) against ``None`` (no bias) at the same config:

- ``lr``: the job's learning rate for every parameter (``qwen3_moe_tiny``: 3e-3; upstream's
  ``qwen3_moe_debug``: 3e-4);
- ``gate_lr``: the router gates' own learning rate, through ``optimizer.param_groups`` as
  upstream's ``qwen3_debugmodel_moe_param_groups``: ``.router.gate.`` Adam at ``gate_lr``, the
  rest AdamW at ``lr``;
- ``batch``: the local batch (sequences of 32 tokens).

Per step it reads each block's tokens per expert before the update and prints, at chosen steps,
the max/min ratio of the worse block (``inf``: some expert got no token) and the coefficient of
variation (std/mean) of the counts, both blocks pooled; and over the last 10 steps the median
ratio and the mean coefficient of variation.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch._inductor  # noqa: E402,F401  (imported once in the parent, not per rank)

import torchtitan_spmd.train as train_mod  # noqa: E402
from torchtitan_spmd.launcher import run_forked  # noqa: E402
from torchtitan_spmd.models import qwen3  # noqa: E402
from torchtitan_spmd.models.qwen3 import config_registry  # noqa: E402

SHOW = (1, 5, 10, 20, 30, 40, 50)


def _gate_groups(lr: float, gate_lr: float, weight_decay: float) -> list[dict[str, Any]]:
    """Upstream's ``qwen3_debugmodel_moe_param_groups`` groups, at the job's ``lr``: the router
    gates Adam at ``gate_lr``, everything else AdamW (``optimizer.param_groups``)."""
    return [{"pattern": r"\.router\.gate\.", "optimizer_name": "Adam",
             "optimizer_kwargs": {"lr": gate_lr, "betas": (0.9, 0.95), "eps": 1e-8}},
            {"pattern": ".*", "optimizer_name": "AdamW",
             "optimizer_kwargs": {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": weight_decay}}]


def _worker(rank: int, world: int, steps: int, lr: float, gate_lr: float | None, batch: int,
            coeff: float | None) -> list[list[list[int]]]:
    from torchtitan_spmd.techniques import moe as moe_mod

    qwen3.FLAVORS["moe_tiny"] = dataclasses.replace(qwen3.FLAVORS["moe_tiny"], load_balance_coeff=coeff)
    counts: list[list[list[int]]] = []
    update = moe_mod.update_expert_bias

    def recording_update(model: torch.nn.Module, representation: Any, **kwargs: Any) -> Any:
        counts.append([[int(c) for c in m.tokens_per_expert.tolist()] for m in moe_mod.moe_blocks(model)])
        return update(model, representation, **kwargs)

    train_mod.update_expert_bias = recording_update  # type: ignore[assignment]
    cfg = config_registry.qwen3_moe_tiny()
    cfg.training.steps, cfg.training.device, cfg.training.local_batch_size = steps, "cpu", batch
    cfg.optimizer.lr = lr
    if gate_lr is not None:  # upstream's param groups, through the config
        from torchtitan_spmd.config import ParamGroupConfig

        cfg.optimizer.param_groups = [ParamGroupConfig(**g) for g in _gate_groups(lr, gate_lr, cfg.optimizer.weight_decay)]
    cfg.debug.seed = 0
    cfg.activation_checkpoint.mode = "none"
    train_mod.Trainer(cfg).run()
    return counts


def _ratio(step: list[list[int]]) -> float:
    return max(max(b) / min(b) if min(b) else math.inf for b in step)


def _cv(step: list[list[int]]) -> float:
    flat = torch.tensor([c for b in step for c in b], dtype=torch.float64)
    return float(flat.std(unbiased=False) / flat.mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--configs", default="3e-3:none:2,3e-4:none:2,3e-3:1e-4:2,3e-4:none:8",
                   help="comma-separated lr:gate_lr:batch ('none': no gate group)")
    p.add_argument("--coeff", type=float, default=1e-3)
    args = p.parse_args(argv)
    shown = [s for s in SHOW if s <= args.steps]
    print("| lr | gate lr | batch | load_balance_coeff | " + " | ".join(f"step {s}" for s in shown)
          + " | last 10 steps (median / mean) |")
    print("|" + "---|" * (5 + len(shown)))
    for spec in args.configs.split(","):
        lr_s, gate_s, batch_s = spec.split(":")
        gate_lr = None if gate_s == "none" else float(gate_s)
        for coeff in (args.coeff, None):
            counts = run_forked(_worker, 1, args.steps, float(lr_s), gate_lr, int(batch_s), coeff,
                                timeout_s=3600)[0]
            cells = [f"{_ratio(counts[s - 1]):.2f} / {_cv(counts[s - 1]):.2f}" for s in shown]
            last = counts[-10:]
            tail = f"{statistics.median(_ratio(c) for c in last):.2f} / {statistics.mean(_cv(c) for c in last):.2f}"
            print(f"| {lr_s} | {gate_s} | {batch_s} | {coeff if coeff else 'None'} | " + " | ".join(cells)
                  + f" | {tail} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
