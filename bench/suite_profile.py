"""Where the test suite's time goes: by tier, by file, process start-up against work, stack prefixes.

Two steps, so a profile can be taken once and read many times::

    python bench/suite_profile.py run --out /tmp/prof            # the whole matrix, as CI runs it
    python bench/suite_profile.py run --out /tmp/prof --workers 1 --backend default
    python bench/suite_profile.py report /tmp/prof [--files 25]

``run`` runs ``python -m pytest tests`` (pytest-xdist with ``--workers`` workers, default: one per
core, as ``nox -s cpu_tests``) with the suite's own probes switched on
(``TORCHTITAN_SPMD_TEST_PROFILE``: each test's wall and CPU seconds, from ``tests/conftest.py``;
``TORCHTITAN_SPMD_LAUNCH_PROFILE``: each forked launch's wall seconds against the seconds its
rank 0 spent inside the test's function, from ``torchtitan_spmd/launcher.py``), then
``python -m stack check`` (unless ``--no-stack``), and writes ``tests.jsonl``, ``launches.jsonl``,
``stack.log`` and ``wall.json`` into ``--out``. ``report`` prints the tables
``docs/benchmarks.md`` ("The test suite") quotes.

CPU seconds are this process's plus the children it reaped (forked ranks, subprocesses): on a
busy machine wall time grows with the load, CPU time far less, so compare CPU seconds across
runs and wall seconds only side by side in one run.

Run it with the interpreter of the venv the tests use (``.nox/_shared-cpu/bin/python``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIERS = ("common", "default", "full_dtensor", "spmd_types")


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def cmd_run(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tests.jsonl", "launches.jsonl", "stack.log", "wall.json"):
        (out / name).unlink(missing_ok=True)
    env = {**os.environ,
           "TORCHTITAN_SPMD_TEST_PROFILE": str(out / "tests.jsonl"),
           "TORCHTITAN_SPMD_LAUNCH_PROFILE": str(out / "launches.jsonl")}
    workers = args.workers or (os.cpu_count() or 1)
    cmd = [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider",
           f"--backend={args.backend}", *args.pytest_args]
    if workers > 1:
        cmd += ["-n", str(workers), "--dist", "loadfile"]  # as nox -s cpu_tests
        env["OMP_NUM_THREADS"] = "1"
    wall: dict[str, float] = {}
    start = time.monotonic()
    tests = subprocess.run(cmd, cwd=ROOT, env=env)
    wall["pytest"] = time.monotonic() - start
    code = tests.returncode
    if not args.no_stack:
        start = time.monotonic()
        with open(out / "stack.log", "w", encoding="utf-8") as log:
            stack = subprocess.run([sys.executable, "-m", "stack", "check"], cwd=ROOT, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
        wall["stack"] = time.monotonic() - start
        code = code or stack.returncode
    (out / "wall.json").write_text(json.dumps({"workers": workers, "backend": args.backend,
                                               **wall}, indent=1), encoding="utf-8")
    print(report(out, args.files))
    return code


def _table(rows: list[tuple], header: tuple) -> str:
    cells = [tuple(str(c) for c in header), *[tuple(str(c) for c in r) for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def report(out: Path, top_files: int = 25) -> str:
    tests = [t for t in _read_jsonl(out / "tests.jsonl") if not t.get("stack_prefix")]
    launches = _read_jsonl(out / "launches.jsonl")
    wall = json.loads((out / "wall.json").read_text()) if (out / "wall.json").exists() else {}
    parts: list[str] = []
    if wall:
        parts.append("wall: " + ", ".join(f"{k} {v:.0f} s" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in wall.items()))
    by_tier: dict[str, list[dict]] = defaultdict(list)
    for t in tests:
        by_tier[t["backend"]].append(t)
    rows = []
    for tier in [*TIERS, *sorted(set(by_tier) - set(TIERS))]:
        ts = by_tier.get(tier, [])
        if not ts:
            continue
        multi = [t for t in ts if t["multiproc"]]
        rows.append((tier, len(ts), len(multi),
                     f"{sum(t['wall_s'] for t in ts):.0f}", f"{sum(t['cpu_s'] for t in ts):.0f}",
                     f"{sum(t['cpu_s'] for t in multi):.0f}"))
    rows.append(("all", len(tests), sum(t["multiproc"] for t in tests),
                 f"{sum(t['wall_s'] for t in tests):.0f}", f"{sum(t['cpu_s'] for t in tests):.0f}",
                 f"{sum(t['cpu_s'] for t in tests if t['multiproc']):.0f}"))
    parts.append("By tier (test seconds summed over the tests; with N workers the run's wall is "
                 "about the sum / N):\n" + _table(rows, ("tier", "tests", "multi-rank", "wall s",
                                                         "CPU s", "CPU s multi-rank")))
    by_file: dict[str, list[dict]] = defaultdict(list)
    for t in tests:
        by_file[t["test"].split("::", 1)[0]].append(t)
    ranked = sorted(by_file.items(), key=lambda kv: -sum(t["cpu_s"] for t in kv[1]))
    rows = [(name.removeprefix("tests/"), len(ts), f"{sum(t['wall_s'] for t in ts):.1f}",
             f"{sum(t['cpu_s'] for t in ts):.1f}") for name, ts in ranked[:top_files]]
    rest = ranked[top_files:]
    if rest:
        rows.append((f"({len(rest)} other files)", sum(len(ts) for _, ts in rest),
                     f"{sum(t['wall_s'] for _, ts in rest for t in ts):.1f}",
                     f"{sum(t['cpu_s'] for _, ts in rest for t in ts):.1f}"))
    parts.append(f"By file, the {min(top_files, len(ranked))} costliest in CPU seconds:\n"
                 + _table(rows, ("file", "tests", "wall s", "CPU s")))
    if launches:
        total = sum(x["wall_s"] for x in launches)
        work = sum(x["work_s"] or 0.0 for x in launches)
        sizes = defaultdict(int)
        for x in launches:
            sizes[x["world_size"]] += 1
        parts.append(
            f"Forked launches: {len(launches)} ({', '.join(f'{n} of {w} rank(s)' for w, n in sorted(sizes.items()))}); "
            f"{total:.0f} s from fork to join, {work:.0f} s of it inside the tests' functions (rank 0), "
            f"{total - work:.0f} s ({(total - work) / max(total, 1e-9):.0%}) process start-up, "
            f"rendezvous and teardown.")
        groups: dict[str, list[dict]] = defaultdict(list)
        for x in launches:
            if x.get("args_digest"):
                groups[x["args_digest"]].append(x)
        twice = sorted((g for g in groups.values() if len(g) > 1),
                       key=lambda g: -sum(x["wall_s"] for x in g[1:]))
        if twice:
            rows = [(", ".join(sorted({x["test"].split("::")[-1][:60] for x in g})), len(g),
                     f"{sum(x['wall_s'] for x in g[1:]):.1f}") for g in twice[:15]]
            parts.append("Launches of the same function on the same arguments (candidates to share "
                         "one run):\n" + _table(rows, ("tests", "launches", "s after the first")))
    slow = sorted({(t["test"], t["slow"], t["wall_s"]) for t in tests if t.get("slow")}, key=lambda r: -r[2])
    if slow:
        parts.append("Tests marked slow, with their reasons:\n" + _table(
            [(name, f"{wall_s:.0f}", reason) for name, reason, wall_s in slow], ("test", "wall s", "reason")))
    stack_log = out / "stack.log"
    if stack_log.exists():
        rows = []
        for line in stack_log.read_text(encoding="utf-8").splitlines():
            m = re.match(r"\s*prefix 1\.\.(\d+) \(([^)]*)\)[^:]*: (\w+).*?(\d+) passed / (\d+) collected"
                         r"(?: \((\d+) carried[^)]*\))?.* in ([\d.]+)s", line)
            if m:
                k, slug, status, passed, collected, carried, seconds = m.groups()
                rows.append((f"1..{k}", slug, status, f"{passed}/{collected}", carried or "0", seconds))
        if rows:
            parts.append("Stack check, per prefix:\n" + _table(
                rows, ("prefix", "layer", "result", "passed/collected", "carried", "s")))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run the suite with its probes on, then report")
    run.add_argument("--out", required=True, help="folder for the profile files")
    run.add_argument("--workers", type=int, default=0, help="pytest-xdist workers (default: the cores)")
    run.add_argument("--backend", default="all", choices=("all", *TIERS))
    run.add_argument("--no-stack", action="store_true", help="skip python -m stack check")
    run.add_argument("--files", type=int, default=25, help="how many files the report lists")
    run.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    rep = sub.add_parser("report", help="print the tables of a profile taken earlier")
    rep.add_argument("out")
    rep.add_argument("--files", type=int, default=25)
    args = parser.parse_args(argv)
    if args.cmd == "run":
        return cmd_run(args)
    if not Path(args.out).is_dir():
        parser.error(f"{args.out}: no such folder (take a profile first: suite_profile.py run --out DIR)")
    print(report(Path(args.out), args.files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
