"""Parity report: the same training run under every SPMD backend, against an independent reference.

::

    python -m torchtitan_spmd.parity --module llama3 --config llama3_debugmodel \\
        --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2

Runs the job the trainer would (``--module M --config C`` or a legacy
``--job.config_file``, then the usual ``--section.field value`` overrides; with
neither, ``--module llama3 --config llama3_debugmodel``) once per backend --
``default``, ``full_dtensor``, ``spmd_types`` -- on ``--nproc`` ranks, and once in
:mod:`torchtitan_spmd.reference`: the model restated in plain PyTorch from the same
initial weights, ``torch.optim.AdamW`` and the schedule's closed form, on the same
global batches, in float64, sharing no runtime code with the trainer. It prints the
per-step losses and gradient norms side by side with each step's largest relative
difference from the reference, and writes a PNG of both curves (``--plot``, default
``<job.dump_folder>/parity_loss.png``; needs the optional ``plot`` extra:
``pip install -e ".[plot]"``; without matplotlib the plot is skipped
with a note). ``--no-reference`` compares the backends with the first one instead
(for a family the reference does not restate).

Launchers:

- ``--launcher fork`` (default): forked CPU ranks over gloo, in this process's
  children; full-precision losses and gradient norms. Without an explicit
  ``--training.device`` the ranks run on CPU.
- ``--launcher torchrun``: one ``torchrun -m torchtitan_spmd.train`` per backend;
  losses parsed from the log lines (6 decimals, gradient norms 4).

Every backend can start from the same seed checkpoint (``--checkpoint.create_seed_checkpoint``
on one process, then ``--checkpoint.enable --checkpoint.load_only
--checkpoint.initial_load_path DIR/checkpoint/step-0`` here); checkpointing without
``load_only`` is refused, since each backend would resume from the one before it.

``--tol`` gates the loss and ``--grad-norm-tol`` (default: ``--tol``) the gradient
norm, each as the largest relative difference from the baseline over all steps. A NaN
or infinity anywhere (the reference's included) and a run with another number of
steps than ``training.steps`` always fail, with or without a tolerance.

Exit status: 0 on success; 1 if the gate fails (see :func:`gate`); 2 on a bad
config or argument (tyro's exit status for a bad override; an unwritable ``--plot``
path is reported before anything runs), a failed run, or a plot that could not be written.
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
from dataclasses import dataclass, field

from torchtitan_spmd._errors import install_hint
from torchtitan_spmd.config import SPMD_BACKENDS, ConfigManager, JobConfig
from torchtitan_spmd.config.manager import LIBRARY_FIRST

__all__ = [
    "BACKENDS",
    "DEFAULT_JOB",
    "PLOT_NAME",
    "REFERENCE",
    "ParityResult",
    "collect",
    "format_table",
    "gate",
    "main",
    "max_rel_diff",
    "plot_path",
    "with_default_job",
    "write_plot",
]

BACKENDS: tuple[str, ...] = tuple(SPMD_BACKENDS)

#: The name of the reference's column.
REFERENCE = "reference"

#: The plot's file name under ``job.dump_folder`` (or under a ``--plot`` directory).
PLOT_NAME = "parity_loss.png"

_LOADED_RE = re.compile(r"checkpoint: loaded (\S+) \(")
_STEP_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+0-9.eEnaif]+)\s+grad_norm:\s*([-+0-9.eEnaif]+)")

_METRICS = ("loss", "grad_norm")


@dataclass(frozen=True)
class ParityResult:
    """Per-step ``(loss, grad_norm)`` of each run, in run order; the first is the baseline."""

    runs: dict[str, list[tuple[float, float]]]
    nproc: int
    description: str
    steps: int | None = None
    """The number of steps every run must have (``training.steps``); None: the baseline's."""
    loaded: dict[str, str | None] = field(default_factory=dict)
    """Per backend run, the checkpoint it started from (its path as the trainer logged it), or
    None when it loaded none; empty when the launcher could not tell."""

    @property
    def backends(self) -> list[str]:
        """The names of the runs (the baseline first)."""
        return list(self.runs)

    @property
    def baseline(self) -> str:
        """The run the others are compared with (the reference, when it ran)."""
        return next(iter(self.runs))


