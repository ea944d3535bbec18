"""Layer 2: ``ParallelDims.build_mesh`` reuses the previous build's meshes, and DTensor's sharding
caches are kept only while they can refer to nothing else (``distributed/mesh_reuse.py``).

Real gloo ranks, each case forked from one clean interpreter (this worker's earlier tests, and a
warm world's earlier launches, would change what the process holds): whether a DTensor op's sharding decision misses the cache is the observable.
fully_shard over a second trainer's mesh is layer 3's (tests/layer3_runtime/test_mesh_reuse_fsdp.py). The unsafe cases
are run for real: an op on a second, equal mesh over a destroyed and re-created process group
(which fails if an entry of the first comes back), and fully_shard over a second trainer's
mesh object.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchtitan_spmd.distributed import ParallelDims  # imported before forking: cheap ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.fresh_world(reason="counts what one process caches")]


def _op_on(pd: ParallelDims) -> tuple[float, int]:
    """A DTensor matmul sharded over ``tp``, gathered (real collectives): its value, and how many
    of its sharding decisions DTensor's cache missed (0: all came from the cache)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    misses = torch._C._get_DTensor_sharding_propagator_cache_stats()[1]
    mesh = pd.get_mesh("tp")
    a = distribute_tensor(torch.arange(8.0).reshape(2, 4), mesh, [Shard(1)])
    b = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    total = float((a @ b).redistribute(mesh, [Replicate()]).to_local().sum())
    return total, torch._C._get_DTensor_sharding_propagator_cache_stats()[1] - misses


_CHILD = """
import pickle, sys, traceback
sys.path.insert(0, {folder!r})
import {module} as t
from torchtitan_spmd.launcher import run_forked
out = {{}}
for name, args in {cases!r}.items():
    try:
        out[name] = ("ok", run_forked(getattr(t, name), 4, *args, timeout_s={timeout_s}))
    except BaseException:
        out[name] = ("raised", traceback.format_exc())
pickle.dump(out, open({out!r}, "wb"))
"""


def in_a_clean_interpreter(module_file: str, cases: dict[str, tuple[Any, ...]], *,
                           timeout_s: float) -> dict[str, tuple[str, Any]]:
    """Each case (a function of ``module_file`` and its arguments) on 4 ranks forked from one new
    interpreter: a process holding no mesh, DTensor cache entry or registered group of earlier
    tests (this worker's, which every fork of it would inherit, and which the caches' rule
    rightly counts as other meshes alive).

    Each case forks its ranks afresh from that interpreter, which builds no mesh and runs no
    DTensor op itself, so a case starts as clean as in an interpreter of its own (the import of
    torch is paid once). Returns ``{case: ("ok", per-rank results) or ("raised", traceback)}``: a
    case that raises does not stop the others.
    """
    import pickle
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mesh-reuse-") as tmp:
        out = Path(tmp) / "out.pkl"
        code = _CHILD.format(folder=str(Path(module_file).parent), module=Path(module_file).stem,
                             cases=cases, timeout_s=timeout_s, out=str(out))
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=len(cases) * timeout_s + 60, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(out, "rb") as f:
            return pickle.load(f)


def results_of(runs: dict[str, tuple[str, Any]], case: str) -> list[Any]:
    """A case's per-rank results; its test fails with the ranks' traceback if it raised."""
    status, value = runs[case]
    if status != "ok":
        pytest.fail(f"{case} failed in the clean interpreter:\n{value}", pytrace=False)
    return value


@pytest.fixture(scope="module")
def clean_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Any]]:
    """This module's five cases, from one clean interpreter (:func:`in_a_clean_interpreter`)."""
    store = tmp_path_factory.mktemp("mesh-reuse-store")
    cases = {"_same_layout_keeps": (), "_other_layout_clears": (), "_foreign_mesh_clears": (),
             "_dropped_mesh_keeps": (), "_new_process_group": (str(store),)}
    return in_a_clean_interpreter(__file__, cases, timeout_s=120)


def _pd(tp: int = 2, dp_shard: int = 2, backend: str = "full_dtensor") -> ParallelDims:
    return ParallelDims(1, dp_shard, 1, tp, 1, 1, 4, spmd_backend=backend, device_type="cpu")


def _same_layout_keeps(rank: int, world: int) -> dict[str, object]:
    import gc

    first = _pd()
    first.build_mesh()
    cold = _op_on(first)
    second = _pd()
    collections, collect = [], gc.collect
    gc.collect = lambda *a: collections.append(a) or collect(*a)  # type: ignore[assignment]
    try:
        second.build_mesh()
    finally:
        gc.collect = collect
    return {"same_objects": second.world_mesh is first.world_mesh and second.get_mesh("tp") is first.get_mesh("tp"),
            "cold": cold, "warm": _op_on(second), "collections": len(collections)}


