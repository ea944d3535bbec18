"""Layer 1: compat/ is the only place that knows the legacy names.

1. A static scan of ``torchtitan_spmd/`` fails if a legacy spelling appears
   outside a line marked ``# compat hook``.
2. Deleting ``compat/`` and every ``# compat hook`` line leaves a working
   library without legacy support.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

from fork_helpers import FORK, FORK_DIR

import torchtitan_spmd

PACKAGE = Path(torchtitan_spmd.__file__).resolve().parent
HOOK = "# compat hook"
LEGACY = "full_dtensor"
_LEGACY_STRING = re.compile(r"parallelism\.(no[-_])?full[-_]dtensor|full-dtensor|^\s*full_dtensor\s*=")


def _is_module_ref(node: ast.expr) -> bool:
    """``distributed.full_dtensor`` / ``torchtitan_spmd.distributed.full_dtensor`` is the backend module."""
    return (isinstance(node, ast.Name) and node.id == "distributed") or (
        isinstance(node, ast.Attribute) and node.attr == "distributed"
    )


def legacy_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every legacy spelling in ``source`` outside ``# compat hook`` lines."""
    tree = ast.parse(source)
    lines = source.splitlines()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        hit: str | None = None
        if isinstance(node, ast.keyword) and node.arg == LEGACY:
            hit = "keyword argument full_dtensor="
        elif isinstance(node, ast.arg) and node.arg == LEGACY:
            hit = "parameter named full_dtensor"
        elif isinstance(node, ast.Attribute) and node.attr == LEGACY and not _is_module_ref(node.value):
            hit = "attribute .full_dtensor"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _LEGACY_STRING.search(node.value):
            hit = f"legacy string {node.value!r}"
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == LEGACY and isinstance(value, ast.Constant) and isinstance(value.value, bool):
                    hit = "dict key 'full_dtensor' with a bool"
        elif isinstance(node, ast.ImportFrom) and node.module and ".compat" in f".{node.module}":
            hit = "import of compat"
        elif isinstance(node, ast.Import) and any(".compat" in f".{a.name}" for a in node.names):
            hit = "import of compat"
        if hit is not None:
            lineno = getattr(node, "lineno", None)
            if lineno is None:  # ast.keyword on 3.8-; ast.arg always has one
                continue
            if HOOK not in lines[lineno - 1]:
                found.append((lineno, hit))
    return found


def _library_files() -> list[Path]:
    compat_link = PACKAGE / "compat"
    return sorted(
        p for p in PACKAGE.rglob("*.py")
        if compat_link not in p.parents and p.resolve().parent != compat_link.resolve()
    )


def test_no_legacy_names_outside_compat_hooks() -> None:
    files = _library_files()
    assert {"configs.py", "job_config.py", "manager.py"} <= {p.name for p in files}
    leaks = [
        f"{p.relative_to(PACKAGE.parent)}:{line}: {what}"
        for p in files
        for line, what in legacy_uses(p.read_text())
    ]
    assert not leaks, "legacy spellings outside compat hooks:\n" + "\n".join(leaks)


def test_scanner_catches_each_kind_of_leak() -> None:
    planted = textwrap.dedent(
        """
        from torchtitan_spmd.distributed import full_dtensor
        x = full_dtensor.validate_config
        y = torchtitan_spmd.distributed.full_dtensor
        ok = "full_dtensor"
        cfg = ParallelismConfig(full_dtensor=True)
        def f(full_dtensor): ...
        z = cfg.full_dtensor
        argv = ["--parallelism.full_dtensor"]
        d = {"full_dtensor": True}
        from torchtitan_spmd.compat.legacy import translate_legacy_section
        hooked = cfg.full_dtensor  # compat hook
        """
    )
    kinds = sorted(what for _, what in legacy_uses(planted))
    assert kinds == sorted(
        [
            "keyword argument full_dtensor=",
            "parameter named full_dtensor",
            "attribute .full_dtensor",
            "legacy string '--parallelism.full_dtensor'",
            "dict key 'full_dtensor' with a bool",
            "import of compat",
        ]
    )


def test_deleting_compat_and_hooks_removes_legacy_support_cleanly(tmp_path: Path) -> None:
    copy = tmp_path / "torchtitan_spmd"
    shutil.copytree(PACKAGE, copy, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "compat").unlink()
    for path in copy.rglob("*.py"):
        text = path.read_text()
        if HOOK in text:
            path.write_text("".join(line for line in text.splitlines(True) if HOOK not in line))
    code = textwrap.dedent(
        """
        import contextlib, importlib.util, io, warnings
        warnings.simplefilter("error")
        import torchtitan_spmd
        from torchtitan_spmd.config import ConfigManager, JobConfig, ParallelismConfig
        assert torchtitan_spmd.__file__.startswith(ROOT), torchtitan_spmd.__file__
        assert importlib.util.find_spec("torchtitan_spmd.compat") is None
        cfg = ConfigManager().parse_args(FORK + ["--parallelism.spmd_backend", "full_dtensor"])
        assert cfg.parallelism.spmd_backend == "full_dtensor"
        assert not hasattr(ParallelismConfig(), "full_dtensor")
        for bad in (
            lambda: ParallelismConfig(full_dtensor=True),
            lambda: JobConfig.from_dict({"parallelism": {"full_dtensor": True}}),
            lambda: ConfigManager().parse_args(FORK + ["--parallelism.full_dtensor"]),
        ):
            stderr = io.StringIO()
            try:
                with contextlib.redirect_stderr(stderr):
                    bad()
            except (TypeError, ValueError) as err:
                assert "full_dtensor" in str(err), err
            except SystemExit as err:  # tyro: "Unrecognized options"
                assert err.code == 2 and "full_dtensor" in stderr.getvalue(), stderr.getvalue()
            else:
                raise AssertionError("legacy spelling still accepted")
        print("clean")
        """
    ).replace("ROOT", repr(str(tmp_path))).replace("FORK", repr(FORK))
    # -S: site-packages is on the path (for tyro and torch) but its .pth files are not
    # run, so the editable install's finder cannot supply the real compat/.
    path = [str(tmp_path), str(FORK_DIR), sysconfig.get_paths()["purelib"]]
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path,
        env={"PYTHONPATH": ":".join(path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "clean"
