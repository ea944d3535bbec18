"""The dry run's targets (issues 36 and 41): wall time, peak RSS and the report's headline numbers.

    PYTHONPATH=. python bench/dry_run_targets.py [405b|8b|qwen3_30b|dsv3_671b|all] [--json OUT]

Each target is one of upstream's recipes as written (``--module M --config C``, the registry's
recipe functions: llama3 ``405B`` with TP 8, async TP and compile; llama3 ``8B``; qwen3
``30B-A3B``; DeepSeek-V3 ``671B``), with only the expert-parallel degree of the issue's layout
added, run in a fresh subprocess (its peak RSS is its own) with ``NGPU`` set, through the
trainer's own entry point (``python -m torchtitan_spmd.train ... --comm.mode fake_backend``). No
tokenizer: the dry run sizes each flavour with its own vocabulary (the report says so).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

#: name -> (family, recipe, NGPU, extra command-line arguments)
TARGETS: dict[str, tuple[str, str, int, list[str]]] = {
    # upstream's 405B recipe as written (TP 8, async TP, compiled blocks, full AC) on 16,384 GPUs
    "405b": ("llama3", "llama3_405b", 16384, []),
    "8b": ("llama3", "llama3_8b", 64, []),
    # DeepSeek-V3 671B with EP 64 on 2,048 GPUs (efsdp 32 over 4 experts a rank: dim-1 experts)
    "dsv3_671b": ("deepseek_v3", "deepseek_v3_671b", 2048, ["--parallelism.expert_parallel_degree", "64"]),
    # Qwen3-30B-A3B with EP 8 on 512 GPUs (efsdp 64 over 16 experts a rank: dim-1 experts)
    "qwen3_30b": ("qwen3", "qwen3_30b_a3b", 512, ["--parallelism.expert_parallel_degree", "8"]),
}


def _child(target: str, folder: str) -> None:
    """Run one target in this process (the subprocess side)."""
    from torchtitan_spmd.train import main

    family, recipe, _, extra = TARGETS[target]
    status = main(["--module", family, "--config", recipe, "--comm.mode", "fake_backend",
                   "--job.dump_folder", folder, *extra])
    raise SystemExit(status)


def run(target: str) -> dict:
    """One target in a subprocess: its wall time, peak RSS and the report's JSON, and its largest
    rank's parameters against total / world."""
    family, recipe, ngpu, _ = TARGETS[target]
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "NGPU": str(ngpu), "OMP_NUM_THREADS": "1"}
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", target, folder], env=env,
                              capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
        rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
        if proc.returncode != 0:
            raise SystemExit(f"{target}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(os.path.join(folder, "dry_run.json"), encoding="utf-8") as f:
            report = json.load(f)
    ideal = report["total_params"] / ngpu
    worst = max(r["param_numel"] for r in report["roles"])
    return {"target": target, "recipe": f"{family} {recipe}", "ngpu": ngpu, "wall_s": round(wall, 1),
            "max_rss_gib_of_any_child_so_far": round(rss_gib, 2), "per_rank_params": worst,
            "total_over_world": round(ideal), "ratio": round(worst / ideal, 4), "text": proc.stdout, "report": report}


def main() -> None:
    """Run the targets named on the command line (default: all) and print a table."""
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2], sys.argv[3])
        return
    names = [a for a in sys.argv[1:] if not a.startswith("--") and a in TARGETS] or list(TARGETS)
    rows = []
    for name in names:
        row = run(name)
        rows.append(row)
        print(row["text"])
        print(f"{name}: {row['wall_s']} s, peak RSS {row['max_rss_gib_of_any_child_so_far']} GiB, "
              f"per-rank parameters {row['per_rank_params']:,} = {row['ratio']}x total/world "
              f"({row['total_over_world']:,})", flush=True)
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
