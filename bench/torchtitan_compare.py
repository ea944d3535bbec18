"""Step time of this project's trainer beside upstream torchtitan 0.3.0, on the same job.

    bash ../shared/peer-torchtitan/side_by_side.sh setup      # once: torchtitan 0.3.0 in ~/.cache/peer-tt
    python bench/torchtitan_compare.py                         # 2 pairs, FSDP 2 x TP 2
    python bench/torchtitan_compare.py --pairs 3 --configs 2x2 fsdp2
    python bench/torchtitan_compare.py --ours before=/tmp/before --ours after=.

The job (both sides): 4 gloo ranks (for ``2x2``), ``llama3`` ``debugmodel``, local
batch 4 x seq 256, fp32 parameters, no activation checkpointing, ``--debug.seed 42
--debug.deterministic``, ``OMP_NUM_THREADS=1``, 10 steps. torchtitan runs through
the CPU shim in ``../shared/peer-torchtitan`` (``tt_cpu_launch.py``: torchtitan has
no CPU device path; it is used from there, not copied) with
``--training.mixed_precision_param float32`` and ``activation_checkpoint:none``.

Timing is the same for both: every rank-0 output line is timestamped when it
reaches this process; a run's figure is the median gap between consecutive
``step:`` lines over steps 3..N (the first two steps warm caches up). Runs
alternate (ours default, torchtitan partial_dtensor, ours full_dtensor,
torchtitan full_dtensor, ours spmd_types, then the next pair), so machine noise
hits all alike. The table gives, per variant, the median over pairs and the ratio
to torchtitan's faster backend on that config (the issue-15 goal is <= 0.85), and
the same for the CPU seconds every rank together used per step (read from
``/proc`` at each step line): wall time follows the machine's load, CPU time much
less, so the CPU column is the one to trust on a busy machine.

``--ours NAME=PATH`` (repeatable) runs the trainer of another checkout (its
``torchtitan_spmd`` first on ``PYTHONPATH``) under this interpreter, e.g. the
revision before a change; default: this checkout, named ``ours``.
``NAME=PATH@default+spmd_types`` runs only those backends of that checkout.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
CONFIGS = {"1p": (1, 1), "fsdp2": (2, 1), "tp2": (1, 2), "2x2": (2, 2)}
OURS_BACKENDS = ("default", "full_dtensor", "spmd_types")
TITAN_BACKENDS = ("partial_dtensor", "full_dtensor")
_STEP = re.compile(r"step:\s*(\d+)\s+loss")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


_TICK = os.sysconf("SC_CLK_TCK")


def _tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of ``root`` and all its live descendants (from ``/proc``)."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / _TICK
    total, todo, seen = 0.0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += cpu.get(pid, 0.0)
        todo.extend(c for c, p in parent.items() if p == pid)
    return total


def _timed_lines(cmd: list[str], env: dict[str, str], cwd: Path, log: Path,
                 timeout: float) -> list[tuple[float, float]]:
    """Run ``cmd``; for each rank-0 ``step:`` line, its arrival time and the CPU seconds the
    whole process tree (every rank) had used by then. All output goes to ``log``."""
    stamps: list[tuple[float, float]] = []
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", bufsize=1)
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        for line in proc.stdout:
            now = time.time()
            out.write(f"{now:.3f} {line}")
            if _STEP.search(_ANSI.sub("", line)):
                stamps.append((now, _tree_cpu_seconds(proc.pid)))
            if time.monotonic() > deadline:
                proc.kill()
                break
        rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed (exit {rc}); see {log}")
    return stamps


def _median_step(stamps: list[tuple[float, float]], log: Path) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds (all ranks) per step, over steps 3..N."""
    wall = [b[0] - a[0] for a, b in zip(stamps, stamps[1:], strict=False)][1:]  # gaps ending at steps 3..N
    cpu = [b[1] - a[1] for a, b in zip(stamps, stamps[1:], strict=False)][1:]
    if not wall:
        raise SystemExit(f"no step times in {log}")
    return statistics.median(wall), statistics.median(cpu)


def _common(dp: int, tp: int, args: argparse.Namespace) -> list[str]:
    return ["--parallelism.data_parallel_shard_degree", str(dp), "--parallelism.tensor_parallel_degree", str(tp),
            "--training.steps", str(args.steps), "--training.seq_len", str(args.seq),
            "--training.local_batch_size", str(args.lbs), "--debug.seed", "42", "--debug.deterministic"]


def run_ours(checkout: Path, backend: str, dp: int, tp: int, args: argparse.Namespace,
             log: Path) -> tuple[float, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp * tp),
           "--local-ranks-filter", "0", "-m", "torchtitan_spmd.train", "--module", "llama3",
           "--config", "llama3_debugmodel", "--parallelism.spmd_backend", backend,
           "--activation_checkpoint.mode", "none", *_common(dp, tp, args)]
    return _median_step(_timed_lines(cmd, env, checkout, log, args.timeout), log)


