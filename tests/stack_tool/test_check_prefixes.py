"""Step 3 of ``python -m stack check``: each prefix is green with the layers above blocked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from stack_synth import BASE_LAYERS, Repo

from stack.runner import BOOTSTRAP


def _row(out: str, index: int) -> list[str]:
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] == str(index) and len(cells) >= 7:
            return cells
    raise AssertionError(f"no table row for layer {index} in:\n{out}")


def test_every_prefix_green_with_counts_and_table(synthetic_repo: Repo) -> None:
    r = synthetic_repo.run("check")
    assert r.code == 0, r.text
    assert "prefix 1..1 (base): ok, 2 passed / 2 collected" in r.out
    # Each later prefix runs its own layer's tests: no lower-layer test reached for a blocked
    # module, so none is carried (they would run exactly as in their own prefix).
    assert "prefix 1..3 (top): ok, 1 passed / 1 collected" in r.out
    assert "carried" not in r.out
    assert _row(r.out, 1)[1:6] == ["base", "10", "44", "2/2", "ok"]
    assert _row(r.out, 2)[4:6] == ["1/1", "ok"]
    assert _row(r.out, 3)[4:6] == ["1/1", "ok"]
    assert "stack check: ok" in r.out


def test_prefix_that_needs_a_later_layer_is_caught(synthetic_repo: Repo) -> None:
    # The name is computed, so the static scan cannot see it: only step 3 can.
    synthetic_repo.write("tests/l1/test_core.py", """\
        import importlib

        import pkg.core


        def test_core():
            top = importlib.import_module("pkg." + "top")
            assert top.TRIPLE == 3 and pkg.core.VALUE == 1
        """)
    synthetic_repo.commit()
    r = synthetic_repo.run("check")
    assert r.code == 1, r.text
    assert "[2/3] imports: " in r.out and "error:" not in r.out
    assert "prefix 1..1 (base): FAILED (pytest exit 1; 1 passed / 2 collected)" in r.out
    assert ("ModuleNotFoundError: blocked by stack check: pkg.top belongs to layer 3 (top) "
            "above the prefix") in r.out
    assert "last lines of the pytest output (prefix 1..1)" in r.out
    assert _row(r.out, 1)[4:6] == ["1/2", "FAIL"]
    # test_core reached for pkg.top: carried into prefix 1..2, where pkg.top is still above it
    assert "prefix 1..2 (mid): FAILED (pytest exit 1; 1 passed / 2 collected (1 carried from " \
           "lower layers))" in r.out
    assert _row(r.out, 2)[4:6] == ["1/2", "FAIL"]
    assert _row(r.out, 3)[4:6] == ["2/2", "ok"]  # and into 1..3, where it passes
    assert "stack check: FAILED" in r.out

    r = synthetic_repo.run("check", "--layers", "1", "-x")
    assert r.code == 1
    assert "prefix 1..2" not in r.out
    assert _row(r.out, 2)[5:7] == ["not", "run"]


def test_static_and_dynamic_failures_with_keep_going(synthetic_repo: Repo) -> None:
    synthetic_repo.write("tests/l1/test_core.py", """\
        def test_core():
            import pkg.mid.ops
            assert pkg.mid.ops.DOUBLE == 2
        """)
    synthetic_repo.commit()
    r = synthetic_repo.run("check")
    assert r.code == 1
    assert "tests/l1/test_core.py:2: layer 1 (base) imports pkg.mid.ops (function-local)" in r.out
    assert "[3/3] prefixes: skipped: fix the errors above first" in r.out
    r = synthetic_repo.run("check", "--keep-going", "--layers", "1")
    assert r.code == 1
    assert "blocked by stack check: pkg.mid belongs to layer 2 (mid) above the prefix" in r.out


def test_upper_helper_module_blocked_by_file_and_upper_tests_not_collected(
        synthetic_repo: Repo) -> None:
    # Layer 2 adds a helper and a test next to layer 1's tests.
    synthetic_repo.write("tests/l1/mid_helper.py", "from pkg.mid.ops import DOUBLE\n")
    synthetic_repo.write("tests/l1/test_upper.py",
                         "from mid_helper import DOUBLE\n\n\ndef test_up():\n    assert DOUBLE == 2\n")
    layers = [dict(x) for x in BASE_LAYERS]
    layers[0]["paths"] = [p for p in layers[0]["paths"] if p != "tests/l1/"]
    layers[0]["paths"] += ["tests/l1/test_core.py", "tests/l1/test_alias.py"]
    layers[1]["paths"] = [*layers[1]["paths"], "tests/l1/mid_helper.py", "tests/l1/test_upper.py"]
    synthetic_repo.layers(layers)
    synthetic_repo.commit()
    r = synthetic_repo.run("check")
    assert r.code == 0, r.text  # test_upper.py is not collected for prefix 1..1
    assert _row(r.out, 1)[4] == "2/2"
    # ... but for 1..2: layer 2 owns it, and layer 1's test folder collects it from then on
    assert _row(r.out, 2)[4] == "2/2"

    # A layer-1 test reaching the helper dynamically is blocked by file.
    synthetic_repo.write("tests/l1/midpkg/__init__.py", "Z = 1\n")
    synthetic_repo.write("tests/l1/test_core.py", """\
        import importlib


        def test_core():
            assert importlib.import_module("mid_" + "helper").DOUBLE == 2


        def test_core_pkg():
            assert importlib.import_module("mid" + "pkg").Z == 1
        """)
    layers[1]["paths"].append("tests/l1/midpkg/")
    synthetic_repo.layers(layers)
    synthetic_repo.commit()
    r = synthetic_repo.run("check", "--layers", "1")
    assert r.code == 1
    assert "blocked by stack check: mid_helper (tests/l1/mid_helper.py) belongs to layer 2 (mid)" \
        in r.out
    assert "blocked by stack check: midpkg (tests/l1/midpkg/__init__.py) belongs to layer 2" \
        in r.out


@pytest.mark.parametrize("jobs", ["1", "3"], ids=["one-after-the-other", "in-parallel"])
def test_a_lower_test_that_reached_for_an_upper_layer_runs_again_later(synthetic_repo: Repo, jobs: str) -> None:
    """A layer-1 test that skips without layer 2 and needs layer 3 once layer 2 is there: only a
    later prefix can see it fail, and it does, because its first run reached for a blocked module
    (in the test body, and at a test file's collection). The same whether the prefixes run one
    after the other or at once (their carried tests then run after them, in order)."""
    synthetic_repo.write("tests/l1/test_core.py", """\
        import importlib

        import pytest


        def test_core():
            pytest.importorskip("pkg.mid")
            assert importlib.import_module("pkg." + "top").TRIPLE == 3
        """)
    synthetic_repo.write("tests/l1/test_alias.py", """\
        import importlib

        import pytest

        pytest.importorskip("pkg.mid")


        def test_alias():
            assert importlib.import_module("pkg." + "top").TRIPLE == 3
        """)
    synthetic_repo.commit()
    r = synthetic_repo.run("check", "--jobs", jobs)
    assert r.code == 1, r.text
    assert _row(r.out, 1)[4:6] == ["0/1", "ok"]  # one skipped in its body, one file at collection
    assert ("prefix 1..2 (mid): FAILED (pytest exit 1; 1 passed / 3 collected (2 carried from "
            "lower layers))") in r.out
    assert "blocked by stack check: pkg.top belongs to layer 3 (top) above the prefix" in r.out
    assert _row(r.out, 3)[4:6] == ["3/3", "ok"]


def test_layer_declaring_tests_that_collect_nothing_fails(synthetic_repo: Repo) -> None:
    synthetic_repo.write("tests/l2/test_mid.py", "X = 1\n")
    synthetic_repo.write("tests/l1/test_core.py", "X = 1\n")
    synthetic_repo.write("tests/l1/test_alias.py", "X = 1\n")
    synthetic_repo.commit()
    r = synthetic_repo.run("check", "--layers", "1")
    assert r.code == 1
    assert "no tests collected (exit 5)" in r.out


def test_layer_without_tests_is_not_run(synthetic_repo: Repo) -> None:
    layers = [dict(x) for x in BASE_LAYERS]
    for layer in layers:
        layer["tests"] = []
    synthetic_repo.layers(layers)
    r = synthetic_repo.run("check", "--layers", "1")
    assert r.code == 0, r.text
    assert "no tests" in r.out


def test_stack_tests_take_precedence(synthetic_repo: Repo) -> None:
    layers = [dict(x) for x in BASE_LAYERS]
    layers[0]["stack_tests"] = ["tests/l1/test_core.py"]
    synthetic_repo.layers(layers)
    r = synthetic_repo.run("check", "--layers", "1")
    assert r.code == 0, r.text
    assert _row(r.out, 1)[4] == "1/1"


def test_bootstrap_refuses_a_package_outside_the_tree(tmp_path) -> None:
    spec = {"root": str(tmp_path), "packages": ["json"], "blocked_names": {}, "blocked_files": {},
            "pytest_args": ["-q"], "result": str(tmp_path / "r.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-c", BOOTSTRAP.read_text(), str(tmp_path / "spec.json")],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 3
    assert "stack bootstrap: FATAL: package 'json' resolves to" in proc.stderr


@pytest.mark.parametrize("jobs", ["1", "3"], ids=["one-after-the-other", "in-parallel"])
def test_a_carried_test_that_reaches_nothing_blocked_is_not_carried_further(synthetic_repo: Repo,
                                                                           jobs: str) -> None:
    """A layer-1 test that reaches for layer 2's module: carried into prefix 1..2, where nothing it
    imports is blocked any more, so 1..3 holds it unchanged and does not run it again."""
    synthetic_repo.write("tests/l1/test_core.py", """\
        import importlib

        import pytest


        def test_core():
            pytest.importorskip("pkg." + "mid")
            assert importlib.import_module("pkg.core").VALUE == 1
        """)
    synthetic_repo.commit()
    r = synthetic_repo.run("check", "--jobs", jobs)
    assert r.code == 0, r.text
    assert ("prefix 1..2 (mid): ok, 2 passed / 2 collected (1 carried from lower layers)") in r.out
    assert "prefix 1..3 (top): ok, 1 passed / 1 collected in" in r.out, r.out
