"""Step 2b of ``python -m stack check``: the package's levels and its import circles
(``[stack] levels``, :mod:`stack.levels`), on synthetic trees."""

from __future__ import annotations

from stack_synth import BASE_LAYERS, Repo

from stack.levels import _circles, level_of

# pkg/core.py below pkg/mid/ below pkg/top.py, all in one layer: only the levels order them.
ONE_LAYER = [dict(BASE_LAYERS[0], paths=[*BASE_LAYERS[0]["paths"], "pkg/mid/", "pkg/top.py",
                                         "tests/l2/", "tests/l3/"], tests=["tests/l1", "tests/l2", "tests/l3"])]
LEVELS = '[stack]\nlevels = [["pkg/__init__.py", "pkg/core.py", "pkg/alias", "shared/"], ["pkg/mid/"], ["pkg/top.py"]]'


def _check(repo: Repo) -> tuple[int, str]:
    repo.layers([dict(x) for x in ONE_LAYER], header=LEVELS)
    repo.commit("levels")
    r = repo.run("check", "--no-tests")
    return r.code, r.text


def test_levels_clean_tree_is_green(synthetic_repo: Repo) -> None:
    code, text = _check(synthetic_repo)
    assert code == 0, text
    assert "3 package levels: 0 upward import(s), 0 import circle(s)" in text


def test_an_import_of_a_higher_level_is_an_error(synthetic_repo: Repo) -> None:
    """The same layer, but pkg/mid (level 1) imports pkg/top (level 2) inside a function."""
    synthetic_repo.write("pkg/mid/ops.py", "from pkg.core import VALUE\n\nDOUBLE = VALUE * 2\n\n\n"
                                           "def f():\n    from pkg import top\n    return top\n")
    code, text = _check(synthetic_repo)
    assert code != 0
    assert "1 upward import(s)" in text
    assert ("pkg/mid/ops.py:7: imports pkg.top (function-local), but pkg/top.py is at level 2 (pkg/top.py), "
            "above level 1 (pkg/mid/)") in text


def test_an_import_circle_is_an_error(synthetic_repo: Repo) -> None:
    """pkg/core.py and shared/helpers.py (one level) import each other: a circle, not an upward import."""
    synthetic_repo.write("shared/helpers.py", "X = 21\n\n\ndef f():\n    import pkg.core\n    return pkg.core\n")
    synthetic_repo.write("pkg/core.py", "from pkg.alias import helpers\n\nVALUE = 1\n")
    code, text = _check(synthetic_repo)
    assert code != 0
    assert "0 upward import(s), 1 import circle(s)" in text
    assert "import circle among 2 modules: pkg/core.py -> shared/helpers.py; shared/helpers.py -> pkg/core.py" \
        in text


def test_circles_and_level_of() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _circles(graph) == [["a", "b", "c"], ["e"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
    levels = [["pkg/"], ["pkg/top.py"]]
    assert level_of("pkg/top.py", levels) == 1  # the most specific entry wins
    assert level_of("pkg/core.py", levels) == 0
    assert level_of("other.py", levels) is None
