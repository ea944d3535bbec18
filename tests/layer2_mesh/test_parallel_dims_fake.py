"""Layer 2: every backend's meshes under a single-process fake process group.

Expected values are derived from the spec, independently of the code under test:
rank groups from a row-major ``arange(world).reshape(pp, dp_replicate, dp_shard,
cp, tp)`` grid and real/fake axes (``mesh_spec_helpers.py``), ``resolve_mesh`` and
``spmd_meshes`` from the rules in the issue (here).
"""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist
from mesh_spec_helpers import BACKENDS, BASE, Cfg, expected_active, expected_groups

from torchtitan_spmd.distributed import ParallelDims
from torchtitan_spmd.distributed.parallel_dims import MeshAxisName, unfold_dp_axes, unfold_dp_axis

CONFIGS = {
    "dp_replicate2-dp_shard2-tp2": Cfg(dp_replicate=2, dp_shard=2, tp=2, rank=5),
    "dp_shard2-cp2-tp2-ep2": Cfg(dp_shard=2, cp=2, tp=2, ep=2, rank=6),
    "pp8": Cfg(pp=8, rank=3),
    "world1": Cfg(),
    # 4096 ranks, all five axes > 1; ep=16 spans tp and half of cp.
    "world4096": Cfg(pp=4, dp_replicate=2, dp_shard=16, cp=4, tp=8, ep=16, rank=2777),
}


# --------------------------------------------------------------------------- the spec
COMMON_NAMES = {"pp", "batch", "loss", "dp_replicate", "cp", "tp", "ep", "efsdp"}
EXTRA_NAMES = {"default": {"fsdp"}, "full_dtensor": {"dp_shard"}, "spmd_types": {"dp", "dp_shard"}}

GLOBAL_MESHES = {
    "default": {"dense": ("pp", "dp_replicate", "fsdp", "tp")},
    "full_dtensor": {"dense": BASE},
    "spmd_types": {"storage": BASE, "dense": ("pp", "dp", "cp", "tp")},
}
#: torchtitan names the loss mesh's one dim ``loss_mesh`` (its axis is ``loss``).
DIM_NAME = {"loss": "loss_mesh"}
COMMON_GLOBAL = {
    "data": ("pp", "batch", "cp", "tp"),
    "loss": ("loss",),
    "sparse": ("pp", "dp_replicate", "efsdp", "ep"),
}
# torchtitan's candidates for spmd_meshes(): (dense, sparse), before inactive axes are dropped.
SPARSE_SPMD = ("dp_replicate", "efsdp", "ep")
SPMD_MESH_AXES = {
    "default": [("dp_replicate", "fsdp", "tp"), SPARSE_SPMD],
    "full_dtensor": [("dp_replicate", "dp_shard", "cp", "tp"), SPARSE_SPMD],
    "spmd_types": [("dp", "cp", "tp"), SPARSE_SPMD],
}
IN_BAND = {"default": {"tp", "ep"}, "full_dtensor": None, "spmd_types": {"dp", "cp", "tp", "ep"}}


def expected_resolve(cfg: Cfg, backend: str, axes: list[str]) -> tuple[str, ...] | None:
    active = expected_active(cfg, backend)
    if backend == "full_dtensor":
        axes = [a for x in axes for a in (("dp_replicate", "dp_shard") if x == "dp" else (x,))]
    keep = IN_BAND[backend]
    kept = [a for a in axes if (keep is None or a in keep) and active[a]]
    if not kept:
        return None
    for mesh in [*GLOBAL_MESHES[backend].values(), *COMMON_GLOBAL.values()]:
        if set(kept) <= set(mesh):
            return tuple(a for a in mesh if a in kept)
    raise AssertionError(f"spec: no global mesh holds {kept}")


def expected_spmd(cfg: Cfg, backend: str) -> list[tuple[str, ...]]:
    active = expected_active(cfg, backend)
    out = [tuple(a for a in axes if active[a]) for axes in SPMD_MESH_AXES[backend]]
    return [axes for axes in out if axes]


def ranks_of(mesh: dist.DeviceMesh) -> list[int]:
    return sorted(dist.get_process_group_ranks(mesh.get_group()))


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(params=list(CONFIGS), ids=list(CONFIGS))
def cfg(request: pytest.FixtureRequest) -> Cfg:
    return CONFIGS[request.param]


