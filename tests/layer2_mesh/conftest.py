"""Fixtures for the layer-2 mesh tests: a single-process fake process group."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist


def _clear_dtensor_caches() -> None:
    # FACTS: DTensor's sharding-propagation cache can hand back a mesh object from
    # an earlier test when the meshes compare equal. Clear it if DTensor is loaded
    # (importing it just for this would cost seconds).
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


@pytest.fixture
def fake_pg() -> Iterator[Callable[..., None]]:
    """``fake_pg(world_size, rank=0)`` initialises torch's fake process group; torn down after."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"

    assert not dist.is_initialized(), "a previous test leaked a process group"

    def init(world_size: int, rank: int = 0) -> None:
        dist.init_process_group("fake", rank=rank, world_size=world_size)

    try:
        yield init
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _clear_dtensor_caches()
