"""Shared pytest set-up: backend selection for the nox matrix.

``--backend=NAME`` keeps only the tests of one backend; ``--backend=common``
keeps the backend-agnostic ones; the default, ``all``, keeps everything. A test
belongs to a backend through ``@pytest.mark.backend("name")`` or through a
``backend`` parameter, so backend-agnostic tests run once, not three times.
"""

from __future__ import annotations

import os

import pytest

BACKENDS = ("default", "full_dtensor", "spmd_types")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        default="all",
        choices=("all", "common", *BACKENDS),
        help="run only the tests of this SPMD backend ('common': backend-agnostic tests)",
    )
    parser.addoption(
        "--device",
        default=os.environ.get("TORCHTITAN_SPMD_DEVICE", "cpu"),
        choices=("cpu", "cuda"),
        help="device for tests that run training steps",
    )


def test_backend_of(item: pytest.Item) -> str | None:
    """The backend a collected test belongs to, or None for backend-agnostic tests."""
    marker = item.get_closest_marker("backend")
    if marker is not None:
        return str(marker.args[0])
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "backend" in callspec.params:
        return str(callspec.params["backend"])
    return None


test_backend_of.__test__ = False  # type: ignore[attr-defined]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = config.getoption("--backend")
    if wanted == "all":
        return
    keep, drop = [], []
    for item in items:
        backend = test_backend_of(item)
        (keep if (backend or "common") == wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def device(request: pytest.FixtureRequest) -> str:
    """The device chosen with ``--device`` (``cpu`` by default)."""
    return str(request.config.getoption("--device"))