@pytest.fixture
def built(fake_pg, cfg: Cfg, backend: str) -> ParallelDims:
    fake_pg(cfg.world, cfg.rank)
    pd = cfg.dims(backend)
    pd.build_mesh()
    return pd


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("backend", BACKENDS)
def test_axis_names_sizes_ranks_and_real_groups(built: ParallelDims, cfg: Cfg, backend: str) -> None:
    groups = expected_groups(cfg)
    active = expected_active(cfg, backend)
    names = COMMON_NAMES | EXTRA_NAMES[backend]
    assert set(built.mesh_axis_names) == names
    for name in names:
        mesh = built.get_optional_mesh(name, include_singleton_axes=True)
        assert mesh is not None and mesh.mesh_dim_names == (DIM_NAME.get(name, name),)
        assert mesh.size() == len(groups[name]), name
        assert mesh.mesh.tolist() == groups[name], name
        assert ranks_of(mesh) == sorted(groups[name]), name
        assert mesh.get_local_rank() == groups[name].index(cfg.rank), name
        assert built.is_axis_active(name) is active[name], name
        assert (built.get_optional_mesh(name) is not None) is active[name], name
        assert built.get_optional_mesh(name, include_singleton_axes=True) is mesh  # cached
    # As torchtitan since #4068: every 1-D mesh of size > 1 with a real group
    # (fake-backed ones, e.g. efsdp at ep=1, left out).
    one_d = built.get_all_one_dimensional_meshes()
    assert set(one_d) == {n for n in names if len(groups[n]) > 1 and active[n]}
    assert all(m is built.get_optional_mesh(n, include_singleton_axes=True) for n, m in one_d.items())
    assert set(built._single_axis_meshes) == names
    assert all(m.mesh_dim_names == (DIM_NAME.get(n, n),) for n, m in built._single_axis_meshes.items())


@pytest.mark.parametrize("backend", BACKENDS)
def test_global_meshes(built: ParallelDims, cfg: Cfg, backend: str) -> None:
    groups = expected_groups(cfg)
    expected = {**GLOBAL_MESHES[backend], **COMMON_GLOBAL}
    meshes = built.global_meshes
    assert {k: m.mesh_dim_names for k, m in meshes.items()} == {
        k: tuple(DIM_NAME.get(a, a) for a in axes) for k, axes in expected.items()
    }
    for key, mesh in meshes.items():
        assert mesh.shape == tuple(len(groups[a]) for a in expected[key]), key
        assert mesh.size() == math.prod(mesh.shape)
        assert mesh.get_coordinate() == tuple(groups[a].index(cfg.rank) for a in expected[key])
        for i, axis in enumerate(expected[key]):
            sub = built.get_mesh(axis) if built.is_axis_active(axis) else mesh[DIM_NAME.get(axis, axis)]
            assert ranks_of(sub) == sorted(groups[axis])
            assert mesh.get_group(i) is built.get_optional_mesh(axis, include_singleton_axes=True).get_group()
    world = built.world_mesh
    assert world.mesh_dim_names == BASE and world.size() == cfg.world
    assert world.shape == (cfg.pp, cfg.dp_replicate, cfg.dp_shard, cfg.cp, cfg.tp)
    assert all(m._get_root_mesh() is world for m in meshes.values())
    if "data" in meshes and cfg.world > 1:
        assert meshes["data"]["tp"].mesh.tolist() == groups["tp"]  # torch slicing agrees


