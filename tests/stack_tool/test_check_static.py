"""Steps 1 and 2 of ``python -m stack check`` on synthetic trees (``--no-tests``)."""

from __future__ import annotations

import pytest
from stack_synth import BASE_LAYERS, Repo

from stack.imports import collect_imports


def test_clean_synthetic_tree_is_green(synthetic_repo: Repo) -> None:
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 0, r.text
    assert "error" not in r.out
    assert "[3/3] prefixes: skipped (--no-tests)" in r.out
    assert "stack check: ok" in r.out


UPWARD = {
    "top-level": (
        "pkg/core.py",
        "VALUE = 1\nfrom pkg.mid import ops\n",
        2, "pkg.mid.ops (top-level)", "pkg/mid/ops.py belongs to layer 2 (mid)"),
    "function-local": (
        "pkg/core.py",
        "VALUE = 1\n\n\ndef later():\n    import pkg.top\n    return pkg.top\n",
        5, "pkg.top (function-local)", "pkg/top.py belongs to layer 3 (top)"),
    "type-checking": (
        "pkg/core.py",
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.mid.ops import DOUBLE\n"
        "VALUE = 1\n",
        4, "pkg.mid.ops (TYPE_CHECKING top-level)", "pkg/mid/ops.py belongs to layer 2 (mid)"),
    "importlib-literal": (
        "pkg/core.py",
        "import importlib\n\nVALUE = 1\n\n\ndef f():\n"
        "    return importlib.import_module('pkg.top')\n",
        7, "pkg.top (function-local importlib.import_module)",
        "pkg/top.py belongs to layer 3 (top)"),
    "import-module-alias": (
        "pkg/core.py",
        "from importlib import import_module as im\n\nmid = im('.mid.ops', 'pkg')\nVALUE = 1\n",
        3, "pkg.mid.ops (top-level importlib.import_module)",
        "pkg/mid/ops.py belongs to layer 2 (mid)"),
    "dunder-import": (
        "pkg/core.py",
        "VALUE = 1\nm = __import__('pkg.mid')\n",
        2, "pkg.mid (top-level __import__)", "pkg/mid/__init__.py belongs to layer 2 (mid)"),
    "relative": (
        "pkg/core.py",
        "VALUE = 1\nfrom .top import TRIPLE\n",
        2, "pkg.top (top-level)", "pkg/top.py belongs to layer 3 (top)"),
    "test-file": (
        "tests/l1/test_core.py",
        "import pkg.core\n\n\ndef test_core():\n    from pkg.mid.ops import DOUBLE\n"
        "    assert DOUBLE == 2\n",
        5, "pkg.mid.ops (function-local)", "pkg/mid/ops.py belongs to layer 2 (mid)"),
    "layer2-imports-layer3": (
        "pkg/mid/ops.py",
        "from pkg.core import VALUE\n\nDOUBLE = VALUE * 2\n\n\ndef f():\n    from .. import top\n"
        "    return top\n",
        7, "layer 2 (mid) imports pkg.top (function-local)", "pkg/top.py belongs to layer 3 (top)"),
}


@pytest.mark.parametrize("case", sorted(UPWARD))
def test_upward_import_is_caught_with_file_line_and_layers(synthetic_repo: Repo,
                                                           case: str) -> None:
    path, source, line, what, whom = UPWARD[case]
    synthetic_repo.write(path, source)
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 1, r.text
    # (an upward import may also close an import circle, which stack/levels.py reports on its own line)
    errors = [ln for ln in r.out.splitlines() if ln.strip().startswith("error:") and "import circle" not in ln]
    assert len(errors) == 1, r.out
    err = errors[0]
    assert f"{path}:{line}:" in err
    assert what in err and whom in err and "above it" in err
    importer_layer = "layer 2 (mid)" if path.startswith("pkg/mid") else "layer 1 (base)"
    assert importer_layer in err
    assert "stack check: FAILED" in r.out


