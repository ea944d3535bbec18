"""Shared pytest set-up: backend selection for the nox matrix.

``--backend=NAME`` keeps only the tests of one backend; ``--backend=common``
keeps the backend-agnostic ones; the default, ``all``, keeps everything. A test
belongs to a backend through ``@pytest.mark.backend("name")`` or through a
``backend`` parameter, so backend-agnostic tests run once, not three times.
"""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Iterator

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


def pytest_configure(config: pytest.Config) -> None:
    """Settle autograd's device threads before any test runs, in every pytest process.

    Autograd decides once per process, at its first backward, whether to start device threads;
    if it starts them, every child forked later fails its own backward ("Unable to handle
    autograd's threading in combination with fork-based multiprocessing"). Whether it does can
    depend on what an earlier in-process test left registered (measured: a layer-4 typed step,
    then test_data's training loop, then test_run_features' forked ranks failed at backward,
    while each pair alone passed). One tiny CPU backward here, before any test, makes that first
    decision on a clean process: no device threads, so forked ranks (torchtitan_spmd.launcher)
    work whatever ran before them in the same worker. pytest-xdist mixes tiers in one worker.
    """
    if os.environ.get("TORCHTITAN_SPMD_SETTLE_AUTOGRAD") == "0":  # a scratch suite that forks nothing
        return
    import torch

    x = torch.zeros(1, requires_grad=True)
    (x * 1).sum().backward()


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


# ----------------------------------------------------------------------------- the collector
@pytest.fixture(autouse=True)
def _collector_left_as_found() -> Iterator[None]:
    """Fail a test that leaves Python's automatic garbage collector off in the pytest process.

    A :class:`~torchtitan_spmd.train.Trainer` turns the collector off until its ``close()``
    (``training.gc_freq``, as upstream). A test that builds one in this process and does not close
    it left the collector off for every later test of its worker: the worker's heap then grew
    without a cycle collection, and every rank forked from it inherited the garbage and paid for
    it in its trainer's first collection and in the mesh check's full one (docs/benchmarks.md,
    round eight: 14 % of the tests' CPU, 1,711 -> 1,472 s). The collector is turned back on here, and the
    test fails in one line naming the cause.
    """
    was_on = gc.isenabled()
    yield
    if was_on and not gc.isenabled():
        gc.enable()
        pytest.fail("this test left Python's garbage collector off in the pytest process: close every "
                    "Trainer it builds here (trainer.close(), or contextlib.closing(Trainer(cfg)))",
                    pytrace=False)


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
    for name, value in report.user_properties:
        if name == "over_budget_s":
            _OVER_BUDGET.append((report.nodeid, float(value)))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:  # a module-level skip (importorskip) skips the whole file at collection
        _SKIPS.append((report.nodeid, _skip_reason(report)))  # type: ignore[arg-type]


