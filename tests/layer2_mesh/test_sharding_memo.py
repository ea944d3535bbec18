"""Sharding propagation remembered across forked launches gives exactly what torch computes.

``torchtitan_spmd.distributed.sharding_memo`` keeps DTensor's propagation results in the
launching process, so later forks skip the computation. The reference is torch's own
propagation (the wrapped function itself) on the same call: a second launch, forked after the
first one's results were merged, runs the same DTensor program, and every result the memo hands
out is compared, field by field, with a fresh computation by torch for the very call that asked.

The program covers the cases the key and the rebinding must get right: redistributions of
``mm`` inputs, ``Partial`` sums, views and factory ops whose shape argument torch rewrites to
the *local* shape (uneven here: 5 rows on 2 ranks, so the ranks' results differ), a
``_local_scalar_dense`` (whose result holds the call itself), and a backward. It runs on two
equal meshes with different process groups: results must point at the asking call's mesh.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from torchtitan_spmd import launcher
from torchtitan_spmd.distributed import sharding_memo

pytestmark = pytest.mark.skipif(sharding_memo.unsupported_reason() is not None,
                                reason=f"no memo for this torch: {sharding_memo.unsupported_reason()}")


def _program(mesh: Any) -> float:
    """A DTensor program on a 2 x 2 mesh; returns a number every rank agrees on."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: PLC0415

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(5, 4, generator=gen, requires_grad=True)
    b = torch.randn(4, 6, generator=gen)
    da = distribute_tensor(a.detach(), mesh, [Shard(0), Replicate()]).requires_grad_()
    db = distribute_tensor(b, mesh, [Replicate(), Shard(1)])
    out = torch.mm(da, db)                                  # Shard(0) x Shard(1)
    out = out.view(5, 2, 3).sum(-1)                        # uneven rows: local shapes per rank
    zeros = out.new_zeros(5, 2)                            # a shape rewritten to the local one
    out = torch.softmax(out + zeros, dim=-1).transpose(0, 1)
    part = DTensor.from_local(torch.ones(2, 5), mesh, [Replicate(), Partial()])
    total = (out * 2 + part).sum()                          # Partial reductions
    total.backward()
    grad = da.grad.full_tensor()
    scalar = total.full_tensor().item()                     # aten._local_scalar_dense
    return round(scalar + float(grad.sum()), 6)


def _meshes() -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    first = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    second = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert first == second and first.get_group("tp") is not second.get_group("tp")
    return first, second


def _record(rank: int, world: int) -> tuple[float, list[int]]:
    first, _ = _meshes()
    return _program(first), list(sharding_memo.STATS)


