"""Every pipeline schedule under every backend against the independent float64 reference (accuracy, not speed).

    python bench/pp_schedule_parity.py                       # every schedule x backend, + the split-backward CSV
    python bench/pp_schedule_parity.py --backends full_dtensor --schedules ZBVZeroBubble,DualPipeV

Each run: llama3 ``tiny``, PP 2 x FSDP 2 (4 forked gloo ranks), fp32, no activation checkpointing,
4 steps, local batch 2 (DualPipeV: 4, one microbatch a stage), microbatch size 1; the cells of
``tests/layer3_runtime/pp_backend_helpers.py`` (the same Trainer and harness as the tests), one fork
a run. ``spmd_types+typed``: with ``debug.spmd_typechecking`` (every stage's forward and the loss
type-checked). Printed: the largest relative error over the steps of the loss and of the gradient
norm against ``torchtitan_spmd/reference.py`` (no pipeline code), and the wall time of the run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "layer3_runtime")]

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
BACKENDS = ("default", "full_dtensor", "spmd_types", "spmd_types+typed")
#: The split-backward CSV fixture (``I``/``W`` actions, two stages a rank).
CSV = "csv:pp2_looped_zero_bubble"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--schedules", default=",".join((*SCHEDULES, CSV)))
    args = parser.parse_args()

    import pp_backend_helpers as pp
    from parity_helpers import max_rel
    from pipeline_feature_helpers import SCHEDULES as CSV_DIR

    from torchtitan_spmd.launcher import WorkerError

    print("| schedule | backend | loss rel. err. | grad-norm rel. err. | wall (s) |")
    print("|---|---|---|---|---|")
    for schedule in args.schedules.split(","):
        for spec in args.backends.split(","):
            backend, _, typed = spec.partition("+")
            par = {"data_parallel_shard_degree": 2, "pipeline_parallel_schedule": schedule}
            if schedule.startswith("csv:"):
                par = {"data_parallel_shard_degree": 2, "pipeline_parallel_schedule": "PipelineScheduleMulti",
                       "pipeline_parallel_schedule_csv": str(CSV_DIR / f"{schedule[4:]}.csv")}
            cell = pp.Cell(backend, par, local_batch=4 if schedule == "DualPipeV" else 2, typecheck=bool(typed))
            start = time.perf_counter()
            try:
                got = pp.run_cell(cell)["records"]
            except WorkerError as err:
                last = [line for line in str(err).splitlines() if "Error" in line][-1:]
                print(f"| {schedule} | {spec} | fails: {' '.join(last)[:120]} | | {time.perf_counter() - start:.1f} |")
                continue
            wall = time.perf_counter() - start
            ref = pp.pp_reference(cell.global_batch)
            loss = max_rel([g[0] for g in got], [r[0] for r in ref])
            norm = max_rel([g[1] for g in got], [r[1] for r in ref])
            print(f"| {schedule} | {spec} | {loss:.1e} | {norm:.1e} | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
