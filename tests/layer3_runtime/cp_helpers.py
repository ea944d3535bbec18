"""Helpers for the context-parallel tests (layers 3 and 4): configs and the parity check.

The reference is :func:`parity_helpers.reference`: the independent float64 restatement of
the model (:mod:`torchtitan_spmd.reference`) on full sequences (positions ``0 .. seq-1``,
a dense causal softmax), on the same global batch.
"""

from __future__ import annotations

from typing import Any

from parity_helpers import LOCAL_BATCH, NORM_TOL, job_config, max_rel, reference

#: name -> (world size, parallelism overrides)
CP_CONFIGS: dict[str, tuple[int, dict[str, Any]]] = {
    "cp2": (2, {"data_parallel_shard_degree": 1, "context_parallel_degree": 2}),
    "cp4": (4, {"data_parallel_shard_degree": 1, "context_parallel_degree": 4}),
    "cp2_tp2": (4, {"data_parallel_shard_degree": 1, "context_parallel_degree": 2, "tensor_parallel_degree": 2}),
    "fsdp2_cp2": (4, {"data_parallel_shard_degree": 2, "context_parallel_degree": 2}),
}

#: The parity cells each backend runs: (layout, rotate method, model family). Every layout,
#: each rotate method and each family appears under each backend, and each layout meets
#: both rotate methods and both families over the two backends (8 runs, not 32).
CP_CELLS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "full_dtensor": (("cp2", "allgather", "llama3"), ("cp4", "alltoall", "qwen3"),
                     ("cp2_tp2", "alltoall", "llama3"), ("fsdp2_cp2", "allgather", "qwen3")),
    "spmd_types": (("cp2", "alltoall", "qwen3"), ("cp4", "allgather", "llama3"),
                   ("cp2_tp2", "allgather", "qwen3"), ("fsdp2_cp2", "alltoall", "llama3")),
}

CP_STEPS = 5
TOL = 1e-5


def cp_job_config(backend: str, config_name: str, *, model: str = "llama3", **overrides: Any) -> Any:
    """The deterministic parity config of ``CP_CONFIGS[config_name]`` (5 steps) of family ``model``;
    ``overrides`` go to the parallelism section (e.g. ``context_parallel_load_balancer=None``)."""
    _, parallelism = CP_CONFIGS[config_name]
    debug = {"spmd_typechecking": True} if backend == "spmd_types" else {}
    return job_config(backend, {**parallelism, **overrides}, steps=CP_STEPS, model=model, **debug)


def global_batch(config_name: str) -> int:
    """The global batch of a CP run: the local batch times the data-parallel degree
    (context-parallel ranks share their rows, each holding a slice of every sequence)."""
    world, par = CP_CONFIGS[config_name]
    dp = world // (par.get("tensor_parallel_degree", 1) * par["context_parallel_degree"])
    return LOCAL_BATCH * dp


def check_cp_parity(got: list[tuple[Any, ...]], config_name: str, *, model: str = "llama3") -> tuple[float, float]:
    """Assert per-step ``(loss, grad_norm, ...)`` within ``TOL`` of the independent reference
    (float64, full sequences) and that the model trained; returns the largest relative
    differences (loss, grad norm)."""
    ref = reference(global_batch(config_name), steps=CP_STEPS, model=model)
    loss, norm = [g[0] for g in got], [g[1] for g in got]
    ref_loss, ref_norm = [r[0] for r in ref], [r[1] for r in ref]
    assert max_rel(loss, ref_loss) < TOL, (loss, ref_loss)
    # qwen3's norm spike: float32 alone is ~1e-5 off there (parity_helpers.NORM_TOL).
    assert max_rel(norm, ref_norm) < (TOL if model == "llama3" else NORM_TOL), (norm, ref_norm)
    assert loss[-1] < loss[0] - 0.1  # it trains (guards against a frozen or no-op model)
    return max_rel(loss, ref_loss), max_rel(norm, ref_norm)


#: The sequence of the no-mask check: S x S/cp = 131072 elements at cp 2, above every tensor a
#: step of the tiny model needs (the largest, the logits, is [1, 256, 320] = 81920).
MASK_SEQ = 512


def largest_step_tensor(rank: int, world: int, cfg: Any) -> tuple[int, str]:
    """``(numel, op)`` of the largest tensor any op returns in one training step (forward,
    loss and backward) of ``cfg`` on this rank, counted by a ``TorchDispatchMode``; a DTensor
    counts its local shard (what is allocated)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from torchtitan_spmd.train import Trainer

    class Largest(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.best = (0, "")

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    n = (t._local_tensor if isinstance(t, DTensor) else t).numel()
                    if n > self.best[0]:
                        self.best = (n, str(func))
            return out

    trainer = Trainer(cfg)
    mode = Largest()
    with mode:
        trainer.step(1)
    trainer.close()
    return mode.best


def mask_job_config(backend: str) -> Any:
    """One step of the tiny llama3 at ``MASK_SEQ`` tokens over cp 2 (batch 1)."""
    cfg = cp_job_config(backend, "cp2")
    cfg.training.seq_len, cfg.training.local_batch_size, cfg.training.steps = MASK_SEQ, 1, 1
    cfg.debug.spmd_typechecking = False
    return cfg


def check_no_sequence_squared_tensor(backend: str) -> tuple[int, str]:
    """Assert that no op of a cp 2 step at ``MASK_SEQ`` tokens under ``backend`` returns a tensor
    of ``S x S/cp`` elements (the old additive mask was ``[S/cp, S]``); returns rank 0's largest."""
    from parity_helpers import warm_parent

    from torchtitan_spmd.launcher import run_forked

    warm_parent()
    per_rank = run_forked(largest_step_tensor, 2, mask_job_config(backend), timeout_s=300)
    limit = MASK_SEQ * MASK_SEQ // 2
    for numel, op in per_rank:
        assert 0 < numel < limit, (numel, op, limit)
    return per_rank[0]
