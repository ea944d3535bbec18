"""Helpers for the packed-documents tests (``attn_mask_type="block_causal"``): the job, a run on
forked gloo ranks and the independent reference (:mod:`torchtitan_spmd.reference`, which restates
the block-causal mask, the per-document RoPE positions and the boundary-label rule itself).

Windows of 128 tokens of the built-in data hold two to four documents each (one to three EOS).
"""

from __future__ import annotations

import functools
from typing import Any

import grad_probe
from parity_helpers import NORM_TOL, TOL, job_config, max_rel, run_config

from torchtitan_spmd.config import JobConfig

#: Tokens per window: several documents each.
SEQ_LEN = 128
STEPS = 3
LOCAL_BATCH = 2
FLAVOR = "tiny_block_causal"


def packed_config(backend: str, parallelism: dict[str, Any], *, model: str = "llama3", flavor: str = FLAVOR,
                  local_batch: int = LOCAL_BATCH, steps: int = STEPS, **debug: Any) -> JobConfig:
    """The parity job on packed documents: ``flavor`` (block-causal), 128-token windows."""
    cfg = job_config(backend, parallelism, local_batch=local_batch, steps=steps, model=model, **debug)
    cfg.model.flavor = flavor
    cfg.training.seq_len = SEQ_LEN
    return cfg


@functools.cache
def packed_reference(global_batch: int, model: str = "llama3", flavor: str = FLAVOR) -> tuple[Any, Any]:
    """Per-step ``(loss, grad_norm)`` and the step-1 trace of the reference on the same batches (cached)."""
    from torchtitan_spmd.reference import ReferenceTrace, run_reference

    cfg = packed_config("default", {"data_parallel_shard_degree": 1}, model=model, flavor=flavor,
                        local_batch=global_batch)
    trace = ReferenceTrace()
    return tuple(run_reference(cfg, global_batch=global_batch, trace=trace)), trace


def check_packed_parity(got: Any, global_batch: int, what: str, *, model: str = "llama3") -> tuple[float, float]:
    """Loss (``TOL``), gradient norm (``NORM_TOL``) and every parameter's step-1 gradient norm
    (``grad_probe.GRAD_TOL``) of ``got`` (a parity :class:`~parity_helpers.Run`) against the reference."""
    ref, trace = packed_reference(global_batch, model)
    assert got.trace is not None and got.trace.grad_norms, f"{what}: no gradient norms recorded"
    grad_probe.compare_grad_norms(got.trace.grad_norms, trace.grad_norms, what=what)
    loss, norm = [g[0] for g in got], [g[1] for g in got]
    ref_loss, ref_norm = [r[0] for r in ref], [r[1] for r in ref]
    assert max_rel(loss, ref_loss) < TOL, (what, loss, ref_loss)
    assert max_rel(norm, ref_norm) < NORM_TOL, (what, norm, ref_norm)
    return max_rel(loss, ref_loss), max_rel(norm, ref_norm)


__all__ = ["FLAVOR", "LOCAL_BATCH", "SEQ_LEN", "STEPS", "check_packed_parity", "packed_config", "packed_reference",
           "run_config"]
