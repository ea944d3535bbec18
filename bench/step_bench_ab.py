"""Step time of two revisions, interleaved: ``bench/step_bench.py`` from each checkout in turn.

    git worktree add /tmp/before <rev>
    python bench/step_bench_ab.py --before /tmp/before --rounds 3
    python bench/step_bench_ab.py --before /tmp/before --rounds 3 -- --variants default,spmd_types

Runs ``step_bench.py`` (any extra arguments after ``--`` are passed on) from the
``--before`` checkout, then from this one, ``--rounds`` times, so that machine
noise hits both alike. Each run is a fresh process tree that imports its own
checkout (``step_bench.py`` puts its repository first on ``sys.path``). Prints, per
variant, the median over rounds of each revision's median step time, the range
over rounds (the spread), and the ratio after / before.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
_ROW = re.compile(r"^\| (\S+) \| ([0-9.]+) \|", re.M)


def _run(checkout: Path, extra: list[str]) -> dict[str, float]:
    proc = subprocess.run([sys.executable, str(checkout / "bench" / "step_bench.py"), *extra],
                          capture_output=True, text=True, cwd=checkout)
    if proc.returncode != 0:
        raise SystemExit(f"step_bench in {checkout} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = {m.group(1): float(m.group(2)) for m in _ROW.finditer(proc.stdout)}
    print(f"  {checkout.name}: " + ", ".join(f"{k} {v:.3f}s" for k, v in rows.items()), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="checkout of the earlier revision")
    parser.add_argument("--rounds", type=int, default=3)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(args.rounds):
        print(f"round {i + 1}/{args.rounds}", flush=True)
        runs["before"].append(_run(args.before.resolve(), extra))
        runs["after"].append(_run(HERE, extra))
    variants = [v for v in runs["after"][0] if v in runs["before"][0]]
    print("\n| variant | before: median (range) s | after: median (range) s | after / before |")
    print("|---|---|---|---|")
    for v in variants:
        b = [r[v] for r in runs["before"]]
        a = [r[v] for r in runs["after"]]
        print(f"| {v} | {statistics.median(b):.3f} ({min(b):.3f}-{max(b):.3f}) | "
              f"{statistics.median(a):.3f} ({min(a):.3f}-{max(a):.3f}) | "
              f"{statistics.median(a) / statistics.median(b):.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
