"""Layer 2: ``build_mesh`` creates only this rank's groups, so its cost does not grow with the world.

Under torch's fake process group at 65,536 ranks, for a 5-axis shape and an
FSDP-only one and every backend: the number of group-creation calls this rank
makes (every ``new_group``, member or not, goes through torch's
``_new_group_with_tag``) and the groups it registers are bounded by the number of
mesh axes, and every axis still groups the ranks the spec says, seen from ranks
far from 0. ``_mesh_compat.axis_ranks`` (this rank's row of an axis, computed from
the layout) is checked on every rank of small worlds against the spec, which
shares no code with it. No timings here: those are in ``bench/mesh_bench.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from mesh_spec_helpers import BACKENDS, Cfg, expected_groups

from torchtitan_spmd.distributed import _mesh_compat
from torchtitan_spmd.distributed.parallel_dims import _AXES

BIG = 65536
SHAPES = {
    # Every base axis > 1; ep = 32 spans tp and part of dp_shard * cp.
    "5-axis": Cfg(pp=4, dp_replicate=2, dp_shard=BIG // 128, cp=2, tp=8, ep=32),
    # Every other degree 1: five size-1 axes, and axes over the whole world.
    "fsdp-only": Cfg(dp_shard=BIG),
}
SMALL = {
    "dp_replicate2-dp_shard2-tp2-ep2": Cfg(dp_replicate=2, dp_shard=2, tp=2, ep=2),
    "pp2-dp_shard2-cp2-tp2-ep4": Cfg(pp=2, dp_shard=2, cp=2, tp=2, ep=4),
    "pp2-dp_replicate2-dp_shard4-cp2-tp2-ep8": Cfg(pp=2, dp_replicate=2, dp_shard=4, cp=2, tp=2, ep=8),
    "dp_shard8": Cfg(dp_shard=8),
}


@pytest.fixture
def group_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...] | None]:
    """The ranks passed to every ``new_group`` call from now on (torch's included)."""
    calls: list[tuple[int, ...] | None] = []
    c10d = dist.distributed_c10d
    original = c10d._new_group_with_tag

    def counting(ranks=None, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 - torch's signature
        calls.append(None if ranks is None else tuple(ranks))
        return original(ranks, *args, **kwargs)

    monkeypatch.setattr(c10d, "_new_group_with_tag", counting)
    return calls


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_group_creation_per_rank_is_bounded_by_the_axes(
    fake_pg, group_calls: list, backend: str, shape: str
) -> None:
    # A rank far from 0 with no coordinate 0 or last in the 5-axis shape (every
    # rank of small worlds: test_axis_ranks_is_the_row_of_the_rank).
    cfg = dataclasses.replace(SHAPES[shape], rank=40503)
    fake_pg(cfg.world, cfg.rank)
    registered = len(dist.distributed_c10d._world.pg_names)
    pd = cfg.dims(backend)
    world = pd.build_mesh()
    axes = len({*world.mesh_dim_names, *pd.mesh_axis_names})
    # One call per distinct (ranks, real/fake) pair at most, each for this rank's
    # group only; torch's per-axis routine makes ~92,000 calls at this size.
    assert 0 < len(group_calls) <= axes, len(group_calls)
    assert all(r is not None and cfg.rank in r for r in group_calls)
    assert len(dist.distributed_c10d._world.pg_names) - registered <= axes
    groups = expected_groups(cfg)
    for name in pd.mesh_axis_names:
        mesh = pd.get_optional_mesh(name, include_singleton_axes=True)
        assert mesh.mesh.tolist() == groups[name], name
        assert dist.get_process_group_ranks(mesh.get_group()) == sorted(groups[name]), name
    assert len(group_calls) <= axes, "views must not create groups"


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_axis_over_the_whole_world_is_the_default_group(fake_pg, backend: str) -> None:
    cfg = Cfg(dp_shard=8, rank=3)
    fake_pg(cfg.world, cfg.rank)
    pd = cfg.dims(backend)
    default = dist.distributed_c10d._get_default_group()
    whole_world = [n for n in pd.mesh_axis_names if pd.is_axis_active(n) and pd.axis_size(n) == 8]
    assert {"batch", "loss"} <= set(whole_world)
    for name in whole_world:
        assert pd.get_mesh(name).get_group() is default, name
    # efsdp (ep = 1) spans the world too, but is fake-backed: a group of its own.
    efsdp = pd.get_optional_mesh("efsdp", include_singleton_axes=True).get_group()
    assert efsdp is not default and dist.get_process_group_ranks(efsdp) == list(range(8))


@pytest.mark.parametrize("name", list(SMALL))
def test_axis_ranks_is_the_row_of_the_rank(name: str) -> None:
    """Every axis, every rank, against the spec; then through a permuted rank map."""
    cfg = SMALL[name]
    pd = cfg.dims("default")
    identity = torch.arange(cfg.world, dtype=torch.int)
    perm = torch.randperm(cfg.world, generator=torch.Generator().manual_seed(cfg.world)).int()
    layouts = {axis: pd._axis_layout(axis) for axis in _AXES}
    for position in range(cfg.world):
        groups = expected_groups(dataclasses.replace(cfg, rank=position))
        for axis, layout in layouts.items():
            want = groups[axis]
            assert _mesh_compat.axis_ranks(layout, identity, position) == want, (axis, position)
            rank = int(perm[position])
            got = _mesh_compat.axis_ranks(layout, perm, rank)
            assert got == [int(perm[p]) for p in want], (axis, position)


def test_axis_ranks_of_a_rank_outside_the_map_and_a_layout_without_complement() -> None:
    evens = torch.arange(0, 16, 2, dtype=torch.int)
    layout = _mesh_compat.axis_layout((2,), (1,))
    assert _mesh_compat.axis_ranks(layout, evens, 6) == [4, 6]  # positions 2 and 3
    assert _mesh_compat.axis_ranks(layout, evens, 3) is None
    # Two modes (no project axis has them: each spans adjacent base axes), in their order.
    world8 = torch.arange(8, dtype=torch.int)
    assert _mesh_compat.axis_ranks(_mesh_compat.axis_layout((2, 2), (4, 1)), world8, 6) == [2, 3, 6, 7]
    assert _mesh_compat.axis_ranks(_mesh_compat.axis_layout((2, 2), (1, 4)), world8, 3) == [2, 6, 3, 7]
    # Ranks {0, 4} of 6: no other mode can fill the gaps, so no mesh has this axis.
    with pytest.raises(ValueError, match="no complement in a world of 6 ranks"):
        _mesh_compat.axis_ranks(_mesh_compat.axis_layout((2,), (4,)), torch.arange(6), 0)
