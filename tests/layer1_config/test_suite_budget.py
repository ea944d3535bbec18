"""The suite's time budget (tests/conftest.py): a test costing more than the budget must say why.

Each case runs pytest in a scratch folder with this project's own ``tests/conftest.py`` and a
budget of 0.3 CPU seconds, once in one process and once under two pytest-xdist workers (CI's).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_BURN = "def _burn(seconds):\n    import time\n    end = time.process_time() + seconds\n    while time.process_time() < end:\n        pass\n"


def _pytest(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess[str]:
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = --strict-markers -p no:cacheprovider\nmarkers =\n"
        "    backend(name): x\n    multiproc: x\n    slow(reason): x\n")
    (tmp_path / "test_it.py").write_text("import pytest\n\n" + _BURN + body)
    env = {k: v for k, v in os.environ.items() if not k.endswith("_PROFILE")}  # not the outer profile's
    env["TORCHTITAN_SPMD_TEST_BUDGET_S"] = "0.3"
    env["TORCHTITAN_SPMD_SETTLE_AUTOGRAD"] = "0"  # these scratch tests fork nothing: no torch import
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist-2"])
def test_a_test_over_the_budget_fails_the_session_unless_it_says_why(tmp_path: Path, workers: list[str]) -> None:
    proc = _pytest(tmp_path, """
def test_costly():
    _burn(0.6)


@pytest.mark.slow(reason="a planted costly test")
def test_costly_with_a_reason():
    _burn(0.6)


def test_cheap():
    pass
""", *workers)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "3 passed" in out, out
    assert "FAILED: 1 test(s) cost more than the 0.3 CPU-second budget" in out, out
    assert "test_it.py::test_costly: 0." in out, out
    assert "test_costly_with_a_reason" not in out.split("CPU-second budget", 1)[1], out


def test_a_slow_marker_needs_a_reason(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "\n\n@pytest.mark.slow\ndef test_x():\n    pass\n")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert 'pytest.mark.slow needs a reason="..."' in out and "test_it.py::test_x" in out, out


def test_within_the_budget_passes(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "\n\ndef test_x():\n    _burn(0.05)\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_test_that_leaves_the_collector_off_fails_and_the_next_finds_it_on(tmp_path: Path) -> None:
    """A trainer built in the pytest process and never closed leaves Python's collector off (its
    ``training.gc_freq`` handling): every later rank forked from that worker then inherits an
    uncollected heap. The suite's conftest fails that test in one line and turns it back on."""
    proc = _pytest(tmp_path, """
import gc


def test_leaves_it_off():
    gc.disable()


def test_finds_it_on():
    assert gc.isenabled()


def test_turns_it_off_and_back_on():
    gc.disable()
    gc.enable()
""")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "3 passed, 1 error" in out, out
    assert "ERROR test_it.py::test_leaves_it_off" in out, out
    assert "left Python's garbage collector off in the pytest process" in out, out
