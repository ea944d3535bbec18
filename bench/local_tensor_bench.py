"""``comm.mode="local_tensor"`` against the multi-process run (issue 36): each layout trained for
2 steps both ways, every step's loss and gradient norm side by side, and both wall times.

    PYTHONPATH=.:tests/layer3_runtime python bench/local_tensor_bench.py [backend ...]

llama3 ``debugmodel`` (8 KV heads: TP up to 8), seq 32, local batch 2, fp32; the multi-process
run on forked gloo ranks (tests/layer3_runtime/parity_helpers.py's harness), the simulation in a
forked child (it runs autograd, after which this process could not fork the ranks).
"""

from __future__ import annotations

import multiprocessing
import sys
import time

from parity_helpers import _train, job_config, warm_parent

from torchtitan_spmd.launcher import run_forked


def _simulated(cfg, world: int) -> list[tuple[float, float]]:  # noqa: ANN001
    from torchtitan_spmd.dry_run import run_local_tensor
    from torchtitan_spmd.train import SETUP_PHASES

    return [(r.loss, r.grad_norm) for r in run_local_tensor(cfg, world, SETUP_PHASES)]


def main() -> None:
    """Print the table (markdown)."""
    backends = sys.argv[1:] or ["default"]
    warm_parent()
    print("| backend | TP | step | loss: simulated | multi-process | grad norm: simulated | multi-process | "
          "max rel. difference | wall: simulated (s) | multi-process (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for backend in backends:
        for tp in (2, 4, 8):
            cfg = job_config(backend, {"data_parallel_shard_degree": 1, "tensor_parallel_degree": tp}, steps=2)
            cfg.model.flavor = "debugmodel"
            cfg.validate()
            start = time.perf_counter()
            with multiprocessing.get_context("fork").Pool(1) as pool:
                simulated = pool.apply(_simulated, (cfg, tp))
            sim_s = time.perf_counter() - start
            start = time.perf_counter()
            real = run_forked(_train, tp, cfg, timeout_s=600)[0]
            real_s = time.perf_counter() - start
            for step, ((loss, norm), (rl, rn)) in enumerate(zip(simulated, real, strict=True), 1):
                diff = max(abs(loss / rl - 1), abs(norm / rn - 1))
                print(f"| {backend} | {tp} | {step} | {loss:.7f} | {rl:.7f} | {norm:.6f} | {rn:.6f} | {diff:.1e} | "
                      f"{sim_s:.1f} | {real_s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
