"""Helpers for the layer-4 (spmd_types) tests: typed/untyped parity runs on forked gloo ranks.

Reuses the layer-3 parity harness (configs, the deterministic job config and the
cached independent reference) from ``tests/layer3_runtime/parity_helpers.py``.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

_LAYER3 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "layer3_runtime")
if _LAYER3 not in sys.path:
    sys.path.insert(0, _LAYER3)

from parity_helpers import (  # noqa: E402
    LOCAL_BATCH,
    PARITY_CONFIGS,
    SEQ_LEN,
    STEPS,
    data_parallel_degree,
    job_config,
    max_rel,
    reference,
    run_config,
    warm_parent,
)
from version_helpers import requires_torch, torch_at_least  # noqa: E402

import torchtitan_spmd.distributed.representations.spmd_types  # noqa: E402,F401  (import once, before forking)
from torchtitan_spmd.launcher import run_forked  # noqa: E402

__all__ = [
    "LOCAL_BATCH",
    "PARITY_CONFIGS",
    "SEQ_LEN",
    "STEPS",
    "data_parallel_degree",
    "job_config",
    "max_rel",
    "reference",
    "run_config",
    "in_child",
    "requires_torch",
    "run_mixed",
    "torch_at_least",
    "warm_parent",
]


def _train_mixed(rank: int, world: int, cfg: Any, typed_steps: int) -> list[tuple[float, float, float, bool]]:
    """Train ``cfg`` with the first ``typed_steps`` steps under the spmd_types checker.

    Returns per step ``(loss, grad_norm, seconds, typed)``; ``typed`` is whether the
    checker was observed active when the model's forward started.
    """
    from torchtitan_spmd.distributed.utils import get_train_context
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    pd = trainer.parallel_dims
    par = cfg.parallelism

    def context(typed: bool):  # noqa: ANN202
        return get_train_context(
            enable_loss_parallel=pd.tp_enabled and not par.disable_loss_parallel,
            parallel_dims=pd,
            spmd_typechecking=typed,
        )

    import spmd_types

    seen: list[bool] = []
    # Observe, not assume, that the checker is on during the forward.
    trainer.model.register_forward_pre_hook(lambda *_: seen.append(spmd_types.is_type_checking()))
    out = []
    for step in range(1, cfg.training.steps + 1):
        trainer.train_context = context(step <= typed_steps)
        seen.clear()
        start = time.perf_counter()
        record = trainer.step(step)
        out.append((record.loss, record.grad_norm, time.perf_counter() - start, seen == [True]))
    return out


def run_mixed(cfg: Any, world: int, typed_steps: int) -> list[tuple[float, float, float, bool]]:
    """Per-step ``(loss, grad_norm, seconds, typed)`` (rank 0's timings); ranks must agree on values."""
    warm_parent()
    import grad_probe
    import spmd_types.checker  # noqa: F401  (the checker's imports, once, before forking)
    import torch.distributed.fsdp  # noqa: F401
    from parity_helpers import with_trace

    results = run_forked(grad_probe.probed(_train_mixed), world, cfg, typed_steps, timeout_s=300)
    per_rank = [r for r, _ in results]
    values = [[(r[0], r[1]) for r in records] for records in per_rank]
    for rank, v in enumerate(values):
        if v != values[0]:
            raise AssertionError(f"rank {rank} logged {v}, rank 0 logged {values[0]}")
    run = with_trace(per_rank[0], [t for _, t in results])
    grad_probe.check_schedules([cfg], [run.trace])
    return run


def in_child(fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0) -> Any:
    """Run ``fn(*args)`` in a forked child and return its (picklable) result.

    For single-process tests that run a backward after FakeTensorMode/DTensor
    sharding propagation (the spmd_types checker's global mode uses both): torch
    then refuses autograd in every process forked later from this one ("Unable to
    handle autograd's threading in combination with fork-based multiprocessing"),
    which would break the forked-rank tests that run after them in the session.
    A failure in the child is re-raised here with the child's traceback.
    """
    import select

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_fd)
        try:
            import torch

            # The parent's OpenMP pool does not survive fork: stay single-threaded.
            torch.set_num_threads(1)
            payload = pickle.dumps(("ok", fn(*args)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            payload = pickle.dumps(("error", traceback.format_exc()))
        with os.fdopen(write_fd, "wb") as f:
            f.write(payload)
        os._exit(0)
    os.close(write_fd)
    chunks = []
    deadline = time.monotonic() + timeout_s
    with os.fdopen(read_fd, "rb") as f:
        while True:
            ready, _, _ = select.select([f], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise TimeoutError(f"child did not finish within {timeout_s:.0f} s")
            chunk = f.read1(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    os.waitpid(pid, 0)
    if not chunks:
        raise AssertionError("child exited without a result")
    status, value = pickle.loads(b"".join(chunks))
    if status == "error":
        raise AssertionError(f"in the forked child:\n{value}")
    return value