# torchtitan's ``ParallelDims._global_meshes`` (a0c831c49 ``build_mesh``), by its keys.
UPSTREAM_GLOBAL = {
    "default": {"dense": ("pp", "dp_replicate", "fsdp", "tp")},
    "full_dtensor": {"dense": BASE},
    "spmd_types": {"dense": BASE, "spmd_dense_for_fwdbwd": ("dp", "cp", "tp")},
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_upstream_global_meshes(built: ParallelDims, cfg: Cfg, backend: str) -> None:
    """``_global_meshes`` has torchtitan's keys (its spmd_types helpers read ``spmd_dense_for_fwdbwd``)."""
    groups = expected_groups(cfg)
    expected = {"dataloading": ("pp", "batch", "cp", "tp"), "loss": ("loss",),
                "sparse": ("pp", "dp_replicate", "efsdp", "ep"), **UPSTREAM_GLOBAL[backend]}
    if backend == "spmd_types" and cfg.ep > 1:  # August's sparse SPMD mesh, built only with experts sharded
        expected["spmd_sparse_for_fwdbwd"] = ("dp_replicate", "efsdp", "ep")
    meshes = built._global_meshes
    assert set(meshes) == set(expected)
    for key, axes in expected.items():
        mesh = meshes[key]
        assert mesh.mesh_dim_names == tuple(DIM_NAME.get(a, a) for a in axes), key
        assert mesh.shape == tuple(len(groups[a]) for a in axes), key  # size-1 axes kept
        assert mesh.get_coordinate() == tuple(groups[a].index(cfg.rank) for a in axes), key
        assert meshes[key] is built._global_meshes[key]  # cached


def test_upstream_global_meshes_empty_before_build() -> None:
    assert ParallelDims(1, 1, 1, 1, 1, 1, 1, spmd_backend="spmd_types", device_type="cpu")._global_meshes == {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_groups_shared_by_rank_set(built: ParallelDims, cfg: Cfg, backend: str) -> None:
    """Axes over the same ranks, both real or both fake, share one process group."""
    groups = expected_groups(cfg)
    active = expected_active(cfg, backend)
    names = sorted(built.mesh_axis_names)
    pg = {n: built.get_optional_mesh(n, include_singleton_axes=True).get_group() for n in names}
    for a in names:
        for b in names:
            same = groups[a] == groups[b] and active[a] == active[b]
            assert (pg[a] is pg[b]) is same, (a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resolve_mesh_and_spmd_meshes(built: ParallelDims, cfg: Cfg, backend: str) -> None:
    spmd = built.spmd_meshes()
    assert [m.mesh_dim_names for m in spmd] == expected_spmd(cfg, backend)
    for requested in (
        ["dp", "cp", "tp"],
        ["dp_replicate", "efsdp", "ep"],
        ["tp"],
        ["ep"],
        ["dp"],
        ["cp", "tp", "dp"],
        [MeshAxisName.DP_REPLICATE, MeshAxisName.DP_SHARD, MeshAxisName.CP, MeshAxisName.TP],
    ):
        want = expected_resolve(cfg, backend, [str(a) for a in requested])
        if backend == "full_dtensor" and want is not None and want not in expected_spmd(cfg, backend):
            with pytest.raises(ValueError, match="not one of the SPMD meshes"):
                built.resolve_mesh(requested)
            continue
        got = built.resolve_mesh(requested)
        if want is None:
            assert got is None, requested
            continue
        assert got is not None and got.mesh_dim_names == want, requested
        assert got is built.get_mesh(list(want))
        if want in expected_spmd(cfg, backend):
            assert any(got is m for m in spmd)


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_axis_requests(built: ParallelDims, cfg: Cfg, backend: str) -> None:
    groups = expected_groups(cfg)
    # Requested out of order: sliced from the first global mesh holding both, in its order.
    mesh = built.get_optional_mesh(["tp", "pp"], include_singleton_axes=True)
    assert mesh is not None and mesh.mesh_dim_names == ("pp", "tp")
    assert mesh.shape == (cfg.pp, cfg.tp)
    assert built.get_optional_mesh(("pp", "tp"), include_singleton_axes=True) is mesh
    assert built.get_optional_mesh(["pp", "tp"]) is (mesh if cfg.pp > 1 and cfg.tp > 1 else None)
    activated = built.get_activated_mesh(["pp", "tp"])
    live = tuple(a for a in ("pp", "tp") if len(groups[a]) > 1)
    assert (activated.mesh_dim_names if activated is not None else ()) == live
    for flag in (True, False):  # an invalid combination raises even when an axis is inactive
        with pytest.raises(ValueError, match="combines"):
            built.get_optional_mesh(["tp", "efsdp"], include_singleton_axes=flag)


def test_seq_len_divisor_and_flags() -> None:
    pd = ParallelDims(2, -1, 2, 4, 1, 4, 64, device_type="cpu")
    assert pd.dp_shard == 4
    assert pd.seq_len_divisor == 4 * 2 * 2
    # upstream's formula (a0c831c49 and b5bcd76 alike), also without CP: tp * (cp * 2)
    assert ParallelDims(1, 2, 1, 2, 1, 1, 4, device_type="cpu").seq_len_divisor == 2 * (1 * 2)
    assert ParallelDims(1, 1, 3, 1, 1, 1, 3, device_type="cpu").seq_len_divisor == 1 * (3 * 2)
    assert pd.non_data_parallel_size == 2 * 4 * 1
    assert (pd.dp_enabled, pd.dp_replicate_enabled, pd.dp_shard_enabled) == (True, True, True)
    assert (pd.cp_enabled, pd.tp_enabled, pd.pp_enabled, pd.ep_enabled, pd.fsdp_enabled) == (
        True, True, False, True, True,
    )
    one = ParallelDims(1, 1, 1, 1, 1, 1, 1, device_type="cpu")
    assert not any((one.dp_enabled, one.cp_enabled, one.tp_enabled, one.fsdp_enabled, one.ep_enabled))


def test_unfold_dp_axes() -> None:
    assert unfold_dp_axes(["cp", "dp", "tp"]) == ["cp", "dp_replicate", "dp_shard", "tp"]
    assert unfold_dp_axes([MeshAxisName.DP]) == ["dp_replicate", "dp_shard"]
    assert unfold_dp_axes(["tp"]) == ["tp"]


def test_unfold_dp_axis_is_upstreams() -> None:
    """b5bcd76's ``unfold_dp_axis``: one axis to a tuple of ``MeshAxisName``; unknown names are named."""
    assert unfold_dp_axis("dp") == (MeshAxisName.DP_REPLICATE, MeshAxisName.DP_SHARD)
    assert unfold_dp_axis(MeshAxisName.EFSDP) == (MeshAxisName.EFSDP,)
    assert all(type(a) is MeshAxisName for a in unfold_dp_axis("fsdp"))
    with pytest.raises(ValueError, match="'dpx' is not a mesh axis name"):
        unfold_dp_axis("dpx")
    assert [m.value for m in MeshAxisName] == [
        "dp", "dp_replicate", "dp_shard", "fsdp", "tp", "cp", "pp", "ep", "efsdp",
    ]


def test_from_config() -> None:
    from torchtitan_spmd.config import ParallelismConfig

    cfg = ParallelismConfig(
        data_parallel_replicate_degree=2, tensor_parallel_degree=2, expert_parallel_degree=2,
        spmd_backend="spmd_types",
    )
    pd = ParallelDims.from_config(cfg, 16, device_type="cpu")
    assert (pd.dp_replicate, pd.dp_shard, pd.cp, pd.tp, pd.pp, pd.ep) == (2, 4, 1, 2, 1, 2)
    assert pd.spmd_backend == "spmd_types" and pd.world_size == 16
    assert pd.pg_backend == "gloo"


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_after_build(fake_pg, backend: str) -> None:
    fake_pg(4)
    pd = ParallelDims(1, 2, 1, 2, 1, 1, 4, spmd_backend=backend, device_type="cpu")
    assert pd.build_mesh() is pd.build_mesh() is pd.world_mesh
    with pytest.raises(RuntimeError, match="cannot change after build_mesh"):
        pd.tp = 4
    pd.tp = 2  # same value: allowed


def test_world_size_must_match_process_group(fake_pg) -> None:
    fake_pg(8)
    with pytest.raises(ValueError, match="world_size is 4 but the default process group has 8"):
        ParallelDims(1, 2, 1, 2, 1, 1, 4, device_type="cpu").build_mesh()


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_flatten_reuses_our_flattened_meshes(fake_pg, backend: str) -> None:
    """Our flattened axes are registered with the root, so torch's ``_flatten`` of the
    same ranks (as DTensor does for multi-axis collectives) returns them, groups and all."""
    cfg = CONFIGS["dp_shard2-cp2-tp2-ep2"]
    fake_pg(cfg.world, cfg.rank)
    pd = cfg.dims(backend)
    data = pd.global_meshes["data"]
    flattened = data["batch", "cp"]._flatten("loss_mesh")  # torchtitan's own call
    assert flattened is pd.get_mesh("loss")
    assert flattened.get_group() is pd.get_mesh("loss").get_group()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["dp_replicate2-dp_shard2-tp2", "dp_shard2-cp2-tp2-ep2", "world4096"])
def test_only_real_axes_are_registered_as_flattened_meshes(fake_pg, backend: str, name: str) -> None:
    """DTensor picks a flattened mesh by its ranks alone, so a fake-backed axis with the ranks
    of active ones (``efsdp`` at ep=1 has those of ``(dp_shard, cp, tp)``) must never be
    registered: its collectives would do nothing. Asking for every 1-D mesh (as upstream's
    ``set_pg_timeouts`` does) creates them all."""
    cfg = CONFIGS[name]
    fake_pg(cfg.world, cfg.rank)
    pd = cfg.dims(backend)
    pd.get_all_one_dimensional_meshes()
    by_dim = {v: k for k, v in DIM_NAME.items()}
    registered = {by_dim.get(n, n) for n in pd.world_mesh._flatten_mapping}
    active = expected_active(cfg, backend)
    assert registered and all(active[n] for n in registered), {n: active[n] for n in registered}
    assert {n for n in pd.mesh_axis_names if active[n] and n not in BASE} <= registered
