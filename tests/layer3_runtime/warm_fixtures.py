"""The suite's warm-world fixtures (``torchtitan_spmd.launcher.warm_worlds``), for the runtime
layers' conftests (tests/layer3_runtime, tests/layer4_spmd_types) to import: layer 1's conftest may
not import the launcher."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from torchtitan_spmd.launcher import warm_worlds

__all__ = ["WARM_WORLDS_ENV", "fresh_world_when_marked", "warm_worlds_when_asked"]

#: ``1`` lets forked launches reuse warm worlds (``launcher.warm_worlds``), except in tests marked
#: ``fresh_world``. Off by default: single files of one layout saved up to 40 %, but the whole
#: suite, idle, side by side with fresh forks, used 6 % more CPU (3,061 s against 2,891:
#: docs/benchmarks.md, round four): most files change layout from one launch to the next.
WARM_WORLDS_ENV = "TORCHTITAN_SPMD_WARM_WORLDS"


@pytest.fixture(scope="session", autouse=True)
def warm_worlds_when_asked() -> Iterator[None]:
    if os.environ.get(WARM_WORLDS_ENV, "0") != "1":
        yield
        return
    # Each warm rank imports what every trainer launch needs, once (debug.deterministic imports
    # torch._inductor: seconds per rank otherwise).
    with warm_worlds(preload=("torch._inductor", "torchtitan_spmd.train")):
        yield


@pytest.fixture(autouse=True)
def fresh_world_when_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    marker = request.node.get_closest_marker("fresh_world")
    if marker is None:
        yield
        return
    with warm_worlds(False):
        yield


