"""The memoised redistribution planner plans exactly what torch's own planner plans.

``torchtitan_spmd.distributed.planner_memo`` memoises, per planner, the edge costs and state
expansions of DTensor's Dijkstra search. The reference here is torch's planner itself, with the
memo uninstalled: the same sequence of (source, target) specs is planned by both, each starting
from empty planner caches, and every plan (each step's mesh axis, placements and logical shape)
or error must match. The sequence matters: a planner's state expansions depend on the targets it
has been asked for before (``_StridedShard`` and ``Partial`` targets add transitions), which is
what the memo's key must carry.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from torchtitan_spmd.distributed import planner_memo

pytestmark = pytest.mark.skipif(planner_memo.unsupported_reason() is not None,
                                reason=f"no memo for this torch: {planner_memo.unsupported_reason()}")


def _plan_all(mesh_shape: tuple[int, ...], tensor_shape: tuple[int, ...], every: int) -> list[Any]:
    """Plan every ``every``-th (source, target) pair over a grid of placements, graph-based."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor import (  # noqa: PLC0415
        Partial,
        Replicate,
        Shard,
        _redistribute,  # noqa: PLC0415
    )
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: PLC0415
    from torch.distributed.tensor.placement_types import _StridedShard  # noqa: PLC0415

    _redistribute.clear_redistribute_planner_cache()
    mesh = init_device_mesh("cpu", mesh_shape)
    strides = torch.empty(tensor_shape).stride()
    meta = TensorMeta(torch.Size(tensor_shape), strides, torch.float32)
    options = [Replicate(), Shard(0), Shard(1), Partial(), _StridedShard(0, split_factor=2)]
    specs = [DTensorSpec(mesh, placements, tensor_meta=meta)
             for placements in itertools.product(options, repeat=len(mesh_shape))]
    plans: list[Any] = []
    for n, (src, dst) in enumerate(itertools.product(specs, repeat=2)):
        if n % every:
            continue
        try:
            plans.append((src.placements, dst.placements,
                          _redistribute._gen_transform_infos_non_cached(src, dst, use_graph_based_transform=True)))
        except Exception as exc:  # noqa: BLE001 - an error is part of the plan to compare
            plans.append((src.placements, dst.placements, f"{type(exc).__name__}: {exc}"))
    _redistribute.clear_redistribute_planner_cache()
    return plans


@pytest.fixture
def memo_off() -> Any:
    """Torch's planner as it ships for the test; the memo put back after."""
    was = planner_memo.installed()
    planner_memo.uninstall()
    yield
    if was:
        planner_memo.install()


@pytest.mark.parametrize(("world", "mesh_shape", "tensor_shape", "every"), [
    (4, (4,), (8, 6, 4), 1),
    (4, (2, 2), (8, 6, 4), 1),
    (4, (2, 2), (6, 5), 1),  # uneven shards: the logical shapes differ per step
    (8, (2, 2, 2), (8, 6, 4), 61),  # a spread sample: the whole grid takes minutes
], ids=["1d", "2d", "2d-uneven", "3d"])
def test_memoised_plans_equal_torchs(fake_pg: Callable[..., None], memo_off: None, world: int,
                                     mesh_shape: tuple[int, ...], tensor_shape: tuple[int, ...],
                                     every: int) -> None:
    fake_pg(world, rank=world - 1)
    reference = _plan_all(mesh_shape, tensor_shape, every)
    assert planner_memo.install()
    memoised = _plan_all(mesh_shape, tensor_shape, every)
    assert len(memoised) == len(reference) >= 25
    for ref, got in zip(reference, memoised, strict=True):
        assert got == ref, f"{ref[0]} -> {ref[1]}: torch plans {ref[2]}, the memo {got[2]}"
    # Not vacuous: the grid reaches _StridedShard targets and multi-step plans.
    assert any(len(plan) > 1 for _, _, plan in reference if isinstance(plan, list))


def test_memo_prices_each_edge_once(fake_pg: Callable[..., None], memo_off: None) -> None:
    """The memo is on, and it is what saves the work: far fewer prices than edges visited."""
    from torch.distributed.tensor import _collective_utils, _redistribute  # noqa: PLC0415

    fake_pg(4)
    calls = {"n": 0}
    priced = _collective_utils.one_step_redistribute_cost

    def counting(*args: Any) -> Any:
        calls["n"] += 1
        return priced(*args)

    counts = []
    for on in (False, True):
        if on:
            assert planner_memo.install() and planner_memo.installed()
        _redistribute.one_step_redistribute_cost, before = counting, _redistribute.one_step_redistribute_cost
        try:
            calls["n"] = 0
            _plan_all((2, 2), (8, 6, 4), 1)
            counts.append(calls["n"])
        finally:
            _redistribute.one_step_redistribute_cost = before
    unmemoised, memoised = counts
    assert memoised * 5 < unmemoised, counts


def test_env_turns_it_off(memo_off: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(planner_memo.ENV, "0")
    assert planner_memo.install() is False
    assert not planner_memo.installed()
    monkeypatch.setenv(planner_memo.ENV, "1")
    assert planner_memo.install() is True
    assert planner_memo.installed()


def test_build_mesh_installs_it(fake_pg: Callable[..., None], memo_off: None) -> None:
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims  # noqa: PLC0415

    fake_pg(4)
    assert not planner_memo.installed()
    ParallelDims(1, 2, 1, 2, 1, 1, 4, spmd_backend="full_dtensor", device_type="cpu").build_mesh()
    assert planner_memo.installed()
