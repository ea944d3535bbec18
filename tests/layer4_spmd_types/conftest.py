"""Fixtures of the layer-4 tests: a single-process fake process group."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import pytest
import spmd_helpers  # noqa: F401 - puts tests/layer3_runtime on the path
import torch.distributed as dist
from warm_fixtures import fresh_world_when_marked, warm_worlds_when_asked  # noqa: F401 - the suite's autouse fixtures


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