def _rel(x: float, ref: float) -> float:
    """Relative difference; a NaN or an infinity on either side is infinitely far (never a match)."""
    if not (math.isfinite(x) and math.isfinite(ref)):
        return math.inf
    return abs(x - ref) / max(abs(ref), 1e-12)


def _worst(run: list[tuple[float, float]], base: list[tuple[float, float]], index: int) -> tuple[float, int]:
    """The largest relative difference of metric ``index`` and its 1-based step (0: none)."""
    worst, at = 0.0, 0
    for step, (a, b) in enumerate(zip(run, base, strict=False), 1):
        diff = _rel(a[index], b[index])
        if diff > worst or (math.isinf(diff) and not math.isinf(worst)):
            worst, at = diff, step
    return worst, at


def max_rel_diff(result: ParityResult, index: int = 0) -> float:
    """Largest relative difference of any run from the baseline, over all steps.

    ``index`` 0: losses; 1: gradient norms. ``inf`` when a value is NaN or infinite (the
    baseline's included) or a run has another number of steps.
    """
    base = result.runs[result.baseline]
    worst = max((_rel(b[index], b[index]) for b in base), default=0.0)  # the baseline's own NaN
    for name in result.backends[1:]:
        run = result.runs[name]
        if len(run) != len(base):
            return math.inf
        worst = max(worst, _worst(run, base, index)[0])
    return worst


def gate(result: ParityResult, tol: float | None = None, grad_norm_tol: float | None = None) -> list[str]:
    """Every reason the result fails, one line each.

    Always: a NaN or infinite loss or gradient norm in any run (the baseline's included),
    a run with another number of steps than ``result.steps``. With ``tol``: a loss, and
    with ``grad_norm_tol`` (default ``tol``) a gradient norm, further from the baseline's
    than that (relative), naming the run, the metric and the worst step.
    """
    tols = (tol, tol if grad_norm_tol is None else grad_norm_tol)
    base_name = result.baseline
    base = result.runs[base_name]
    want = result.steps if result.steps is not None else len(base)
    failures = []
    for name, run in result.runs.items():
        if len(run) != want:
            failures.append(f"{name}: {len(run)} steps, expected {want}")
        for index, metric in enumerate(_METRICS):
            bad = next((step for step, r in enumerate(run, 1) if not math.isfinite(r[index])), None)
            if bad is not None:
                failures.append(f"{name}: {metric} is {run[bad - 1][index]} at step {bad}")
            elif name != base_name and tols[index] is not None:
                worst, at = _worst(run, base, index)
                if not worst <= tols[index]:
                    flag = "--tol" if index == 0 else "--grad-norm-tol"
                    failures.append(f"{name}: {metric} {worst:.2e} from {base_name} at step {at} > "
                                    f"{flag} {tols[index]:g}")
    return failures


def seed_report(result: ParityResult, seed: str | None) -> list[str]:
    """Confirm that every backend started from the seed checkpoint ``seed`` (printed, one line
    each); return a failure for each run that loaded another checkpoint or none.

    ``seed``: ``checkpoint.initial_load_path`` when checkpointing is on, else None (nothing to
    confirm). A run's own folder holding a checkpoint wins over ``initial_load_path`` (the
    trainer's rule), which is exactly what this catches.
    """
    if not seed:
        return []
    failures = []
    want = os.path.realpath(seed)
    for name, path in result.loaded.items():
        if path is not None and os.path.realpath(path) == want:
            print(f"seed: {name} started from {path}")
        else:
            failures.append(f"{name}: started from {path or 'no checkpoint'}, not the seed checkpoint "
                            f"checkpoint.initial_load_path={seed!r}")
    if REFERENCE in result.runs:
        print(f"seed: the {REFERENCE} read its initial weights from {seed}")
    return failures


def pass_line(result: ParityResult, tol: float | None, grad_norm_tol: float | None) -> str:
    """The last line of a passing report: what was gated, and the largest differences found."""
    base = result.runs[result.baseline]
    others = [run for name, run in result.runs.items() if name != result.baseline]
    worst = [max((_worst(run, base, i)[0] for run in others), default=0.0) for i in range(len(_METRICS))]
    steps = result.steps if result.steps is not None else len(base)
    if tol is None and grad_norm_tol is None:
        gated = "no tolerance given (--tol), so only NaNs and run lengths were gated"
    else:
        gn = tol if grad_norm_tol is None else grad_norm_tol
        gated = ", ".join(f"{flag} {t:g}" for flag, t in (("--tol", tol), ("--grad-norm-tol", gn)) if t is not None)
    return (f"PASS: {len(others)} run(s) against the {result.baseline} over {steps} steps; largest "
            f"relative difference: loss {worst[0]:.1e}, grad norm {worst[1]:.1e}; {gated}")