def run_titan(backend: str, dp: int, tp: int, args: argparse.Namespace, log: Path) -> tuple[float, float]:
    work = args.tt_home / "work"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": "disabled", "TT_CPU_ATTN": "sdpa"}
    cmd = [str(args.tt_home / "venv" / "bin" / "torchrun"), "--standalone", "--nproc-per-node", str(dp * tp),
           "--local-ranks-filter", "0", str(args.peer / "tt_cpu_launch.py"), "--module", "llama3",
           "--config", "llama3_debugmodel", "--parallelism.spmd_backend", backend, *_common(dp, tp, args),
           "--dump_folder", str(log.parent / "tt_dump"), "--training.mixed_precision_param", "float32",
           "activation_checkpoint:none"]
    return _median_step(_timed_lines(cmd, env, work, log, args.timeout), log)


def _checkout(spec: str) -> tuple[str, Path, tuple[str, ...] | None]:
    name, sep, rest = spec.partition("=")
    path, _, only = rest.partition("@")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--ours takes NAME=PATH[@BACKEND+BACKEND], got {spec!r}")
    p = Path(path).resolve()
    if not (p / "torchtitan_spmd" / "train.py").is_file():
        raise argparse.ArgumentTypeError(f"--ours {spec!r}: {p} is not a torchtitan_spmd checkout")
    backends = tuple(only.split("+")) if only else None
    bad = [b for b in backends or () if b not in OURS_BACKENDS]
    if bad:
        raise argparse.ArgumentTypeError(f"--ours {spec!r}: unknown backend(s) {bad}; valid: {OURS_BACKENDS}")
    return name, p, backends


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2, help="alternating rounds (default 2)")
    parser.add_argument("--configs", nargs="+", default=["2x2"], choices=sorted(CONFIGS))
    parser.add_argument("--ours", type=_checkout, action="append", default=None, metavar="NAME=PATH[@B+B]")
    parser.add_argument("--backends", nargs="+", default=list(OURS_BACKENDS), choices=OURS_BACKENDS)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lbs", type=int, default=4)
    parser.add_argument("--peer", type=Path, default=Path(os.environ.get(
        "PEER_TORCHTITAN", HERE.parent / "shared" / "peer-torchtitan")))
    parser.add_argument("--tt-home", type=Path, default=Path(os.environ.get(
        "TT_HOME", Path.home() / ".cache" / "peer-tt")))
    parser.add_argument("--out", type=Path, default=Path("/tmp/torchtitan_compare"))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    args = parser.parse_args(argv)
    ours = args.ours or [("ours", HERE, None)]
    if not (args.tt_home / "venv" / "bin" / "torchrun").exists() or not (args.peer / "tt_cpu_launch.py").exists():
        parser.error(f"torchtitan 0.3.0 is not set up: need {args.tt_home}/venv (run "
                     f"'bash {args.peer}/side_by_side.sh setup') and {args.peer}/tt_cpu_launch.py")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for cfg in args.configs:
        dp, tp = CONFIGS[cfg]
        for i in range(1, args.pairs + 1):
            jobs: list[tuple[str, str]] = []
            for b in args.backends:
                jobs += [(name, b) for name, _, only in ours if only is None or b in only]
                if b == "default":
                    jobs.append(("torchtitan", "partial_dtensor"))
                if b == "full_dtensor":
                    jobs.append(("torchtitan", "full_dtensor"))
            for who, backend in jobs:
                log = args.out / f"{cfg}_{who}_{backend}_{i}.log"
                if who == "torchtitan":
                    sec = run_titan(backend, dp, tp, args, log)
                else:
                    sec = run_ours({n: p for n, p, _ in ours}[who], backend, dp, tp, args, log)
                results.setdefault((cfg, f"{who} {backend}"), []).append(sec)
                print(f"{cfg} pair {i}: {who} {backend}: {sec[0]:.3f} s/step, {sec[1]:.3f} CPU-s/step",
                      flush=True)
    print("\n| config | run | median s/step | runs | × torchtitan's faster | CPU-s/step, all ranks "
          "| × torchtitan's faster |")
    print("|---|---|---:|---|---:|---:|---:|")
    for cfg in args.configs:
        mine = {k: v for (c, k), v in results.items() if c == cfg}
        wall = {k: statistics.median(x[0] for x in v) for k, v in mine.items()}
        cpu = {k: statistics.median(x[1] for x in v) for k, v in mine.items()}
        tw = min((m for k, m in wall.items() if k.startswith("torchtitan")), default=float("nan"))
        tc = min((m for k, m in cpu.items() if k.startswith("torchtitan")), default=float("nan"))
        for k, v in mine.items():
            print(f"| {cfg} | {k} | {wall[k]:.3f} | {', '.join(f'{x[0]:.2f}' for x in v)} | {wall[k] / tw:.2f} "
                  f"| {cpu[k]:.3f} | {cpu[k] / tc:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
