"""Fixtures of the layer-4 tests: a single-process fake process group."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

from torchtitan_spmd.launcher import warm_worlds


@pytest.fixture
def fake_world() -> Iterator[Callable[..., None]]:
    """``fake_world(n, rank=0)``: a fake process group of ``n`` ranks, this process being ``rank``.

    Calling it again replaces the group (e.g. to look at each rank in turn); torn down after.
    """
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"

    assert not dist.is_initialized(), "a previous test leaked a process group"

    def init(world_size: int, rank: int = 0) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=world_size)

    try:
        yield init
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if "torch.distributed.tensor" in sys.modules:
            from torchtitan_spmd.techniques.fsdp import clear_dtensor_sharding_caches

            clear_dtensor_sharding_caches()

#: ``1`` lets forked launches reuse warm worlds (``launcher.warm_worlds``), except in tests marked
#: ``fresh_world``. Off by default: the whole suite's first fresh-clone run with them on used more
#: CPU on the tests it shares with the last stop's run (3,835 s against 2,788, partly under other
#: load), though single files of one layout saved up to 40 % (docs/benchmarks.md); until a clean
#: side-by-side run says otherwise, every launch runs in fresh forks, as before.
WARM_WORLDS_ENV = "TORCHTITAN_SPMD_WARM_WORLDS"


@pytest.fixture(scope="session", autouse=True)
def _warm_worlds() -> Iterator[None]:
    if os.environ.get(WARM_WORLDS_ENV, "0") != "1":
        yield
        return
    # Each warm rank imports what every trainer launch needs, once (debug.deterministic imports
    # torch._inductor: seconds per rank otherwise).
    with warm_worlds(preload=("torch._inductor", "torchtitan_spmd.train")):
        yield


@pytest.fixture(autouse=True)
def _fresh_world_when_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    marker = request.node.get_closest_marker("fresh_world")
    if marker is None:
        yield
        return
    with warm_worlds(False):
        yield


