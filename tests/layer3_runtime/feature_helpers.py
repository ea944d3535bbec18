"""Helpers for the training-feature tests: one FSDP 2 x TP 2 job, run with one feature changed.

Every run is the real Trainer on 4 forked gloo ranks, the tiny Llama, deterministic,
with the parity harness's config (``parity_helpers.job_config``: fp32, no activation
checkpointing, eager). The runs of a backend are compared with its own baseline run
(:func:`baseline`, cached), which shares no code path with the feature under test
except what the feature leaves alone.
"""

from __future__ import annotations

import functools
from typing import Any

from parity_helpers import job_config, max_rel, warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

__all__ = [
    "AC_TOL",
    "BF16_TOL",
    "LOCAL_BATCH",
    "PARALLELISM",
    "STEPS",
    "WORLD",
    "baseline",
    "check_accumulation",
    "check_activation_checkpointing",
    "check_bf16",
    "check_compile",
    "feature_config",
    "losses_and_norms",
    "max_rel",
    "run_steps",
    "tiny_job",
]

WORLD = 4
PARALLELISM: dict[str, Any] = {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}
#: Steps of the schedule (the learning rate depends on it); runs may stop earlier.
STEPS = 6
LOCAL_BATCH = 2


def feature_config(backend: str, **fields: Any) -> JobConfig:
    """The baseline job of ``backend`` with ``section__field=value`` overrides."""
    cfg = job_config(backend, PARALLELISM, local_batch=LOCAL_BATCH, steps=STEPS)
    for key, value in fields.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    cfg.validate()
    return cfg


def _worker(rank: int, world: int, cfg: JobConfig, steps: int, probe: str | None) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    extra: dict[str, Any] = {}
    if probe is not None:  # "module:function", e.g. "probes:dtypes" (tests/layer3_runtime/probes.py)
        import importlib

        module, _, name = probe.partition(":")
        extra = getattr(importlib.import_module(module), name)(trainer)
    records = [trainer.step(step) for step in range(1, steps + 1)]
    out: dict[str, Any] = {"records": [(r.loss, r.grad_norm) for r in records]}
    if probe is not None:
        out["probe"] = extra.get("result", lambda: None)()
    return out


def run_steps(cfg: JobConfig, steps: int, *, probe: str | None = None,
              timeout_s: float = 600, world: int = WORLD) -> dict[str, Any]:
    """Run ``steps`` steps of ``cfg`` on ``world`` ranks (:data:`WORLD`); rank 0's result.

    ``records``: per-step ``(loss, grad_norm)``, which every rank must agree on;
    ``probe``: what the observer ``"module:function"`` (e.g. ``"probes:dtypes"``)
    collected on rank 0.
    """
    warm_parent()
    per_rank = run_forked(_worker, world, cfg, steps, probe, timeout_s=timeout_s)
    for rank, result in enumerate(per_rank):
        if result["records"] != per_rank[0]["records"]:
            raise AssertionError(f"rank {rank} logged {result['records']}, rank 0 {per_rank[0]['records']}")
    return per_rank[0]


@functools.cache
def baseline(backend: str, steps: int = STEPS) -> tuple[tuple[float, float], ...]:
    """``backend``'s fp32, eager, no-checkpointing, no-accumulation run (cached)."""
    return tuple(run_steps(feature_config(backend), steps)["records"])


def losses_and_norms(records: Any) -> tuple[list[float], list[float]]:
    """``([loss...], [grad_norm...])`` of per-step records."""
    return [r[0] for r in records], [r[1] for r in records]


# -------------------------------------------------------------------------------------
# The checks, one per feature; each layer's test file runs them for its backends.
# -------------------------------------------------------------------------------------
#: Steps each feature runs (of the STEPS-step schedule).
AC_STEPS, ACCUM_STEPS, COMPILE_STEPS, BF16_STEPS = 2, 2, 2, STEPS
AC_TOL, ACCUM_TOL, COMPILE_TOL, BF16_TOL = 1e-6, 1e-5, 1e-4, 3e-2


def _compare(records: Any, ref: Any, tol: float) -> tuple[float, float]:
    loss, norm = losses_and_norms(records)
    ref_loss, ref_norm = losses_and_norms(ref[: len(records)])
    rel_loss, rel_norm = max_rel(loss, ref_loss), max_rel(norm, ref_norm)
    assert rel_loss <= tol, (loss, ref_loss)
    assert rel_norm <= tol, (norm, ref_norm)
    return rel_loss, rel_norm


