"""Benchmark ``ParallelDims.build_mesh()`` against one plain ``init_device_mesh``.

    python bench/mesh_bench.py [--max-world N] [--min-world N] [--repeats R] [--shape S]

For each world size (8, 64, ..., up to ``--max-world``, default 65,536; pass
``--max-world 1048576`` for the largest), each shape and each backend, a fresh
subprocess initialises torch's fake process group (one process simulating rank 0
of ``world`` ranks) and times ``build_mesh()``. Shapes: ``5-axis`` (every base axis
above 1 from 64 ranks up) and ``fsdp-only`` (``dp_shard = world``, every other
degree 1). The baseline is one plain 5-axis
``init_device_mesh(("pp", "dp_replicate", "dp_shard", "cp", "tp"))`` with the same
degrees. Each cell is the fastest of ``--repeats`` fresh processes (1 above 65,536
ranks). Memory is the growth of peak RSS over the RSS just before the call.
"new_group calls" counts every ``new_group`` call this rank makes, member or not
(torch's ``init_device_mesh`` makes every rank create every subgroup of every
axis); "groups" counts the groups this rank keeps (registered with torch).

Prints a markdown table (the one in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WORLDS = (8, 64, 512, 4096, 65536, 1048576)
KINDS = ("baseline", "default", "full_dtensor", "spmd_types")
BASE = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SHAPES = ("5-axis", "fsdp-only")


def degrees(world: int, shape: str = "5-axis") -> dict[str, int]:
    """The parallel degrees benchmarked at ``world`` ranks.

    ``5-axis``: every axis > 1 from 64 ranks up. ``fsdp-only``: ``dp_shard = world``.
    """
    if shape == "fsdp-only":
        return {"pp": 1, "dp_replicate": 1, "dp_shard": world, "cp": 1, "tp": 1, "ep": 1}
    if shape != "5-axis":
        raise ValueError(f"unknown shape {shape!r}; valid shapes are {', '.join(SHAPES)}")
    if world == 8:
        return {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2, "ep": 2}
    if world == 64:
        return {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 4, "ep": 8}
    if world % 128:
        raise ValueError(f"no benchmark configuration for world size {world}")
    return {"pp": 4, "dp_replicate": 2, "dp_shard": world // 128, "cp": 2, "tp": 8, "ep": 32}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(kind: str, world: int, shape: str) -> dict[str, float]:
    """One measurement in this (fresh) process."""
    import gc
    import resource

    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_spmd.distributed.parallel_dims import ParallelDims

    d = degrees(world, shape)
    dist.init_process_group("fake", rank=0, world_size=world)
    c10d = dist.distributed_c10d
    # Every new_group call (member or not, on every torch) goes through this one.
    calls = [0]
    new_group_with_tag = c10d._new_group_with_tag

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003
        calls[0] += 1
        return new_group_with_tag(*args, **kwargs)

    c10d._new_group_with_tag = counting
    groups_before = len(c10d._world.pg_names)
    gc.collect()
    rss_before = _rss_bytes()
    if kind == "baseline":
        start = time.perf_counter()
        init_device_mesh("cpu", tuple(d[a] for a in BASE), mesh_dim_names=BASE)
        seconds = time.perf_counter() - start
    else:
        pd = ParallelDims(
            d["dp_replicate"], d["dp_shard"], d["cp"], d["tp"], d["pp"], d["ep"], world,
            spmd_backend=kind, device_type="cpu",
        )
        start = time.perf_counter()
        pd.build_mesh()
        seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "seconds": seconds,
        "peak_mib": max(0, peak - rss_before) / 2**20,
        "calls": calls[0],
        "groups": len(c10d._world.pg_names) - groups_before,
    }


def measure(kind: str, world: int, shape: str, repeats: int) -> dict[str, float]:
    """The fastest of ``repeats`` fresh-process measurements."""
    best: dict[str, float] | None = None
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, __file__, "--worker", kind, str(world), shape],
            capture_output=True, text=True, check=False, timeout=1800,
        )
        if out.returncode:
            raise RuntimeError(f"{kind} at {world} ranks ({shape}) failed:\n{out.stderr}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if best is None or result["seconds"] < best["seconds"]:
            best = result
    assert best is not None
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-world", type=int, default=65536)
    parser.add_argument("--min-world", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", choices=(*SHAPES, "all"), default="all")
    parser.add_argument("--worker", nargs=3, metavar=("KIND", "WORLD", "SHAPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, world, shape = args.worker
        print(json.dumps(worker(kind, int(world), shape)))
        return 0
    print("| world | shape | degrees (pp, dp_replicate, dp_shard, cp, tp; ep) | mesh build | seconds "
          "| × baseline | peak RSS growth (MiB) | new_group calls | groups |")
    print("|---:|---|---|---|---:|---:|---:|---:|---:|")
    shapes = SHAPES if args.shape == "all" else (args.shape,)
    for world in (w for w in WORLDS if args.min_world <= w <= args.max_world):
        for shape in shapes:
            d = degrees(world, shape)
            degs = f"{', '.join(str(d[a]) for a in BASE)}; {d['ep']}"
            repeats = args.repeats if world <= 65536 else 1
            baseline = None
            for kind in KINDS:
                r = measure(kind, world, shape, repeats)
                baseline = baseline or r["seconds"]
                label = "init_device_mesh (baseline)" if kind == "baseline" else f"build_mesh {kind}"
                print(
                    f"| {world:,} | {shape} | {degs} | {label} | {r['seconds']:.3f} | "
                    f"{r['seconds'] / baseline:.2f} | {r['peak_mib']:.1f} | {int(r['calls']):,} "
                    f"| {int(r['groups']):,} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
