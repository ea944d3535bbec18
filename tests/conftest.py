"""Shared pytest set-up: backend selection for the nox matrix.

``--backend=NAME`` keeps only the tests of one backend; ``--backend=common``
keeps the backend-agnostic ones; the default, ``all``, keeps everything. A test
belongs to a backend through ``@pytest.mark.backend("name")`` or through a
``backend`` parameter, so backend-agnostic tests run once, not three times.
"""

from __future__ import annotations

import os
import re

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


# ----------------------------------------------------------------------------- skips
#: The skips a session may have, by reason: no GPU (or not this GPU), a torch older than a
#: feature needs (the reason names both versions), no tmpfs mount (not root), and the stack
#: tool's prefix runs (a layer's tests run without the layers above it). Any other skip --
#: e.g. a module-level ``importorskip`` of a dev dependency (transformers, safetensors,
#: matplotlib, nox are all in the ``dev`` extra) -- fails the session: a broken install must
#: not turn into green skips.
ALLOWED_SKIPS: tuple[str, ...] = (
    r"CUDA", r"GPU", r"sm90", r"torch >= ?\d", r"tmpfs",
    r"layer \d|layer's|layers\.toml|python -m stack",
)
_SKIPS: list[tuple[str, str]] = []


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPS.append((report.nodeid, _skip_reason(report)))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:  # a module-level skip (importorskip) skips the whole file at collection
        _SKIPS.append((report.nodeid, _skip_reason(report)))  # type: ignore[arg-type]


def unexpected_skips(skips: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The ``(test, reason)`` pairs whose reason matches none of :data:`ALLOWED_SKIPS`."""
    return [(node, reason) for node, reason in skips
            if not any(re.search(pattern, reason) for pattern in ALLOWED_SKIPS)]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    bad = unexpected_skips(_SKIPS)
    if bad:
        lines = "\n".join(f"  {node}: {reason}" for node, reason in bad)
        print(f"\nFAILED: {len(bad)} test(s) skipped for a reason not in tests/conftest.py's ALLOWED_SKIPS "
              f"(a GPU, a torch version, tmpfs, the stack's prefix runs):\n{lines}")
        if session.exitstatus in (0, 5):  # passed, or nothing ran but skips
            session.exitstatus = 1