def test_a_second_parallel_dims_of_the_same_layout_gets_the_same_meshes_and_warm_caches(clean_runs: dict) -> None:
    """The same mesh objects and warm caches, and no full collection to find that out when no other
    mesh is alive (in a forked rank one touches the parent's whole heap too: about 0.9 s a trainer
    in the suite's multi-trainer ranks, on a loaded 2-core machine)."""
    for out in results_of(clean_runs, "_same_layout_keeps"):
        assert out["same_objects"] and out["collections"] == 0, out
        (total, cold_misses), (again, warm_misses) = out["cold"], out["warm"]
        assert total == again == 28.0 * 3, out  # (0+...+7) x 3 columns of ones
        assert cold_misses > 0 and warm_misses == 0, out


def _planners_on(pd: ParallelDims) -> int:
    """How many of DTensor's cached redistribution planners hold a mesh of ``pd``'s."""
    from torch.distributed.tensor import _redistribute

    held = [ref() for ref, _ in getattr(_redistribute, "_planner_cache", {})]
    roots = [mesh if getattr(mesh, "_root_mesh", None) is None else mesh._root_mesh for mesh in held]
    return sum(1 for root in roots if root is pd.world_mesh)


def _other_layout_clears(rank: int, world: int) -> dict[str, object]:
    first = _pd(backend="default")
    first.build_mesh()
    _op_on(first)
    planners = _planners_on(first)
    other = _pd(backend="full_dtensor")  # other names and groups, an equal-sized tp axis
    other.build_mesh()
    planners_after = _planners_on(first)
    on_switch = _op_on(other)
    back = _pd(backend="default")  # the previous layout is not kept once another was built
    back.build_mesh()
    return {"on_switch": on_switch, "new_objects": back.world_mesh is not first.world_mesh, "on_return": _op_on(back),
            "planners": (planners, planners_after)}


def test_another_layout_builds_new_meshes_and_clears_the_caches(clean_runs: dict) -> None:
    """New meshes, and DTensor's caches cleared: its sharding decisions, and its redistribution
    planners, each of which held its mesh (and so its groups) alive for the rest of the process."""
    for out in results_of(clean_runs, "_other_layout_clears"):
        assert out["new_objects"], out
        assert out["on_switch"][0] == out["on_return"][0] == 84.0, out
        assert out["on_switch"][1] > 0 and out["on_return"][1] > 0, out  # missed: cleared
        assert out["planners"][0] > 0 and out["planners"][1] == 0, out


def _foreign_mesh_clears(rank: int, world: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    first = _pd()
    first.build_mesh()
    _op_on(first)
    mine = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))  # equal to a view of ours
    x = distribute_tensor(torch.ones(4), mine["tp"], [Replicate()])
    (x * 2).to_local()
    again = _pd()
    again.build_mesh()
    return {"reused": again.world_mesh is first.world_mesh, "after": _op_on(again)}


def test_a_mesh_built_elsewhere_clears_the_caches_at_the_next_reuse(clean_runs: dict) -> None:
    """A mesh of the caller's own (equal to a view of the kept ones) may be in the caches: the
    reuse hands out the kept meshes but clears them."""
    for out in results_of(clean_runs, "_foreign_mesh_clears"):
        assert out["reused"] and out["after"] == (84.0, out["after"][1]) and out["after"][1] > 0, out


def _dropped_mesh_keeps(rank: int, world: int) -> dict[str, object]:
    import gc

    from torch.distributed.device_mesh import init_device_mesh

    first = _pd()
    first.build_mesh()
    _op_on(first)
    gc.disable()  # as a trainer has it: only a collection frees the dropped mesh below
    try:
        mine = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        mine.myself = mine  # a cycle: dropped, it lives on until the cycle collector runs
        del mine
        again = _pd()
        again.build_mesh()
        return {"reused": again.world_mesh is first.world_mesh, "after": _op_on(again)}
    finally:
        gc.enable()


def test_a_dropped_mesh_built_elsewhere_is_collected_and_the_caches_kept(clean_runs: dict) -> None:
    """A mesh of the caller's own that no one refers to any more (garbage in a cycle, never in a
    cache entry) is collected by the check, and the caches stay warm."""
    for out in results_of(clean_runs, "_dropped_mesh_keeps"):
        assert out["reused"] and out["after"] == (84.0, 0), out


def _new_process_group(rank: int, world: int, store_dir: str) -> dict[str, object]:
    first = _pd()
    first.build_mesh()
    total, _ = _op_on(first)
    dist.destroy_process_group()
    store = dist.FileStore(f"{store_dir}/again", world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    second = _pd()
    second.build_mesh()
    return {"new_objects": second.world_mesh is not first.world_mesh, "total": total, "again": _op_on(second)[0]}


def test_a_new_default_process_group_gets_new_meshes_and_working_ops(clean_runs: dict) -> None:
    """The unsafe case run for real: an entry of the first meshes coming back would route the
    second op through a destroyed group."""
    for out in results_of(clean_runs, "_new_process_group"):
        assert out["new_objects"] and out["total"] == out["again"] == 84.0, out
