"""Layer 2: the parts of ``ParallelDims`` that forks use by torchtitan's names and semantics.

``spmd_meshes()`` (torchtitan's dense and sparse candidates), ``resolve_shared_mesh``,
the module-level ``device_type`` and lazy building by the getters. Expected axes come
from torchtitan's rules, written out here, not from the code under test.
"""

from __future__ import annotations

from unittest import mock

import pytest

import torchtitan_spmd.distributed.parallel_dims as parallel_dims_module
from torchtitan_spmd.distributed import ParallelDims
from torchtitan_spmd.distributed.layout import R, S, V
from torchtitan_spmd.distributed.parallel_dims import MeshAxisName, SpmdLayout

BACKENDS = ("default", "full_dtensor", "spmd_types")

# dp_replicate 2 x dp_shard 2 x tp 2 on 8 ranks: torchtitan's spmd_meshes().
SPMD_2x2x2 = {
    "default": [("dp_replicate", "fsdp", "tp"), ("dp_replicate",)],
    "full_dtensor": [("dp_replicate", "dp_shard", "tp"), ("dp_replicate",)],
    "spmd_types": [("dp", "tp"), ("dp_replicate",)],
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_spmd_meshes_2x2x2(fake_pg, backend: str) -> None:
    fake_pg(8, 3)
    pd = ParallelDims(2, 2, 1, 2, 1, 1, 8, spmd_backend=backend, device_type="cpu")
    meshes = pd.spmd_meshes()  # builds on first use
    assert [m.mesh_dim_names for m in meshes] == SPMD_2x2x2[backend]
    assert all(a is b for a, b in zip(meshes, pd.spmd_meshes(), strict=True))  # same objects


@pytest.mark.parametrize("backend", BACKENDS)
def test_spmd_meshes_with_experts(fake_pg, backend: str) -> None:
    fake_pg(8)
    pd = ParallelDims(1, 4, 1, 2, 1, 2, 8, spmd_backend=backend, device_type="cpu")
    sparse = pd.spmd_meshes()[-1]
    assert sparse.mesh_dim_names == ("efsdp", "ep")  # dp_replicate == 1 is dropped
    assert sparse.shape == (4, 2)


def test_spmd_meshes_of_one_rank(fake_pg) -> None:
    fake_pg(1)
    assert [m.mesh_dim_names for m in ParallelDims(1, 1, 1, 1, 1, 1, 1, device_type="cpu").spmd_meshes()] == [
        ("fsdp",)  # fsdp always has a real group (mixed precision at size 1)
    ]
    spmd = ParallelDims(1, 1, 1, 1, 1, 1, 1, spmd_backend="spmd_types", device_type="cpu")
    assert spmd.spmd_meshes() == []  # dp, cp, tp and the sparse axes are all size 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_resolve_shared_mesh(fake_pg, backend: str) -> None:
    fake_pg(8)
    pd = ParallelDims(1, 2, 2, 2, 1, 1, 8, spmd_backend=backend, device_type="cpu")
    dp, cp, tp = MeshAxisName.DP, MeshAxisName.CP, MeshAxisName.TP
    src = SpmdLayout({dp: S(0), cp: S(1), tp: R})
    dst = SpmdLayout({dp: V, cp: V, tp: V}, partition_spec=(dp, (cp, tp)))  # same axes, other types
    mesh = pd.resolve_shared_mesh([None, src, None, dst])
    assert mesh is pd.resolve_mesh([dp, cp, tp])
    want = {"default": ("tp",), "full_dtensor": ("dp_shard", "cp", "tp"), "spmd_types": ("dp", "cp", "tp")}
    assert mesh is not None and mesh.mesh_dim_names == want[backend]
    assert pd.resolve_shared_mesh([None, None]) is None
    assert pd.resolve_shared_mesh([]) is None
    with pytest.raises(ValueError, match=r"Inconsistent mesh axes.*\['dp', 'cp', 'tp'\] vs \['dp', 'tp'\]"):
        pd.resolve_shared_mesh([src, SpmdLayout({dp: S(0), tp: R})])


@pytest.mark.backend("default")
def test_resolve_shared_mesh_out_of_band_is_none(fake_pg) -> None:
    fake_pg(4)
    pd = ParallelDims(1, 4, 1, 1, 1, 1, 4, device_type="cpu")
    assert pd.resolve_shared_mesh([SpmdLayout({"dp": S(0)}), SpmdLayout({"dp": R})]) is None


def test_module_level_device_type_is_the_default(fake_pg) -> None:
    assert parallel_dims_module.device_type in ("cpu", "cuda")
    with mock.patch("torchtitan_spmd.distributed.parallel_dims.device_type", "meta"):
        assert ParallelDims(1, 1, 1, 1, 1, 1, 1).device_type == "meta"
        assert ParallelDims(1, 1, 1, 1, 1, 1, 1, device_type="cpu").device_type == "cpu"
    with mock.patch("torchtitan_spmd.distributed.parallel_dims.device_type", "cpu"):
        fake_pg(2)
        pd = ParallelDims(1, 2, 1, 1, 1, 1, 2)
        assert pd.world_mesh.device_type == "cpu"


def test_getters_build_lazily(fake_pg) -> None:
    fake_pg(2)
    pd = ParallelDims(1, 2, 1, 1, 1, 1, 2, device_type="cpu")
    assert pd._single_axis_meshes == {}
    assert pd.get_optional_mesh("tp") is None  # inactive, but the meshes are built now
    assert pd._single_axis_meshes["fsdp"].size() == 2
    # size > 1 and a real group: fake-backed efsdp (ep == 1, size 2) left out, as torchtitan's #4068
    assert pd._single_axis_meshes["efsdp"].size() == 2
    assert pd.get_all_one_dimensional_meshes().keys() == {"fsdp", "batch", "loss"}


# ----------------------------------------------------------------- upstream's later fixes and names
# Expected values from torchtitan's rules: a0c831c49's get_activated_mesh keeps the
# requested axes that exist under the backend and are enabled (others are dropped);
# #4068 (96276d865) leaves fake-backed axes out of get_all_one_dimensional_meshes.
FLUX_DP = {  # get_activated_mesh(["dp_replicate", "fsdp"]), models/flux/parallelize.py
    "default": ("dp_replicate", "fsdp"),
    "full_dtensor": ("dp_replicate",),  # no "fsdp" axis there: dropped
    "spmd_types": ("dp_replicate",),
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_get_activated_mesh_drops_axes_the_backend_lacks(fake_pg, backend: str) -> None:
    fake_pg(4)
    pd = ParallelDims(2, 2, 1, 1, 1, 1, 4, spmd_backend=backend, device_type="cpu")
    mesh = pd.get_activated_mesh(["dp_replicate", "fsdp"])
    assert mesh is not None and mesh.mesh_dim_names == FLUX_DP[backend]
    assert pd.get_activated_mesh(["no_such_axis"]) is None
    assert pd.get_activated_mesh(["no_such_axis", "tp", "cp"]) is None  # tp, cp size 1
    hsdp_less = ParallelDims(1, 4, 1, 1, 1, 1, 4, spmd_backend=backend, device_type="cpu")
    fake_pg_mesh = hsdp_less.get_activated_mesh(["dp_replicate", "fsdp"])
    if backend == "default":
        assert fake_pg_mesh is not None and fake_pg_mesh.mesh_dim_names == ("fsdp",)
    else:
        assert fake_pg_mesh is None  # dp_replicate inactive, fsdp unknown


@pytest.mark.parametrize("backend", ["default", "spmd_types"])
def test_resolve_mesh_drops_unknown_axes(fake_pg, backend: str) -> None:
    fake_pg(4)
    pd = ParallelDims(1, 2, 1, 2, 1, 1, 4, spmd_backend=backend, device_type="cpu")
    want = {"default": ("tp",), "spmd_types": ("dp", "tp")}[backend]
    mesh = pd.resolve_mesh(["dp", "experts_of_a_fork", "tp"])
    assert mesh is not None and mesh.mesh_dim_names == want
    assert mesh is pd.resolve_mesh(["dp", "tp"])  # the same cached mesh
    assert pd.resolve_mesh(["experts_of_a_fork"]) is None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ep", [1, 2])
def test_one_dimensional_meshes_leave_out_fake_axes(fake_pg, backend: str, ep: int) -> None:
    fake_pg(8)
    pd = ParallelDims(1, 4, 1, 2, 1, ep, 8, spmd_backend=backend, device_type="cpu")
    pd.build_mesh()
    assert pd._single_axis_meshes["efsdp"].size() == 8 // ep
    one_d = pd.get_all_one_dimensional_meshes()
    dense = {"default": {"fsdp"}, "full_dtensor": {"dp_shard"}, "spmd_types": {"dp", "dp_shard"}}[backend]
    assert set(one_d) == {"batch", "loss", "tp", *dense, *({"efsdp", "ep"} if ep > 1 else set())}
    assert (pd.get_optional_mesh("efsdp") is None) is (ep == 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_mesh_dim_is_named_loss_mesh(fake_pg, backend: str) -> None:
    fake_pg(8)
    pd = ParallelDims(2, 2, 2, 1, 1, 1, 8, spmd_backend=backend, device_type="cpu")
    loss = pd.get_mesh("loss")  # the axis is still called "loss"
    assert loss.mesh_dim_names == ("loss_mesh",) and loss.size() == 8
    assert pd._global_meshes["loss"] is loss
    assert pd._global_meshes["dataloading"]["batch", "cp"]._flatten("loss_mesh") is loss  # torchtitan's call
