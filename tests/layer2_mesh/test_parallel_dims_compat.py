"""Layer 2: ParallelDims' legacy ``full_dtensor`` spellings and the layering rules.

- ``ParallelDims(..., full_dtensor=...)`` and reading/assigning ``pd.full_dtensor``
  work through ``compat/parallel_dims.py``, each with one DeprecationWarning at
  the caller's line;
- ``parallel_dims.py`` touches compat only on ``# compat hook`` lines, and works
  without compat/ once those lines are deleted;
- ``parallel_dims`` imports nothing of the runtime (checked in the same subprocess).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

import torchtitan_spmd
from torchtitan_spmd.compat import REMOVAL_RELEASE, LegacySpellingWarning
from torchtitan_spmd.distributed import ParallelDims
from torchtitan_spmd.distributed import parallel_dims as parallel_dims_module

HOOK = "# compat hook"
PACKAGE = Path(torchtitan_spmd.__file__).resolve().parent


def _one_warning(fn: Callable[[], object]) -> tuple[object, warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        result = fn()
    deprecations = [w for w in rec if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in rec]
    w = deprecations[0]
    assert issubclass(w.category, LegacySpellingWarning)
    assert f"removed in torchtitan_spmd {REMOVAL_RELEASE}" in str(w.message)
    return result, w


def _line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    hits = [i for i, line in enumerate(lines, start=1) if marker in line and "_line_of" not in line]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


@pytest.mark.parametrize(("value", "expected"), [(True, "full_dtensor"), (False, "default")])
def test_constructor_keyword(value: bool, expected: str) -> None:
    pd, w = _one_warning(lambda: ParallelDims(1, 2, 1, 2, 1, 1, 4, full_dtensor=value))  # PD-KW
    assert isinstance(pd, ParallelDims) and pd.spmd_backend == expected
    assert f"ParallelDims(spmd_backend={expected!r})" in str(w.message)
    assert (w.filename, w.lineno) == (__file__, _line_of("# PD-KW"))


def test_constructor_keyword_conflict_and_type() -> None:
    with pytest.raises(ValueError, match="conflicting settings full_dtensor=True"):
        ParallelDims(1, 2, 1, 2, 1, 1, 4, spmd_backend="spmd_types", full_dtensor=True)
    with pytest.raises(TypeError, match="expected bool"):
        ParallelDims(1, 2, 1, 2, 1, 1, 4, full_dtensor="yes")
    pd, _ = _one_warning(lambda: ParallelDims(1, 2, 1, 2, 1, 1, 4, spmd_backend="full_dtensor", full_dtensor=True))
    assert pd.spmd_backend == "full_dtensor"


def test_attribute_read() -> None:
    pd = ParallelDims(1, 2, 1, 2, 1, 1, 4, spmd_backend="full_dtensor")
    value, w = _one_warning(lambda: pd.full_dtensor)  # PD-READ
    assert value is True
    assert 'ParallelDims.spmd_backend == "full_dtensor"' in str(w.message)
    assert (w.filename, w.lineno) == (__file__, _line_of("# PD-READ"))
    other = ParallelDims(1, 2, 1, 2, 1, 1, 4, spmd_backend="spmd_types")
    assert _one_warning(lambda: other.full_dtensor)[0] is False


def test_attribute_assign() -> None:
    pd = ParallelDims(1, 2, 1, 2, 1, 1, 4)

    def assign(value: bool) -> None:
        pd.full_dtensor = value  # PD-WRITE

    _, w = _one_warning(lambda: assign(True))
    assert pd.spmd_backend == "full_dtensor"
    assert "ParallelDims.spmd_backend = 'full_dtensor'" in str(w.message)
    assert (w.filename, w.lineno) == (__file__, _line_of("# PD-WRITE"))
    _one_warning(lambda: assign(False))
    assert pd.spmd_backend == "default"
    with pytest.raises(TypeError, match="expected bool"):
        pd.full_dtensor = 1


def test_legacy_name_only_on_hook_lines() -> None:
    source = Path(parallel_dims_module.__file__).read_text()
    lines = source.splitlines()
    hooks = [line for line in lines if HOOK in line]
    assert 1 <= len(hooks) <= 2, hooks
    legacy = "full_dtensor"  # as an identifier; the backend *name* is a plain string
    for node in ast.walk(ast.parse(source)):
        hit = (
            (isinstance(node, ast.keyword | ast.arg) and node.arg == legacy)
            or (isinstance(node, ast.Attribute) and node.attr == legacy)
            or (isinstance(node, ast.Name) and node.id == legacy)
            or (isinstance(node, ast.ImportFrom) and "compat" in (node.module or ""))
            or (isinstance(node, ast.Import) and any("compat" in a.name for a in node.names))
        )
        if hit:
            assert HOOK in lines[node.lineno - 1], lines[node.lineno - 1]


def _run(code: str, cwd: Path, pythonpath: list[str], *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, cwd=cwd,
        env={"PYTHONPATH": ":".join(pythonpath), "PATH": "/usr/bin:/bin"},
    )


def test_works_without_compat(tmp_path: Path) -> None:
    """Deleting compat/ and every hook line leaves a ParallelDims without legacy support.

    Also checks the layering rule: importing parallel_dims loads no runtime module.
    """
    copy = tmp_path / "torchtitan_spmd"
    shutil.copytree(PACKAGE, copy, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "compat").unlink()
    for path in copy.rglob("*.py"):
        text = path.read_text()
        if HOOK in text:
            path.write_text("".join(line for line in text.splitlines(True) if HOOK not in line))
    code = """
        import importlib.util, warnings
        warnings.simplefilter("error")
        import torchtitan_spmd
        from torchtitan_spmd.distributed import ParallelDims
        assert torchtitan_spmd.__file__.startswith(ROOT), torchtitan_spmd.__file__
        assert importlib.util.find_spec("torchtitan_spmd.compat") is None
        pd = ParallelDims(1, 2, 1, 2, 1, 1, 4, spmd_backend="full_dtensor", device_type="cpu")
        assert pd.spmd_backend == "full_dtensor" and not hasattr(pd, "full_dtensor")
        try:
            ParallelDims(1, 2, 1, 2, 1, 1, 4, full_dtensor=True)
        except TypeError as err:
            assert "full_dtensor" in str(err), err
        else:
            raise AssertionError("legacy keyword still accepted")
        # Layering: parallel_dims imports config, compat and layout, never the runtime.
        import sys
        allowed = {
            "torchtitan_spmd", "torchtitan_spmd._errors", "torchtitan_spmd._surface", "torchtitan_spmd.distributed",
            "torchtitan_spmd.distributed.parallel_dims", "torchtitan_spmd.distributed.layout",
            "torchtitan_spmd.distributed._mesh_compat", "torchtitan_spmd.distributed.mesh_reuse",
            "torchtitan_spmd.distributed.planner_memo",
        }
        loaded = {m for m in sys.modules if m.startswith("torchtitan_spmd")}
        extra = sorted(m for m in loaded - allowed if not m.startswith("torchtitan_spmd.config"))
        assert not extra, extra
        print("clean")
    """.replace("ROOT", repr(str(tmp_path)))
    # -S skips the editable install's .pth (which would supply the real compat/);
    # site-packages on PYTHONPATH still provides torch and spmd_types.
    site = sysconfig.get_paths()["purelib"]
    proc = _run(code, tmp_path, [str(tmp_path), site], "-S")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "clean"
