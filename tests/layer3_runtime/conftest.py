"""Fixtures for the layer-3 runtime tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from warm_fixtures import fresh_world_when_marked, warm_worlds_when_asked  # noqa: F401 - the suite's autouse fixtures


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
