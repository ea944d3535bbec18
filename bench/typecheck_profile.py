"""Where a type-checked step's time goes: the step_bench job, profiled on rank 0.

    python bench/typecheck_profile.py                 # 4 gloo ranks, FSDP 2 x TP 2, llama3 debugmodel
    python bench/typecheck_profile.py --steps 6 --model qwen3

Three trainers on every rank, steps interleaved as in ``bench/step_bench.py``:
``spmd_types`` unchecked, type-checked, and type-checked with the decision cache
off (``typecheck.DECISION_CACHE.enabled = False``: every op through the checker,
as before the cache). After ``--warmup`` steps, rank 0 runs each measured step
under ``cProfile`` and the table gives, per variant, the seconds per step spent
in each part (cProfile's own overhead inflates Python-heavy parts, so compare
variants, not absolute times) and how many ops the decision cache replayed. For a
low-overhead sampling profile run the same job under py-spy
(``py-spy record --subprocesses --format raw ...``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch._inductor  # noqa: E402,F401  (imported once in the parent, not per rank)
from spmd_types._checker import _ShardPropagator  # noqa: E402
from step_bench import _config  # noqa: E402

import torchtitan_spmd.train  # noqa: E402,F401
from torchtitan_spmd.distributed.representations.spmd_types import (  # noqa: E402
    SpmdTypesRepresentation,
    typecheck,
)
from torchtitan_spmd.launcher import run_forked  # noqa: E402
from torchtitan_spmd.models.common import Decoder  # noqa: E402

VARIANTS = {"unchecked": "spmd_types", "checked": "spmd_types+typecheck",
            "checked, cache off": "spmd_types+typecheck"}

def _code(fn: object) -> tuple[str, int, str]:
    code = fn.__code__  # type: ignore[attr-defined]
    return code.co_filename, code.co_firstlineno, code.co_name


#: Rows: (label, how). ``("inclusive", function)``: time inside that function (recursive calls
#: counted once); ``("self", path part)``: the functions' own time (without callees) summed
#: over every file whose path contains ``path part``.
PARTS = [
    ("forward + loss (Decoder.forward)", ("inclusive", _code(Decoder.forward))),
    ("backward (unchecked in every variant)", ("inclusive", _code(torch.Tensor.backward))),
    ("checker: DTensor meta shard propagation", ("inclusive", _code(_ShardPropagator.propagate))),
    ("spmd_types library, own code (self time)", ("self", "site-packages/spmd_types/")),
    ("ours: typecheck.py shim and cache (self time)", ("self", "representations/spmd_types/typecheck.py")),
    ("ours: boundary type asserts (_check)", ("inclusive", _code(SpmdTypesRepresentation._check))),
]


def _part(stats: pstats.Stats, how: tuple[object, ...]) -> float:
    if how[0] == "inclusive":
        row = stats.stats.get(how[1])  # type: ignore[attr-defined]
        return row[3] if row is not None else 0.0  # cumtime: cProfile counts recursion once
    return sum(tottime for (file, _, _), (_, _, tottime, _, _) in stats.stats.items()  # type: ignore[attr-defined]
               if str(how[1]) in file)


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, object]:
    from torchtitan_spmd.train import Trainer

    trainers = {label: Trainer(_config(v, args)) for label, v in VARIANTS.items()}
    cache = typecheck.DECISION_CACHE
    parts: dict[str, list[list[float]]] = {label: [] for label in trainers}
    counts: dict[str, tuple[int, int, int]] = {}
    for step in range(1, args.steps + 1):
        for label, trainer in trainers.items():
            cache.enabled = label != "checked, cache off"
            hits, misses, unkeyed = cache.hits, cache.misses, cache.unkeyed
            profile = rank == 0 and step > args.warmup
            prof = cProfile.Profile() if profile else None
            start = time.perf_counter()
            if prof is not None:
                prof.enable()
            trainer.step(step)
            if prof is not None:
                prof.disable()
                stats = pstats.Stats(prof)
                parts[label].append([time.perf_counter() - start]
                                    + [_part(stats, how) for _, how in PARTS])
            if label == "checked":
                counts[label] = (cache.hits - hits, cache.misses - misses, cache.unkeyed - unkeyed)
            elif label == "checked, cache off":
                counts[label] = (0, 0, cache.unkeyed - unkeyed)
    cache.enabled = True
    return {"parts": parts, "counts": counts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--local-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dp-shard", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}).")
    rank0 = run_forked(_worker, args.dp_shard * args.tp, args, timeout_s=3600)[0]
    parts = rank0["parts"]
    print(f"\nrank 0 under cProfile, {args.model} {args.flavor}, dp_shard={args.dp_shard} x tp={args.tp}, "
          f"median of {args.steps - args.warmup} steps, seconds per step (inclusive)\n")
    labels = list(VARIANTS)
    print("| part | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for i, name in enumerate(["step (under cProfile)", *(label for label, _ in PARTS)]):
        cells = [f"{statistics.median(row[i] for row in parts[label]):.2f}" for label in labels]
        print(f"| {name} | " + " | ".join(cells) + " |")
    hits, misses, unkeyed = rank0["counts"]["checked"]
    print(f"\nchecked: per step {hits} ops replayed, {misses} checked and recorded, {unkeyed} always "
          "checked (collectives, autograd Functions, property reads, ...)")
    print(f"checked, cache off: per step {rank0['counts']['checked, cache off'][2]} ops through the checker")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