def unexpected_skips(skips: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The ``(test, reason)`` pairs whose reason matches none of :data:`ALLOWED_SKIPS`."""
    return [(node, reason) for node, reason in skips
            if not any(re.search(pattern, reason) for pattern in ALLOWED_SKIPS)]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _OVER_BUDGET:
        lines = "\n".join(f"  {node}: {seconds:.1f} CPU s" for node, seconds in _OVER_BUDGET)
        print(f"\nFAILED: {len(_OVER_BUDGET)} test(s) cost more than the {TEST_BUDGET_S:g} CPU-second "
              f"budget without a @pytest.mark.slow(reason=...) saying why (tests/conftest.py):\n{lines}")
        if session.exitstatus in (0, 5):
            session.exitstatus = 1
    bad = unexpected_skips(_SKIPS)
    if bad:
        lines = "\n".join(f"  {node}: {reason}" for node, reason in bad)
        print(f"\nFAILED: {len(bad)} test(s) skipped for a reason not in tests/conftest.py's ALLOWED_SKIPS "
              f"(a GPU, a torch version, tmpfs, the stack's prefix runs):\n{lines}")
        if session.exitstatus in (0, 5):  # passed, or nothing ran but skips
            session.exitstatus = 1


# ----------------------------------------------------------------------------- the time budget
#: A test whose set-up and call cost more than this many CPU seconds (this process plus the
#: children it reaped: forked ranks, subprocesses; a shared fixture's run counts for the test that
#: set it up) must carry ``@pytest.mark.slow(reason="...")`` saying
#: why it cannot be cheaper; any other such test fails the session at its end, listed with its
#: cost. CPU seconds, not wall: a loaded machine (pytest-xdist's other worker, another job)
#: stretches wall time far more than CPU time, so the budget holds the same on a busy or idle
#: machine. 120 CPU seconds is a minute of both of CI's cores.
#: ``TORCHTITAN_SPMD_TEST_BUDGET_S`` overrides it; ``0`` turns the budget off (e.g. under a debugger).
TEST_BUDGET_S = float(os.environ.get("TORCHTITAN_SPMD_TEST_BUDGET_S", "120"))
#: When set to a path, every test appends one JSON line there: its id, backend, outcome, wall
#: seconds and CPU seconds (this process plus the children it reaped: forked ranks, subprocesses)
#: for set-up, call and tear-down. ``bench/suite_profile.py`` reads it.
PROFILE_ENV = "TORCHTITAN_SPMD_TEST_PROFILE"
_OVER_BUDGET: list[tuple[str, float]] = []


def _cpu_seconds() -> float:
    """This process's CPU seconds, the children it reaped, and its warm worlds' ranks (alive, so
    not reaped: they report theirs after each launch)."""
    import resource
    import sys

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    launcher = sys.modules.get("torchtitan_spmd.launcher")  # (not loaded: no warm world either)
    warm = launcher.warm_cpu_seconds() if launcher is not None else 0.0
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + warm


def slow_reason(item: pytest.Item) -> str | None:
    """The reason a test's ``slow`` marker gives, or None when it has none."""
    marker = item.get_closest_marker("slow")
    if marker is None:
        return None
    reason = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
    return str(reason)


slow_reason.__test__ = False  # type: ignore[attr-defined]


def pytest_collection_finish(session: pytest.Session) -> None:
    unexplained = [item.nodeid for item in session.items
                   if item.get_closest_marker("slow") is not None and not slow_reason(item).strip()]
    if unexplained:
        raise pytest.UsageError("pytest.mark.slow needs a reason=\"...\" (why the test cannot be "
                                "cheaper): " + ", ".join(unexplained[:5]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    path = os.environ.get(PROFILE_ENV)
    if not path:
        return (yield)
    import json
    import time

    wall, cpu = time.monotonic(), _cpu_seconds()
    try:
        return (yield)
    finally:
        record = {
            "test": item.nodeid,
            "backend": test_backend_of(item) or "common",
            "multiproc": item.get_closest_marker("multiproc") is not None,
            "slow": slow_reason(item),
            "wall_s": round(time.monotonic() - wall, 4),
            "cpu_s": round(_cpu_seconds() - cpu, 4),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
            "stack_prefix": os.environ.get("STACK_CHECK_PREFIX", ""),
        }
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    start = _cpu_seconds()
    try:
        return (yield)
    finally:  # a fixture's runs (a module's shared training run) count for the test that set it up
        item.stash[_CALL_CPU] = item.stash.get(_CALL_CPU, 0.0) + _cpu_seconds() - start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    start = _cpu_seconds()
    try:
        return (yield)
    finally:
        item.stash[_CALL_CPU] = item.stash.get(_CALL_CPU, 0.0) + _cpu_seconds() - start


_CALL_CPU = pytest.StashKey[float]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    cpu = item.stash.get(_CALL_CPU, 0.0)
    if (call.when == "call" and report.passed and TEST_BUDGET_S > 0
            and cpu > TEST_BUDGET_S and slow_reason(item) is None):
        # Carried on the report, so that under pytest-xdist the controller sees it too.
        report.user_properties.append(("over_budget_s", cpu))
    return report