def _table(result: ParityResult, index: int) -> list[str]:
    names = result.backends
    base = result.runs[result.baseline]
    width = max(14, *(len(n) + 2 for n in names))
    head = f"{_METRICS[index]:>9}" + "".join(f"{n:>{width}}" for n in names) + f"{'max rel diff':>15}"
    lines = [head, "-" * len(head)]
    for i in range(max(len(r) for r in result.runs.values())):
        row = f"{i + 1:>9}"
        diffs = []
        for name in names:
            run = result.runs[name]
            if i < len(run):
                row += f"{run[i][index]:>{width}.8f}"
                if name != result.baseline:
                    diffs.append(_rel(run[i][index], base[i][index]) if i < len(base) else math.inf)
            else:
                row += f"{'-':>{width}}"
                diffs.append(math.inf)
        if i < len(base) and math.isnan(base[i][index]):
            diffs.append(math.inf)
        row += f"{max(diffs, default=0.0):>15.2e}"
        lines.append(row)
    return lines


def format_table(result: ParityResult) -> str:
    """The per-step loss and gradient-norm tables, each with every step's largest relative
    difference from the baseline, and the overall maxima."""
    lines = _table(result, 0) + [""] + _table(result, 1)
    lines.append("-" * len(lines[0]))
    lines.append(f"max relative difference vs {result.baseline}: loss {max_rel_diff(result, 0):.2e}, "
                 f"grad_norm {max_rel_diff(result, 1):.2e}")
    return "\n".join(lines)


def _matplotlib() -> object | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_path(requested: str | None, dump_folder: str) -> str:
    """Where the plot goes: ``requested`` (inside it, as :data:`PLOT_NAME`, when it is a directory),
    else ``<dump_folder>/parity_loss.png``. Checked writable now, before any run: raises
    ``ValueError`` naming the path and the reason."""
    path = os.path.join(dump_folder, PLOT_NAME) if requested is None else requested
    if os.path.isdir(path):
        path = os.path.join(path, PLOT_NAME)
    parent = os.path.dirname(os.path.abspath(path))
    blocker = next((p for p in _ancestors(parent) if os.path.exists(p) and not os.path.isdir(p)), None)
    if blocker is not None:
        raise ValueError(f"--plot: cannot write {path!r}: {blocker!r} is a file, not a directory.")
    try:
        os.makedirs(parent, exist_ok=True)
        existed = os.path.exists(path)
        with open(path, "ab"):
            pass
        if not existed:
            os.remove(path)
    except OSError as err:
        raise ValueError(f"--plot: cannot write {path!r}: {err.strerror or err}.") from None
    return path


def _ancestors(path: str) -> list[str]:
    """``path`` and each folder above it."""
    out = [path]
    while os.path.dirname(out[-1]) != out[-1]:
        out.append(os.path.dirname(out[-1]))
    return out


def write_plot(result: ParityResult, path: str) -> bool:
    """Write the loss and gradient-norm curves to ``path`` as PNG. False, with a note printed,
    without matplotlib. ``OSError`` if the file cannot be written."""
    plt = _matplotlib()
    if plt is None:
        print("note: matplotlib is not installed, so no plot was written "
              f"(install the optional extra: {install_hint('plot')}).")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))  # type: ignore[attr-defined]
    styles = [("-", 3.5, "o"), ("--", 2.2, "s"), (":", 1.6, "^"), ("-.", 1.2, "x")]
    for ax, index in zip(axes, range(2), strict=True):
        for k, (name, run) in enumerate(result.runs.items()):
            ls, lw, marker = styles[k % len(styles)]
            ax.plot(range(1, len(run) + 1), [r[index] for r in run], linestyle=ls, linewidth=lw,
                    marker=marker, markersize=4, label=name, alpha=0.85)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel(_METRICS[index])
        ax.set_title(f"{_METRICS[index]}: max relative difference {max_rel_diff(result, index):.1e}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result.description} (vs {result.baseline})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")  # exactly this path: no extension appended
    plt.close(fig)  # type: ignore[attr-defined]
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
        data["debug"]["spmd_typechecking_steps"] = None
    return JobConfig.from_dict(data)


