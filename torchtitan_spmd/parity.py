"""Three-way parity report: the same training run under every SPMD backend.

::

    python -m torchtitan_spmd.parity --module llama3 --config llama3_debugmodel \\
        --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2

Runs the job the trainer would (``--module M --config C`` or a legacy
``--job.config_file``, then the usual ``--section.field value`` overrides; with
neither, ``--module llama3 --config llama3_debugmodel``) once per backend --
``default``, ``full_dtensor``, ``spmd_types`` -- on ``--nproc`` ranks, prints the
per-step losses side by side with the largest relative difference from the first
backend, and writes a PNG of the loss curves (``--plot``, needs the optional ``plot`` extra:
``pip install 'torchtitan-spmd[plot]'``; without matplotlib the plot is skipped
with a note).

Launchers:

- ``--launcher fork`` (default): forked CPU ranks over gloo, in this process's
  children; full-precision losses and gradient norms. Without an explicit
  ``--training.device`` the ranks run on CPU.
- ``--launcher torchrun``: one ``torchrun -m torchtitan_spmd.train`` per backend;
  losses parsed from the log lines (6 decimals).

Every backend can start from the same seed checkpoint (``--checkpoint.create_seed_checkpoint``
on one process, then ``--checkpoint.enable --checkpoint.load_only
--checkpoint.initial_load_path DIR/checkpoint/step-0`` here); checkpointing without
``load_only`` is refused, since each backend would resume from the one before it.

Exit status: 0 on success (with or without the plot), 1 if ``--tol`` is given
and exceeded, 2 on a bad config (tyro's exit status for a bad override) or a failed run.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from torchtitan_spmd.config import SPMD_BACKENDS, ConfigManager, JobConfig

__all__ = [
    "BACKENDS",
    "DEFAULT_JOB",
    "ParityResult",
    "collect",
    "format_table",
    "main",
    "max_rel_diff",
    "with_default_job",
    "write_plot",
]

BACKENDS: tuple[str, ...] = tuple(SPMD_BACKENDS)

_STEP_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+0-9.eEnaif]+)\s+grad_norm:\s*([-+0-9.eEnaif]+)")


@dataclass(frozen=True)
class ParityResult:
    """Per-step ``(loss, grad_norm)`` of each backend, in run order."""

    runs: dict[str, list[tuple[float, float]]]
    nproc: int
    description: str

    @property
    def backends(self) -> list[str]:
        return list(self.runs)


def _rel(x: float, ref: float) -> float:
    if math.isnan(x) or math.isnan(ref):
        return math.inf
    return abs(x - ref) / max(abs(ref), 1e-12)


def max_rel_diff(result: ParityResult, index: int = 0) -> float:
    """Largest relative difference of any backend from the first, over all steps.

    ``index`` 0: losses; 1: gradient norms.
    """
    names = result.backends
    base = result.runs[names[0]]
    worst = 0.0
    for name in names[1:]:
        run = result.runs[name]
        if len(run) != len(base):
            return math.inf
        for a, b in zip(run, base, strict=True):
            worst = max(worst, _rel(a[index], b[index]))
    return worst


def format_table(result: ParityResult) -> str:
    """The per-step loss table with each step's and the overall maximum relative difference."""
    names = result.backends
    base = result.runs[names[0]]
    width = max(14, *(len(n) + 2 for n in names))
    head = f"{'step':>5}" + "".join(f"{n:>{width}}" for n in names) + f"{'max rel diff':>15}"
    lines = [head, "-" * len(head)]
    for i in range(max(len(r) for r in result.runs.values())):
        row = f"{i + 1:>5}"
        values = []
        for name in names:
            run = result.runs[name]
            if i < len(run):
                values.append(run[i][0])
                row += f"{run[i][0]:>{width}.8f}"
            else:
                row += f"{'-':>{width}}"
        diff = max((_rel(v, base[i][0]) for v in values[1:]), default=0.0) if i < len(base) else math.inf
        row += f"{diff:>15.2e}"
        lines.append(row)
    lines.append("-" * len(head))
    lines.append(f"max relative difference vs {names[0]}: loss {max_rel_diff(result, 0):.2e}, "
                 f"grad_norm {max_rel_diff(result, 1):.2e}")
    return "\n".join(lines)


