"""A probe of the real trainer for per-tensor parity checks: each parameter's gradient norm at
step 1 (as the optimizer gets it, unscaled by the clipping coefficient) and each MoE layer's expert bias after every step, by name.

:func:`install` wraps :meth:`Trainer.step` and the trainer's ``clip_grad_norm_`` in this process
(the parent, before it forks the ranks: every rank inherits the wrappers). The norms are the
full, unsharded ones: :func:`~torchtitan_spmd.techniques.grad_norm.parameter_grad_norms`
reduces each local shard's squares over exactly the groups it is sharded over (DTensor
placements, or the representation's groups for ``spmd_types``' plain tensors), so a per-tensor
bug shows even where the global norm and the loss do not (AdamW is nearly invariant to a
constant scale on one tensor's gradient).

A worker wrapped by :func:`probed` returns ``(its result, [TrainerTrace per trainer run in it])``;
:func:`merge` pools the ranks' traces (under pipeline parallelism each stage holds its own
parameters) and checks that ranks holding the same tensor agree.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

#: Module name fragments that wrappers (compile, activation checkpointing, FSDP) add to FQNs.
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


@dataclasses.dataclass
class TrainerTrace:
    """What one trainer recorded: step-1 gradient norms and per-step expert biases, by name."""

    grad_norms: dict[str, float] = dataclasses.field(default_factory=dict)
    expert_bias: list[dict[str, list[float]]] = dataclasses.field(default_factory=list)
    #: The class of the pipeline schedule that ran (None without pipeline parallelism).
    schedule: str | None = None
    #: The microbatches of one schedule iteration (None without pipeline parallelism).
    n_microbatches: int | None = None


_TRACES: list[TrainerTrace] = []
_CURRENT: list[Any] = []  # [trainer, step] while a step runs


def clean_name(fqn: str) -> str:
    """``fqn`` without the wrappers' module names (the names the reference uses)."""
    for w in _WRAPPERS:
        fqn = fqn.replace(w, "")
    return fqn


def _expert_biases(model: Any) -> dict[str, list[float]]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):
            full = buf.full_tensor() if isinstance(buf, DTensor) else buf
            out[clean_name(name)] = [float(v) for v in full.detach().reshape(-1)]
    return out


def install() -> None:
    """Wrap ``Trainer.step`` and ``torchtitan_spmd.train.clip_grad_norm_`` (once: a no-op when they
    are wrapped already, e.g. in a warm rank forked after the launcher's process installed it)."""
    import torch

    import torchtitan_spmd.train as train_module
    from torchtitan_spmd.techniques.grad_norm import parameter_grad_norms

    if getattr(train_module.Trainer.step, "_grad_probe", False):
        return
    step_fn, clip_fn = train_module.Trainer.step, train_module.clip_grad_norm_

    def step(self: Any, step: int) -> Any:
        if step == self.start_step + 1 or not _TRACES:
            pipeline = self.pipeline
            _TRACES.append(TrainerTrace(schedule=None if pipeline is None else type(pipeline.schedule).__name__,
                                        n_microbatches=None if pipeline is None else pipeline.schedule._n_microbatches))
        _CURRENT[:] = [self, step]
        try:
            record = step_fn(self, step)
        finally:
            _CURRENT.clear()
        biases = _expert_biases(self.model)
        if biases:
            _TRACES[-1].expert_bias.append(biases)
        return record

    def clip(parameters: Any, max_norm: float, representation: Any, **kwargs: Any) -> float:
        total = clip_fn(parameters, max_norm, representation, **kwargs)
        if _CURRENT and _CURRENT[1] == 1:
            # What the optimizer gets (after clipping's own reductions), unscaled by the clipping
            # coefficient, which the trainer computes in float32 the same way
            coef = float(torch.clamp(max_norm / (torch.tensor(total, dtype=torch.float32) + 1e-6), max=1.0)) \
                if max_norm > 0 else 1.0
            trainer = _CURRENT[0]
            named = [(clean_name(n), p) for n, p in trainer.model.named_parameters()]
            norms = parameter_grad_norms(named, representation)
            _TRACES[-1].grad_norms = {n: v / coef for n, v in norms.items()}
        return total

    step._grad_probe = True  # type: ignore[attr-defined]
    train_module.Trainer.step = step  # type: ignore[method-assign]
    train_module.clip_grad_norm_ = clip  # type: ignore[assignment]


class _Probed:
    """A worker that returns also the traces of the trainers it ran; it pickles (by the worker's
    name) when the worker does, so a warm world's ranks can run it (torchtitan_spmd.launcher)."""

    def __init__(self, worker: Callable[..., Any]) -> None:
        self.worker = worker
        self.__qualname__ = f"probed({getattr(worker, '__qualname__', worker)})"

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, list[TrainerTrace]]:
        install()
        _TRACES.clear()
        result = self.worker(*args, **kwargs)
        return result, list(_TRACES)


