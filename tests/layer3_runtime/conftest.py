"""Fixtures for the layer-3 runtime tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from torchtitan_spmd.launcher import warm_worlds


@pytest.fixture
def single_thread() -> Iterator[None]:
    """Tiny CPU kernels run fastest (and least noisily on a busy machine) on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fake_pg() -> Iterator[Callable[[int], None]]:
    """``fake_pg(world_size)``: torch's fake process group, this process rank 0 (shape-level setup only)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"

    assert not dist.is_initialized(), "a previous test leaked a process group"
    try:
        yield lambda world_size: dist.init_process_group("fake", rank=0, world_size=world_size)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

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