def write_plot(result: ParityResult, path: str) -> bool:
    """Write the loss curves to ``path`` (PNG). False, with a note printed, without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, so no plot was written "
              "(install the optional extra: pip install 'torchtitan-spmd[plot]').")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = [("-", 3.5, "o"), ("--", 2.2, "s"), (":", 1.6, "^")]
    for k, (name, run) in enumerate(result.runs.items()):
        ls, lw, marker = styles[k % len(styles)]
        ax.plot(range(1, len(run) + 1), [r[0] for r in run], linestyle=ls, linewidth=lw,
                marker=marker, markersize=4, label=name, alpha=0.85)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{result.description}\nmax relative loss difference {max_rel_diff(result):.1e}",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- running
def _default_nproc(cfg: JobConfig) -> int:
    p = cfg.parallelism
    shard = p.data_parallel_shard_degree if p.data_parallel_shard_degree > 0 else 1
    return (p.data_parallel_replicate_degree * shard * p.context_parallel_degree
            * p.tensor_parallel_degree * p.pipeline_parallel_degree)


#: The job parity runs when the command line names none (``--module``/``--config`` or
#: ``--job.config_file``): the debug model, sized for CPU (upstream's JobConfig defaults,
#: seq_len 2048 x batch 8, are not).
DEFAULT_JOB: tuple[str, ...] = ("--module", "llama3", "--config", "llama3_debugmodel")


def with_default_job(args: Sequence[str]) -> list[str]:
    """``args``, preceded by :data:`DEFAULT_JOB` unless they name a job themselves."""
    named = {a.split("=", 1)[0] for a in args}
    if named & {"--module", "--config", "--job.config_file", "--job.config-file"}:
        return list(args)
    return [*DEFAULT_JOB, *args]


def _typechecks(backend: str) -> bool:
    from torchtitan_spmd.distributed.representation import get_representation

    return get_representation(backend).supports_typechecking


def _backend_config(base: JobConfig, backend: str) -> JobConfig:
    data = base.to_dict()
    data["parallelism"]["spmd_backend"] = backend
    if not _typechecks(backend):
        data["debug"]["spmd_typechecking"] = False
    return JobConfig.from_dict(data)


def _train_rank(rank: int, world: int, cfg: JobConfig) -> list[tuple[float, float]]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    return [(r.loss, r.grad_norm) for r in trainer.run()]


def _run_fork(cfg: JobConfig, nproc: int) -> list[tuple[float, float]]:
    if cfg.debug.deterministic:
        import torch._inductor  # noqa: F401  (deterministic mode imports it: once, before forking)

    import torchtitan_spmd.train  # noqa: F401
    from torchtitan_spmd.launcher import run_forked

    per_rank = run_forked(_train_rank, nproc, cfg, timeout_s=1800)
    for rank, records in enumerate(per_rank):
        if records != per_rank[0]:
            raise RuntimeError(f"rank {rank} logged {records}, rank 0 logged {per_rank[0]}")
    return per_rank[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_torchrun(overrides: Sequence[str], backend: str, nproc: int) -> list[tuple[float, float]]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "torchtitan_spmd.train", *overrides,
        "--parallelism.spmd_backend", backend, "--metrics.log_freq", "1",
    ]
    if not _typechecks(backend):
        cmd.append("--debug.no-spmd_typechecking")
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun ({backend}) exited with {proc.returncode}:\n{text[-4000:]}")
    steps: dict[int, tuple[float, float]] = {}
    for m in _STEP_RE.finditer(text):
        steps[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    if not steps:
        raise RuntimeError(f"torchrun ({backend}) logged no 'step: N loss: X' lines:\n{text[-4000:]}")
    return [steps[k] for k in sorted(steps)]


def collect(base: JobConfig, *, nproc: int, backends: Sequence[str] = BACKENDS,
            launcher: str = "fork", overrides: Sequence[str] = ()) -> ParityResult:
    """Run ``base`` under each backend and collect the per-step losses and gradient norms.

    ``overrides``: the CLI overrides (the torchrun launcher passes them on).
    """
    runs: dict[str, list[tuple[float, float]]] = {}
    for backend in backends:
        print(f"running {backend} on {nproc} rank(s) ({launcher}) ...", flush=True)
        if launcher == "fork":
            runs[backend] = _run_fork(_backend_config(base, backend), nproc)
        elif launcher == "torchrun":
            runs[backend] = _run_torchrun(overrides, backend, nproc)
        else:
            raise ValueError(f"unknown launcher {launcher!r}; use 'fork' or 'torchrun'.")
    p = base.parallelism
    description = (
        f"{base.model.name}/{base.model.flavor}, {nproc} rank(s): dp_replicate={p.data_parallel_replicate_degree} "
        f"dp_shard={p.data_parallel_shard_degree} tp={p.tensor_parallel_degree}"
    )
    return ParityResult(runs=runs, nproc=nproc, description=description)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_spmd.parity",
        allow_abbrev=False,
        description="Run one config under every SPMD backend and compare the losses. "
        "Any other --section.field options configure the run (see python -m torchtitan_spmd.train --help).",
    )
    parser.add_argument("--nproc", type=int, default=None,
                        help="number of ranks (default: the product of the parallel degrees)")
    parser.add_argument("--launcher", choices=("fork", "torchrun"), default="fork",
                        help="fork: CPU ranks forked from this process (default); torchrun: one torchrun per backend")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"comma-separated backends to compare (default {','.join(BACKENDS)})")
    parser.add_argument("--plot", default="parity_loss.png", help="PNG path (default parity_loss.png)")
    parser.add_argument("--no-plot", action="store_true", help="do not write the plot")
    parser.add_argument("--tol", type=float, default=None,
                        help="exit 1 if the maximum relative loss difference exceeds this")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m torchtitan_spmd.parity``; returns the exit status."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if "-h" in args_in or "--help" in args_in:
        parser.print_help()
        return 0
    opts, overrides = parser.parse_known_args(args_in)
    backends = [b.strip() for b in opts.backends.split(",") if b.strip()]
    try:
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown or not backends:
            raise ValueError(f"--backends: unknown {unknown}; choose from {', '.join(BACKENDS)}.")
        overrides = list(overrides)
        if opts.launcher == "fork" and not any(a.replace("-", "_").startswith("--training.device")
                                               for a in overrides):
            overrides += ["--training.device", "cpu"]  # forked ranks talk gloo
        overrides = with_default_job(overrides)
        # The base config names a type-checking backend (each run sets its own), so
        # that --debug.spmd_typechecking does not warn about the default backend.
        typed = next(b for b in BACKENDS if _typechecks(b))
        base = ConfigManager().parse_args([*overrides, "--parallelism.spmd_backend", typed])
        if base.checkpoint.enable and not base.checkpoint.load_only:
            raise ValueError("--checkpoint.enable without --checkpoint.load_only: each backend would resume from "
                             "the checkpoints the one before it saved. Add --checkpoint.load_only (e.g. with "
                             "--checkpoint.initial_load_path DIR/checkpoint/step-0, a seed checkpoint).")
        nproc = opts.nproc if opts.nproc is not None else _default_nproc(base)
        if nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {nproc}.")
    except (ValueError, TypeError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SystemExit as err:  # tyro has reported a bad override
        return int(err.code or 0)
    try:
        result = collect(base, nproc=nproc, backends=backends, launcher=opts.launcher,
                         overrides=overrides)
    except Exception as err:  # noqa: BLE001 - report any failed run with its output
        print(f"error: a run failed: {err}", file=sys.stderr)
        return 2
    print(format_table(result))
    if not opts.no_plot and write_plot(result, opts.plot):
        print(f"wrote {opts.plot}")
    worst = max_rel_diff(result)
    if opts.tol is not None and not worst <= opts.tol:
        print(f"FAIL: max relative loss difference {worst:.2e} > --tol {opts.tol:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