def check_activation_checkpointing(backend: str, mode: str, *,
                                   probe: str = "probes:block_calls") -> tuple[float, float]:
    """``mode`` changes neither loss nor grad norm (fp32), and the blocks really recompute:
    ``probe`` counts 2 runs of the first block per step (forward and recompute)."""
    got = run_steps(feature_config(backend, activation_checkpoint__mode=mode), AC_STEPS, probe=probe)
    # Every block runs twice per step: in forward and again in backward (recompute).
    assert got["probe"] == [2] * AC_STEPS, got["probe"]
    return _compare(got["records"], baseline(backend), AC_TOL)


def check_compile(backend: str, compile_backend: str, components: list[str]) -> tuple[float, float]:
    """Compiled blocks (and loss) match the eager run within COMPILE_TOL over COMPILE_STEPS (2: under
    inductor, ``default`` failed in the second step's backward, "Sharding propagation failed for
    aten.detach.default(Spec(f32[64](None)))", while the first passed), and Dynamo compiled."""
    cfg = feature_config(backend, compile__enable=True, compile__backend=compile_backend,
                         compile__components=components)
    got = run_steps(cfg, COMPILE_STEPS, probe="probes:compiled_graphs")
    # at least one graph for the blocks (they share their code) and one for the loss
    want = 1 + ("loss" in components)
    assert got["probe"]["graphs"] >= want, f"Dynamo captured {got['probe']['graphs']} graph(s), expected >= {want}"
    # and nothing compiled twice: a block that recompiles per layer hits Dynamo's recompile limit
    # (8), which fullgraph=True makes a hard failure at the ninth block (found: the plan's hooks
    # formatted their block's name, and Dynamo guarded on it)
    assert not got["probe"]["recompiles"], got["probe"]["recompiles"]
    return _compare(got["records"], baseline(backend), COMPILE_TOL)


def check_bf16(backend: str) -> tuple[float, float]:
    """bf16 compute through FSDP's MixedPrecisionPolicy: within BF16_TOL of fp32 over 6 steps,
    measurably not fp32, and loss, parameters and optimizer state stay fp32."""
    got = run_steps(feature_config(backend, training__mixed_precision_param="bfloat16"), BF16_STEPS,
                    probe="probes:dtypes")
    assert got["probe"] == {
        "matmul_outputs": ["torch.bfloat16"], "loss": ["torch.float32"],
        "params": ["torch.float32"], "optimizer_state": ["torch.float32"],
    }, got["probe"]
    ref = baseline(backend)
    rel = _compare(got["records"], ref, BF16_TOL)
    assert rel[0] > 1e-5, f"bf16 losses equal fp32's to {rel[0]:.1e}: bf16 did not take effect"
    return rel


def check_accumulation(backend: str) -> tuple[float, float]:
    """2 microbatches of 1 sequence per rank match the baseline's 2-sequence batch; FSDP
    reduces only after the last microbatch."""
    cfg = feature_config(backend, training__local_batch_size=LOCAL_BATCH // 2,
                         training__global_batch_size=LOCAL_BATCH * (WORLD // 2))
    got = run_steps(cfg, ACCUM_STEPS, probe="probes:gradient_sync")
    # (sync on?, any gradient already reduced into the sharded parameters?) per microbatch
    assert got["probe"] == [(False, False), (True, False)] * ACCUM_STEPS, got["probe"]
    return _compare(got["records"], baseline(backend), ACCUM_TOL)


def tiny_job(folder: str, *, steps: int = 2, **over: Any) -> JobConfig:
    """The run-feature tests' job: llama3 ``tiny`` on FSDP 2, ``steps`` steps of 2 x 16 tokens, fp32,
    no activation checkpointing, lr 1e-2 after 1 warm-up step, seed 7, dumping into ``folder``;
    ``over``: ``section__field=value`` overrides (``optimizer__lr=0.1``)."""
    cfg: dict[str, Any] = {
        "job": {"dump_folder": folder},
        "model": {"name": "llama3", "flavor": "tiny"},
        "training": {"steps": steps, "local_batch_size": 2, "seq_len": 16, "device": "cpu",
                     "mixed_precision_param": "float32"},
        "activation_checkpoint": {"mode": "none"},
        "optimizer": {"lr": 1e-2},
        "lr_scheduler": {"warmup_steps": 1},
        "parallelism": {"data_parallel_shard_degree": 2},
        "debug": {"seed": 7},
    }
    for key, value in over.items():
        section, name = key.split("__")
        cfg.setdefault(section, {})[name] = value
    return JobConfig.from_dict(cfg)