def test_import_through_directory_symlink_resolves_to_the_target(synthetic_repo: Repo) -> None:
    # pkg/alias -> ../shared: `pkg.alias.extra` is shared/extra.py, which layer 2 owns.
    synthetic_repo.write("shared/extra.py", "Y = 1\n")
    layers = [dict(x) for x in BASE_LAYERS]
    layers[0]["paths"] = [p if p != "shared/" else "shared/__init__.py" for p in layers[0]["paths"]]
    layers[0]["paths"] += ["shared/util.py", "shared/helpers.py"]
    layers[1]["paths"] = [*layers[1]["paths"], "shared/extra.py"]
    synthetic_repo.layers(layers)
    synthetic_repo.write("pkg/core.py", "VALUE = 1\n\n\ndef f():\n    from pkg.alias import extra\n")
    synthetic_repo.write("shared/util.py",
                         "from . import helpers\nfrom .extra import Y\n\nTWICE = helpers.X * 2\n")
    synthetic_repo.commit()
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 1
    assert ("pkg/core.py:5: layer 1 (base) imports pkg.alias.extra (function-local), but "
            "shared/extra.py belongs to layer 2 (mid), above it") in r.out
    # A relative import inside the symlinked package resolves through its alias name.
    assert ("shared/util.py:2: layer 1 (base) imports pkg.alias.extra (top-level), but "
            "shared/extra.py belongs to layer 2 (mid), above it") in r.out


def test_downward_and_external_imports_are_fine(synthetic_repo: Repo) -> None:
    synthetic_repo.write("pkg/top.py", "import os\nimport torch_does_not_exist\n"
                         "from pkg.mid.ops import DOUBLE\nfrom pkg import core\n"
                         "from pkg.alias import util\nTRIPLE = DOUBLE + 1\n")
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 0, r.text


def test_module_in_a_package_of_a_higher_layer(synthetic_repo: Repo) -> None:
    layers = [dict(x) for x in BASE_LAYERS]
    layers[1]["paths"] = ["pkg/mid/__init__.py", "tests/l2/"]
    layers[0]["paths"] = [*layers[0]["paths"], "pkg/mid/ops.py"]
    synthetic_repo.layers(layers)
    synthetic_repo.write("pkg/mid/ops.py", "DOUBLE = 2\n")
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 1
    assert ("pkg/mid/ops.py:1: layer 1 (base): module pkg.mid.ops lives in package pkg.mid, "
            "but pkg/mid/__init__.py belongs to layer 2 (mid), above it") in r.out


def test_orphan_file_is_an_error(synthetic_repo: Repo) -> None:
    synthetic_repo.write("pkg/stray.py", "X = 1\n")
    synthetic_repo.write("tests/l9/test_nobody.py", "def test_x():\n    pass\n")
    synthetic_repo.commit()
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 1
    assert "pkg/stray.py: orphan: tracked file is owned by no layer" in r.out
    assert "tests/l9/test_nobody.py: orphan" in r.out


def test_untracked_work_in_progress_is_ignored(synthetic_repo: Repo) -> None:
    synthetic_repo.write("pkg/wip.py", "import pkg.top\n")  # not git-added
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 0, r.text


def test_unowned_file_outside_the_checked_areas_is_a_warning(synthetic_repo: Repo) -> None:
    synthetic_repo.write("LICENSE", "BSD\n")
    synthetic_repo.commit()
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 0, r.text
    assert "warning: 1 tracked file(s) outside the checked areas belong to no layer" in r.out
    assert "LICENSE" in r.out


def test_required_top_level_shared_file_must_be_owned(synthetic_repo: Repo) -> None:
    synthetic_repo.write("noxfile.py", "import nox\n")
    synthetic_repo.write("bench/bench_core.py", "import pkg.core\n")
    synthetic_repo.commit()
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 1
    assert "noxfile.py: orphan" in r.out
    assert "bench/bench_core.py: orphan" in r.out


def test_file_claimed_by_two_layers(synthetic_repo: Repo) -> None:
    layers = [dict(x) for x in BASE_LAYERS]
    layers[2]["paths"] = [*layers[2]["paths"], "pkg/core.py"]
    synthetic_repo.layers(layers)
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 1
    err = next(ln for ln in r.out.splitlines() if "claimed by" in ln)
    text = (synthetic_repo.root / "stack/layers.toml").read_text().splitlines()
    l1 = next(i + 1 for i, ln in enumerate(text) if '"pkg/core.py"' in ln)
    l3 = max(i + 1 for i, ln in enumerate(text) if '"pkg/core.py"' in ln)
    assert err.strip() == (
        f"error: pkg/core.py: claimed by 2 layers: layer 1 (base) via 'pkg/core.py' "
        f"(stack/layers.toml:{l1}); layer 3 (top) via 'pkg/core.py' (stack/layers.toml:{l3})")