def probed(worker: Callable[..., Any]) -> Callable[..., tuple[Any, list[TrainerTrace]]]:
    """``worker`` returning also the traces of the trainers it ran (the probe is installed first)."""
    return _Probed(worker)


def merge(per_rank: list[list[TrainerTrace]]) -> list[TrainerTrace]:
    """One trace per trainer, pooled over the ranks; a tensor two ranks hold must agree exactly."""
    merged: list[TrainerTrace] = []
    for i in range(max(len(t) for t in per_rank)):
        out = TrainerTrace()
        for rank, traces in enumerate(per_rank):
            if i >= len(traces):
                continue
            if rank and traces[i].schedule != out.schedule:
                raise AssertionError(f"rank {rank} ran schedule {traces[i].schedule}, rank 0 {out.schedule}")
            out.schedule = traces[i].schedule
            out.n_microbatches = traces[i].n_microbatches
            for name, v in traces[i].grad_norms.items():
                if name in out.grad_norms and out.grad_norms[name] != v:
                    raise AssertionError(f"rank {rank}: gradient norm of {name} {v} != {out.grad_norms[name]}")
                out.grad_norms[name] = v
            for s, biases in enumerate(traces[i].expert_bias):
                if s == len(out.expert_bias):
                    out.expert_bias.append({})
                for name, v in biases.items():
                    if name in out.expert_bias[s] and out.expert_bias[s][name] != v:
                        raise AssertionError(f"rank {rank}: {name} after step {s + 1}: {v} != {out.expert_bias[s][name]}")
                    out.expert_bias[s][name] = v
        merged.append(out)
    return merged


#: Relative tolerance of each parameter's gradient norm at step 1 against the reference
#: (measured differences about 1e-7; fp32 against float64).
GRAD_TOL = 1e-5
#: Absolute tolerance of the expert biases (each step moves them by the coefficient, 1e-3).
BIAS_TOL = 1e-6


def compare_grad_norms(got: dict[str, float], ref: dict[str, float], *, what: str = "") -> float:
    """Every parameter's step-1 gradient norm within :data:`GRAD_TOL` (relative) of the reference's;
    the same names on both sides. Returns the largest relative difference."""
    assert set(got) == set(ref), (what, sorted(set(got) ^ set(ref)))
    worst, at = 0.0, ""
    for name, r in ref.items():
        diff = math.inf if not math.isfinite(got[name]) else abs(got[name] - r) / max(abs(r), 1e-12)
        if diff > worst:
            worst, at = diff, name
    assert worst <= GRAD_TOL, (f"{what}: the gradient norm of {at} at step 1 is {got[at]!r}, the reference's "
                               f"{ref[at]!r} ({worst:.2e} relative > {GRAD_TOL:g})")
    return worst


def compare_expert_bias(got: list[dict[str, list[float]]], ref: list[dict[str, list[float]]], *,
                        what: str = "") -> float:
    """Every MoE layer's expert bias after every step run (the reference's first ``len(got)``) within
    :data:`BIAS_TOL` of the reference's."""
    ref = ref[: len(got)]
    assert got and len(got) == len(ref) and all(set(g) == set(r) for g, r in zip(got, ref, strict=True)), \
        (what, got, ref)
    worst = 0.0
    for step, (g, r) in enumerate(zip(got, ref, strict=True), 1):
        for name in r:
            d = max(abs(a - b) for a, b in zip(g[name], r[name], strict=True))
            assert d <= BIAS_TOL, f"{what}: {name} after step {step}: {g[name]} vs the reference's {r[name]}"
            worst = max(worst, d)
    return worst


#: ``pipeline_parallel_schedule`` (lower case) -> the class of torch's that must run it; written
#: out here, not looked up (a name mapped to the wrong schedule must fail).
EXPECTED_SCHEDULES: dict[str, str] = {
    "1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved1f1b": "ScheduleInterleaved1F1B",
    "loopedbfs": "ScheduleLoopedBFS", "interleavedzerobubble": "ScheduleInterleavedZeroBubble",
    "zbvzerobubble": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV",
}


def check_schedules(configs: list[Any], traces: list[TrainerTrace]) -> None:
    """Each pipeline-parallel config ran the schedule class its ``pipeline_parallel_schedule`` names
    (a CSV: torch's ``_PipelineScheduleRuntime``); the others ran none."""
    for cfg, trace in zip(configs, traces, strict=True):
        par = cfg.parallelism
        if par.pipeline_parallel_degree <= 1:
            assert trace.schedule is None, trace.schedule
            continue
        want = ("_PipelineScheduleRuntime" if par.pipeline_parallel_schedule_csv
                else EXPECTED_SCHEDULES[par.pipeline_parallel_schedule.lower()])
        assert trace.schedule == want, (f"pipeline_parallel_schedule={par.pipeline_parallel_schedule!r} "
                                        f"ran {trace.schedule}, expected {want}")
