"""The dry run's estimates against real runs (issue 36), on layouts that run here (4 gloo ranks).

    PYTHONPATH=.:tests/layer3_runtime python bench/dry_run_estimates.py [--comm]

llama3 ``debugmodel`` (seq 256, local batch 2, fp32) on FSDP 4, FSDP 2 x TP 2 and PP 2 x FSDP 2
(AC none and full), and qwen3 ``moe_tiny`` on FSDP 4 x EP 4. Per layout: the dry run's per-rank
parameter/gradient/optimizer bytes and activation estimate, beside the real run's (rank 0; the
real run's bytes from its tensors, its activations from saved-tensor hooks over one microbatch,
see ``tests/layer3_runtime/dry_run_helpers.py``; not measured under PP). ``--comm``: the bytes
sent a step per mesh axis instead, against the real second step's collectives (the same models).
"""

from __future__ import annotations

import sys

from dry_run_helpers import measure
from moe_helpers import moe_config
from parity_helpers import job_config

from torchtitan_spmd.launcher import run_isolated
from torchtitan_spmd.train import dry_run as _dry_run


def dry_run(cfg, world: int):  # noqa: ANN001, ANN201
    """The trainer's dry run in an isolated child (launcher.run_isolated): its meta backward starts
    autograd's threads, after which this process could not fork the real runs' ranks."""
    return run_isolated(_dry_run, cfg, world, timeout_s=1800)

LAYOUTS = {
    "fsdp4": {"data_parallel_shard_degree": 4},
    "fsdp2_tp2": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
    "pp2_fsdp2": {"data_parallel_shard_degree": 2, "pipeline_parallel_degree": 2},
}


def _config(layout: str, ac: str):  # noqa: ANN202
    if layout == "fsdp4_ep4":
        cfg = moe_config("default", "fsdp4")
        cfg.parallelism.expert_parallel_degree = 4
    else:
        cfg = job_config("default", LAYOUTS[layout])
        cfg.model.flavor = "debugmodel"
        cfg.training.seq_len = 256
    cfg.activation_checkpoint.mode = ac
    cfg.training.steps = 1
    cfg.validate()
    return cfg


def comm_table() -> None:
    """The bytes sent a step per mesh axis: the dry run's estimate against the real second step's
    collectives (every rank; the table shows each role's first rank and the worst rank's error)."""
    print("| layout | rank | axis | estimate B | measured B | error | worst error over ranks |")
    print("|---|---|---|---|---|---|---|")
    for layout in [*LAYOUTS, "fsdp4_ep4", "fsdp4_ep2"]:
        cfg = _config("fsdp4_ep4" if layout.startswith("fsdp4_ep") else layout, "none")
        cfg.parallelism.expert_parallel_degree = int(layout[-1]) if layout.startswith("fsdp4_ep") else 1
        if layout not in LAYOUTS:
            cfg.validate()
        report = dry_run(cfg, 4)
        real = measure(cfg, 4)
        for role in report.roles:
            mine = [r for r in real if (role.stages or [0])[0] == r["pp_rank"]]
            first = next(r for r in mine if r["rank"] == role.rank)
            for axis, nbytes in sorted(first["comm"].items()):
                est = role.comm_bytes_per_step.get(axis, 0)
                worst = max((abs(est / r["comm"][axis] - 1) for r in mine), default=0.0)
                print(f"| {layout} | {role.rank} | {axis} | {est:,} | {nbytes:,} | {est / nbytes - 1:+.2%} | "
                      f"{worst:.2%} |", flush=True)


def main() -> None:
    """Print the table (markdown)."""
    if "--comm" in sys.argv:
        comm_table()
        return
    print("| layout | AC | params B (dry = real) | grads B | optimizer B | activations: estimate | measured | error |")
    print("|---|---|---|---|---|---|---|---|")
    runs = [(layout, "none") for layout in [*LAYOUTS, "fsdp4_ep4"]] + [("fsdp4", "full"), ("fsdp2_tp2", "full")]
    for layout, ac in runs:
        cfg = _config(layout, ac)
        role = dry_run(cfg, 4).roles[0]
        real = next(r for r in measure(cfg, 4) if r["pp_rank"] == (role.stages or [0])[0])
        same = (role.param_bytes, role.grad_bytes, role.optimizer_bytes) == (
            real["param_bytes"], real["grad_bytes"], real["optimizer_bytes"])
        saved = real["saved_bytes"]
        err = f"{role.activation_bytes / saved - 1:+.1%}" if saved and role.activation_bytes else "-"
        print(f"| {layout} | {ac} | {role.param_bytes:,} ({'=' if same else '!= ' + str(real['param_bytes'])}) | "
              f"{real['grad_bytes']:,} | {real['optimizer_bytes']:,} | {role.activation_bytes:,} | "
              f"{saved if saved is not None else 'not measured (PP)'} | {err} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