def _structure(value: Any, meshes: list[Any]) -> Any:
    """``value`` as nested tuples; each mesh becomes its position in ``meshes`` (by identity)."""
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415

    if isinstance(value, DeviceMesh):
        for i, mesh in enumerate(meshes):
            if value is mesh:
                return ("mesh", i)
        return ("foreign mesh", id(value))
    if isinstance(value, list | tuple):
        return (type(value).__name__, *(_structure(v, meshes) for v in value))
    if isinstance(value, dict):
        return ("dict", *sorted((k, _structure(v, meshes)) for k, v in value.items()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                  if not f.name.startswith("_")}
        return (type(value).__name__, *((k, _structure(v, meshes)) for k, v in fields.items()))
    return value


def _compare(rank: int, world: int) -> dict[str, Any]:
    """Run the program on two equal meshes, checking every result the memo hands out."""
    from torchtitan_spmd.distributed.mesh_reuse import clear_dtensor_sharding_caches  # noqa: PLC0415

    prop = sharding_memo._propagator()
    memoised = prop.propagate_op_sharding_non_cached
    torch_compute = memoised.__wrapped__
    handed_out: list[tuple[Any, Any]] = []

    def watching(op_schema: Any) -> Any:
        result = memoised(op_schema)
        handed_out.append((op_schema, result))
        return result

    prop.propagate_op_sharding_non_cached = watching
    prop.propagate_op_sharding = type(prop.propagate_op_sharding)(watching)
    first, second = _meshes()
    values = [_program(first)]
    clear_dtensor_sharding_caches()  # torch's caches would hand the second mesh the first's results
    values.append(_program(second))
    mismatches = []
    for op_schema, result in handed_out:
        meshes = [first, second]
        # torch binds its result to the asking call's mesh, so equal structures (meshes compared
        # by identity) also prove the memo's result is bound to it, not to the first program's
        got, want = _structure(result, meshes), _structure(torch_compute(op_schema), meshes)
        if got != want:
            mismatches.append(f"{op_schema.op}: memo {got} != torch {want}")
    return {"values": values, "stats": list(sharding_memo.STATS), "calls": len(handed_out),
            "mismatches": mismatches}


@pytest.fixture
def empty_memo(monkeypatch: pytest.MonkeyPatch) -> Any:
    """This process's table empty, and no folder shared with sibling processes (the suite's)."""
    monkeypatch.delenv(sharding_memo.DIR_ENV, raising=False)
    monkeypatch.setattr(sharding_memo, "_SEEN", set())
    saved = dict(sharding_memo._ENTRIES)
    sharding_memo._ENTRIES.clear()
    yield
    sharding_memo._ENTRIES.clear()
    sharding_memo._ENTRIES.update(saved)


def test_a_later_launch_gets_torchs_own_results_from_the_memo(empty_memo: None) -> None:
    first = launcher.run_forked(_record, 4, timeout_s=120)
    assert all(misses > 0 for _, (_, misses) in first), first
    assert len(sharding_memo._ENTRIES) > 0, "the launch's results were not merged into this process"
    second = launcher.run_forked(_compare, 4, timeout_s=120)
    for rank, got in enumerate(second):
        assert got["mismatches"] == [], f"rank {rank}:\n" + "\n".join(got["mismatches"])
        hits, misses = got["stats"]
        # every call of the first mesh's program was remembered; the second mesh's too
        assert misses == 0 and hits == got["calls"] > 10, (rank, got["stats"], got["calls"])
        assert got["values"] == [first[rank][0]] * 2, (rank, got["values"], first[rank][0])


def test_a_sibling_process_shares_its_results_through_the_folder(
        empty_memo: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another interpreter (its own string hashes: a cached hash must not be in the bytes) runs
    the program and publishes into the folder; this process's next launch is answered from it,
    with torch's own results."""
    folder = tmp_path / "memo"
    code = ("from test_sharding_memo import _record\n"
            "from torchtitan_spmd import launcher\n"
            "launcher.run_forked(_record, 4, timeout_s=120)\n")
    env = {**os.environ, sharding_memo.DIR_ENV: str(folder), "PYTHONHASHSEED": "random"}
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(folder.glob("*.memo")), "the sibling published nothing"
    assert not sharding_memo._ENTRIES
    monkeypatch.setenv(sharding_memo.DIR_ENV, str(folder))
    second = launcher.run_forked(_compare, 4, timeout_s=120)
    for rank, got in enumerate(second):
        assert got["mismatches"] == [], f"rank {rank}:\n" + "\n".join(got["mismatches"])
        hits, misses = got["stats"]
        assert misses == 0 and hits == got["calls"] > 10, (rank, got["stats"], got["calls"])


def _off(rank: int, world: int) -> list[int]:
    first, _ = _meshes()
    _program(first)
    return list(sharding_memo.STATS)


def test_the_environment_variable_turns_it_off(empty_memo: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sharding_memo.ENV, "0")
    assert launcher.run_forked(_off, 4, timeout_s=120) == [[0, 0]] * 4
    assert sharding_memo._ENTRIES == {}


def test_merge_stops_at_the_cap_and_read_skips_a_damaged_file(
        empty_memo: None, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharding_memo, "MAX_ENTRIES", 3)
    good = tmp_path / "rank0.memo"
    good.write_bytes(pickle.dumps({bytes([i]): b"v" for i in range(5)}))
    bad = tmp_path / "rank1.memo"
    bad.write_bytes(b"\x80\x05 not a pickle")
    sharding_memo.read([str(bad), str(tmp_path / "missing"), str(good)])
    assert len(sharding_memo._ENTRIES) == 3
    assert os.path.exists(good)