def _train_rank(rank: int, world: int, cfg: JobConfig) -> tuple[list[tuple[float, float]], str | None]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    loaded = trainer.checkpointer.loaded
    return [(r.loss, r.grad_norm) for r in trainer.run()], (str(loaded["path"]) if loaded else None)


def _run_fork(cfg: JobConfig, nproc: int) -> tuple[list[tuple[float, float]], str | None]:
    if cfg.debug.deterministic:
        import torch._inductor  # noqa: F401  (deterministic mode imports it: once, before forking)

    import torchtitan_spmd.train  # noqa: F401
    from torchtitan_spmd.launcher import run_forked

    per_rank = run_forked(_train_rank, nproc, cfg, timeout_s=1800)
    for rank, (records, _) in enumerate(per_rank):
        if records != per_rank[0][0]:
            raise RuntimeError(f"rank {rank} logged {records}, rank 0 logged {per_rank[0][0]}")
    return per_rank[0][0], per_rank[0][1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_torchrun(overrides: Sequence[str], backend: str,
                  nproc: int) -> tuple[list[tuple[float, float]], str | None]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "torchtitan_spmd.train", *overrides,
        "--parallelism.spmd_backend", backend, "--metrics.log_freq", "1",
    ]
    if not _typechecks(backend):
        cmd += ["--debug.no-spmd_typechecking", "--debug.spmd_typechecking_steps", "None"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun ({backend}) exited with {proc.returncode}:\n{text[-4000:]}")
    steps: dict[int, tuple[float, float]] = {}
    for m in _STEP_RE.finditer(text):
        steps[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    if not steps:
        raise RuntimeError(f"torchrun ({backend}) logged no 'step: N loss: X' lines:\n{text[-4000:]}")
    loaded = _LOADED_RE.search(text)
    return [steps[k] for k in sorted(steps)], (loaded.group(1) if loaded else None)


def data_parallel_degree(base: JobConfig, nproc: int) -> int:
    """How many data-parallel ranks share a global batch of ``base`` on ``nproc`` ranks."""
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(base.parallelism, nproc)
    return dims.dp_replicate * dims.dp_shard


def _run_reference(base: JobConfig, nproc: int) -> list[tuple[float, float]]:
    from torchtitan_spmd.reference import run_reference
    from torchtitan_spmd.techniques.pipeline_parallel import pipeline_rows

    rows = base.training.local_batch_size  # a data-parallel rank's sequences; under PP the schedule's iteration
    if base.parallelism.pipeline_parallel_degree > 1:
        rows = pipeline_rows(base.parallelism, base.training)[0]
    return run_reference(base, global_batch=rows * data_parallel_degree(base, nproc))


def collect(base: JobConfig, *, nproc: int, backends: Sequence[str] = BACKENDS,
            launcher: str = "fork", overrides: Sequence[str] = (), reference: bool = True) -> ParityResult:
    """Run ``base`` in the reference (first, unless ``reference`` is False) and under each backend;
    collect the per-step losses and gradient norms.

    ``overrides``: the CLI overrides (the torchrun launcher passes them on).
    """
    runs: dict[str, list[tuple[float, float]]] = {}
    loaded: dict[str, str | None] = {}
    if reference:
        print(f"running the {REFERENCE} (one process, float64) ...", flush=True)
        runs[REFERENCE] = _run_reference(base, nproc)
    for backend in backends:
        print(f"running {backend} on {nproc} rank(s) ({launcher}) ...", flush=True)
        if launcher == "fork":
            runs[backend], loaded[backend] = _run_fork(_backend_config(base, backend), nproc)
        elif launcher == "torchrun":
            runs[backend], loaded[backend] = _run_torchrun(overrides, backend, nproc)
        else:
            raise ValueError(f"unknown launcher {launcher!r}; use 'fork' or 'torchrun'.")
    p = base.parallelism
    description = (
        f"{base.model.name}/{base.model.flavor}, {nproc} rank(s): dp_replicate={p.data_parallel_replicate_degree} "
        f"dp_shard={p.data_parallel_shard_degree} tp={p.tensor_parallel_degree}"
    )
    return ParityResult(runs=runs, nproc=nproc, description=description, steps=base.training.steps,
                        loaded=loaded)


def _tolerance(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_spmd.parity",
        allow_abbrev=False,
        description="Run one config in the independent reference and under every SPMD backend, and compare "
        "the losses and gradient norms. Any other --section.field options configure the run "
        "(see python -m torchtitan_spmd.train --help).",
    )
    parser.add_argument("--nproc", type=int, default=None,
                        help="number of ranks (default: the product of the parallel degrees)")
    parser.add_argument("--launcher", choices=("fork", "torchrun"), default="fork",
                        help="fork: CPU ranks forked from this process (default); torchrun: one torchrun per backend")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"comma-separated backends to compare (default {','.join(BACKENDS)})")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the reference; compare the backends with the first one")
    parser.add_argument("--plot", default=None,
                        help=f"PNG path, or a directory for {PLOT_NAME} (default <job.dump_folder>/{PLOT_NAME})")
    parser.add_argument("--no-plot", action="store_true", help="do not write the plot")
    parser.add_argument("--tol", type=_tolerance, default=None,
                        help="exit 1 if a loss differs from the baseline's by more than this (relative); "
                        "a NaN or a run of another length always exits 1")
    parser.add_argument("--grad-norm-tol", type=_tolerance, default=None,
                        help="the same for the gradient norms (default: --tol)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m torchtitan_spmd.parity``; returns the exit status."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if "-h" in args_in or "--help" in args_in:
        parser.print_help()
        return 0
    try:
        opts, overrides = parser.parse_known_args(args_in)
    except SystemExit as err:  # argparse has reported a bad option value
        return int(err.code or 0)
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
        base = ConfigManager(module_packages=LIBRARY_FIRST).parse_args([*overrides, "--parallelism.spmd_backend", typed])
        if base.checkpoint.enable and not base.checkpoint.load_only:
            raise ValueError("--checkpoint.enable without --checkpoint.load_only: each backend would resume from "
                             "the checkpoints the one before it saved. Add --checkpoint.load_only (e.g. with "
                             "--checkpoint.initial_load_path DIR/checkpoint/step-0, a seed checkpoint).")
        nproc = opts.nproc if opts.nproc is not None else _default_nproc(base)
        if nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {nproc}.")
        if not opts.no_reference:
            from torchtitan_spmd.reference import ARCHITECTURES

            if base.model.name not in ARCHITECTURES:
                raise ValueError(f"the reference restates {', '.join(map(repr, ARCHITECTURES))}, not "
                                 f"model.name={base.model.name!r}; pass --no-reference to compare the backends "
                                 "with each other.")
            data_parallel_degree(base, nproc)  # degrees that do not fit nproc fail now
        plot = None
        if not opts.no_plot:
            if _matplotlib() is None:
                write_plot(ParityResult(runs={}, nproc=nproc, description=""), "")  # the note
            else:
                plot = plot_path(opts.plot, base.job.dump_folder)
    except (ValueError, TypeError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SystemExit as err:  # tyro has reported a bad override
        return int(err.code or 0)
    try:
        result = collect(base, nproc=nproc, backends=backends, launcher=opts.launcher,
                         overrides=overrides, reference=not opts.no_reference)
    except Exception as err:  # noqa: BLE001 - report any failed run with its output
        print(f"error: a run failed: {err}", file=sys.stderr)
        return 2
    print(format_table(result))
    status = 0
    if plot is not None:
        try:
            write_plot(result, plot)
            print(f"wrote {plot}")
        except OSError as err:
            print(f"error: could not write the plot {plot!r}: {err.strerror or err}", file=sys.stderr)
            status = 2
    seed = base.checkpoint.initial_load_path if base.checkpoint.enable else None
    failures = gate(result, opts.tol, opts.grad_norm_tol) + seed_report(result, seed)
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    if not failures:
        print(pass_line(result, opts.tol, opts.grad_norm_tol))
    return 1 if failures else status


if __name__ == "__main__":
    raise SystemExit(main())