def test_stale_path_entry_names_its_line(synthetic_repo: Repo) -> None:
    layers = [dict(x) for x in BASE_LAYERS]
    layers[1]["paths"] = [*layers[1]["paths"], "pkg/gone.py"]
    layers[1]["tests"] = ["tests/l2", "tests/nowhere"]
    synthetic_repo.layers(layers)
    text = (synthetic_repo.root / "stack/layers.toml").read_text().splitlines()
    line = next(i + 1 for i, ln in enumerate(text) if '"pkg/gone.py"' in ln)
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 1
    assert (f"stack/layers.toml:{line}: layer 2 (mid): path 'pkg/gone.py' matches no tracked "
            f"file") in r.out
    assert "layer 2 (mid): tests entry 'tests/nowhere' matches no tracked file" in r.out


def test_test_path_owned_by_a_higher_layer(synthetic_repo: Repo) -> None:
    layers = [dict(x) for x in BASE_LAYERS]
    layers[0]["tests"] = ["tests/l1", "tests/l3"]
    synthetic_repo.layers(layers)
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 1
    assert "layer 1 (base): tests entry 'tests/l3' covers files of layer 3 (top) above it" in r.out


def test_collect_imports_kinds() -> None:
    src = (
        "import a\n"
        "from b.c import d, e as f\n"
        "from typing import TYPE_CHECKING\n"
        "import typing\n"
        "if typing.TYPE_CHECKING:\n"
        "    import g\n"
        "else:\n"
        "    import h\n"
        "class K:\n"
        "    import i\n"
        "    def m(self):\n"
        "        import importlib as il\n"
        "        return il.import_module(name='j'), __import__('k'), __import__(dyn)\n"
        "lam = lambda: __import__('l')\n"
        "from . import *\n"
    )
    refs = [(r.line, r.kind, r.module, r.names) for r in collect_imports(src)]
    assert (1, "top-level", "a", ()) in refs
    assert (2, "top-level", "b.c", ("d", "e")) in refs
    assert (6, "TYPE_CHECKING top-level", "g", ()) in refs
    assert (8, "top-level", "h", ()) in refs
    assert (10, "top-level", "i", ()) in refs
    assert (13, "function-local importlib.import_module", "j", ()) in refs
    assert (13, "function-local __import__", "k", ()) in refs
    assert (14, "function-local __import__", "l", ()) in refs
    assert (15, "top-level", ".", ()) in refs
    assert not any(m == "dyn" for _, _, m, _ in refs)


def test_which_names_the_owner(synthetic_repo: Repo) -> None:
    r = synthetic_repo.run("which", "pkg/mid/ops.py", "nowhere.txt")
    assert r.code == 1
    assert "pkg/mid/ops.py: layer 2 (mid) via 'pkg/mid/'" in r.out
    assert "nowhere.txt: no layer" in r.out


def test_fixture_files_are_data_not_imports(synthetic_repo: Repo) -> None:
    synthetic_repo.write("tests/l1/fixtures/input.py", "import pkg.top\n")
    synthetic_repo.write("tests/l1/legacy_sample.py", "import pkg.mid\n")
    synthetic_repo.commit()
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 1
    assert "fixtures/input.py" not in r.out
    assert "tests/l1/legacy_sample.py:1: layer 1 (base) imports pkg.mid" in r.out
    layers = [dict(x) for x in BASE_LAYERS]
    synthetic_repo.layers(layers, header='[stack]\nscan_exclude = ["tests/l1/legacy_sample.py"]')
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 0, r.text
    assert "(2 fixture/excluded files skipped)" in r.out


def test_stack_table_overrides_packages_and_required_paths(synthetic_repo: Repo) -> None:
    synthetic_repo.write("tests/l9/test_nobody.py", "def test_x():\n    pass\n")
    synthetic_repo.commit()
    layers = [dict(x) for x in BASE_LAYERS]
    synthetic_repo.layers(layers, header='[stack]\npackages = ["pkg"]\nrequire_owned = ["pkg/"]')
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 0, r.text
    assert "belong to no layer and are left out of the export: tests/l9/test_nobody.py" in r.out
