"""Layer 2: upstream b5bcd76's (August) ``ParallelDims`` methods, on a fake process group.

``spmd_dense_mesh()``, ``spmd_sparse_mesh()``, ``get_dense_tp_mesh()`` and the
``spmd_sparse_for_fwdbwd`` global mesh, at 8 and 64 ranks. The expected rank grids are
upstream's rule written out here (``build_mesh`` unflattens the world row-major into
``(pp, dp, cp, tp)`` for the dense mesh and ``(pp, dp_replicate, efsdp, ep)`` for the
sparse one, each then taken at this rank's ``pp``), not read from the code under test.
"""

from __future__ import annotations

import pytest
import torch

from torchtitan_spmd.config.surface import set_surface
from torchtitan_spmd.distributed import ParallelDims
from torchtitan_spmd.distributed.parallel_dims import SpmdMeshUnavailableError

# (world, rank, dp_replicate, dp_shard, cp, tp, pp, ep)
CASES = [
    (8, 3, 2, 2, 1, 2, 1, 1),
    (8, 5, 1, 4, 1, 2, 1, 2),
    (64, 37, 2, 2, 2, 4, 2, 4),
    (64, 0, 1, 8, 2, 2, 2, 8),
]


def _dense_grid(world: int, rank: int, dpr: int, dps: int, cp: int, tp: int, pp: int) -> list:
    return torch.arange(world).reshape(pp, dpr * dps, cp, tp)[rank // (world // pp)].tolist()


def _sparse_grid(world: int, rank: int, dpr: int, dps: int, cp: int, tp: int, pp: int, ep: int) -> list:
    efsdp = dps * cp * tp // ep
    return torch.arange(world).reshape(pp, dpr, efsdp, ep)[rank // (world // pp)].tolist()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"w{c[0]}r{c[1]}")
def test_spmd_dense_and_sparse_mesh_under_spmd_types(fake_pg, case) -> None:
    world, rank, dpr, dps, cp, tp, pp, ep = case
    fake_pg(world, rank)
    pd = ParallelDims(dpr, dps, cp, tp, pp, ep, world, spmd_backend="spmd_types", device_type="cpu")
    dense = pd.spmd_dense_mesh()  # builds on first use, as upstream's
    assert dense.mesh_dim_names == ("dp", "cp", "tp")  # size-1 axes kept
    assert dense.mesh.tolist() == _dense_grid(world, rank, dpr, dps, cp, tp, pp)
    assert dense is pd._global_meshes["spmd_dense_for_fwdbwd"]
    sparse = pd.spmd_sparse_mesh()
    if ep == 1:
        assert sparse is None
        assert "spmd_sparse_for_fwdbwd" not in pd._global_meshes
    else:
        assert sparse is not None and sparse.mesh_dim_names == ("dp_replicate", "efsdp", "ep")
        assert sparse.mesh.tolist() == _sparse_grid(world, rank, dpr, dps, cp, tp, pp, ep)
        assert sparse is pd._global_meshes["spmd_sparse_for_fwdbwd"]
    tp_mesh = pd.get_dense_tp_mesh()
    assert tp_mesh.mesh_dim_names == ("tp",) and tp_mesh.size() == tp
    row = [r for plane in _dense_grid(world, rank, dpr, dps, cp, tp, pp) for line in plane for r in line]
    i = row.index(rank)
    assert tp_mesh.mesh.tolist() == row[i - i % tp: i - i % tp + tp]  # this rank's tp neighbours


def test_get_dense_tp_mesh_at_tp_1(fake_pg) -> None:
    fake_pg(8)
    spmd = ParallelDims(1, 8, 1, 1, 1, 1, 8, spmd_backend="spmd_types", device_type="cpu")
    assert spmd.get_dense_tp_mesh().size() == 1  # upstream: spmd_dense_mesh()["tp"], even at size 1
    partial = ParallelDims(1, 8, 1, 1, 1, 1, 8, spmd_backend="partial_dtensor", device_type="cpu")
    with pytest.raises(ValueError, match="Mesh 'tp' is not available"):
        partial.get_dense_tp_mesh()  # upstream: get_mesh("tp") raises when TP is off


@pytest.mark.parametrize("spelling", ["partial_dtensor", "default"])
def test_partial_dtensor_has_no_spmd_meshes(fake_pg, spelling: str) -> None:
    fake_pg(8)
    pd = ParallelDims(1, 2, 1, 4, 1, 2, 8, spmd_backend=spelling, device_type="cpu")
    with pytest.raises(KeyError, match="has no dense SPMD mesh"):  # upstream: KeyError
        pd.spmd_dense_mesh()
    with pytest.raises(ValueError, match="has no dense SPMD mesh"):  # and a ValueError here
        pd.spmd_dense_mesh()
    assert pd.spmd_sparse_mesh() is None  # upstream: _global_meshes.get(...) is None
    assert pd.get_dense_tp_mesh() is pd.get_mesh("tp")
    assert pd.spmd_backend == spelling  # read back as written


def test_full_dtensor_extension_meshes(fake_pg) -> None:
    fake_pg(8)
    pd = ParallelDims(2, 2, 1, 2, 1, 2, 8, spmd_backend="full_dtensor", device_type="cpu")
    assert pd.spmd_dense_mesh() is pd.spmd_meshes()[0]  # its active axes, as spmd_meshes()
    assert pd.spmd_dense_mesh().mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
    assert pd.spmd_sparse_mesh() is pd.spmd_meshes()[1]
    assert isinstance(SpmdMeshUnavailableError("x"), KeyError)


@pytest.mark.parametrize(("surface", "expected"), [("june", "default"), ("august", "spmd_types")])
def test_default_backend_follows_the_surface(fake_pg, surface: str, expected: str) -> None:
    fake_pg(8)
    set_surface(surface)
    try:
        assert ParallelDims(1, -1, 1, 1, 1, 1, 8, device_type="cpu").spmd_backend == expected
    finally:
        set_surface(None)
