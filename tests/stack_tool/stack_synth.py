"""Synthetic git repositories for the stack tool's tests (imported as ``stack_synth``).

``synthetic_repo(tmp_path)`` builds a tiny project with a package ``pkg`` in three
layers (base / mid / top), a ``pkg/alias -> ../shared`` directory symlink (like
``torchtitan_spmd/compat -> ../compat``) and one test directory per layer, commits it
and returns a :class:`Repo` to mutate it and to run the tool in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

MAIN = Path(__file__).resolve().parents[2]
if str(MAIN) not in sys.path:
    sys.path.insert(0, str(MAIN))

from stack.cli import main  # noqa: E402

GIT_ENV = {
    "GIT_AUTHOR_NAME": "Test", "GIT_AUTHOR_EMAIL": "test@example.invalid",
    "GIT_COMMITTER_NAME": "Test", "GIT_COMMITTER_EMAIL": "test@example.invalid",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
}

BASE_FILES = {
    "pyproject.toml": "[project]\nname = 'pkg'\nversion = '0'\n",
    "pkg/__init__.py": '"""pkg."""\n',
    "pkg/core.py": "VALUE = 1\n",
    "shared/__init__.py": "",
    "shared/util.py": "from . import helpers\n\nTWICE = helpers.X * 2\n",
    "shared/helpers.py": "X = 21\n",
    "tests/l1/test_core.py": "import pkg.core\n\n\ndef test_core():\n    assert pkg.core.VALUE == 1\n",
    "tests/l1/test_alias.py": (
        "from pkg.alias import util\n\n\ndef test_alias():\n    assert util.TWICE == 42\n"),
    "pkg/mid/__init__.py": "",
    "pkg/mid/ops.py": "from pkg.core import VALUE\n\nDOUBLE = VALUE * 2\n",
    "tests/l2/test_mid.py": (
        "from pkg.mid import ops\n\n\ndef test_ops():\n    assert ops.DOUBLE == 2\n"),
    "pkg/top.py": "from pkg.mid.ops import DOUBLE\n\nTRIPLE = DOUBLE + 1\n",
    "tests/l3/test_top.py": "import pkg.top\n\n\ndef test_top():\n    assert pkg.top.TRIPLE == 3\n",
}

BASE_LAYERS = [
    dict(slug="base", title="pkg: the base layer", summary="Adds pkg.core and the shared alias.",
         test_plan="pytest tests/l1", paths=["pyproject.toml", "stack/", "pkg/__init__.py",
                                             "pkg/core.py", "pkg/alias", "shared/", "tests/l1/"],
         tests=["tests/l1"]),
    dict(slug="mid", title="pkg: mid-level ops", summary="Adds pkg.mid.",
         test_plan="pytest tests/l2", paths=["pkg/mid/", "tests/l2/"], tests=["tests/l2"]),
    dict(slug="top", title="pkg: the top", summary="Adds pkg.top.",
         test_plan="pytest tests/l3", paths=["pkg/top.py", "tests/l3/"], tests=["tests/l3"]),
]


def toml_value(value: object) -> str:
    if isinstance(value, str):
        if "\n" in value:
            return '"""\n' + value + '"""'
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def layers_toml(layers: list[dict], header: str = "") -> str:
    out = ["# synthetic layer list", header] if header else ["# synthetic layer list"]
    for layer in layers:
        out.append("")
        out.append("[[layer]]")
        for key, value in layer.items():
            out.append(f"{key} = {toml_value(value)}")
    return "\n".join(out) + "\n"


def git(root: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


class Repo:
    def __init__(self, root: Path, capsys: pytest.CaptureFixture[str]):
        self.root = root
        self.capsys = capsys

    def write(self, path: str, text: str) -> None:
        p = self.root / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))

    def layers(self, layers: list[dict], header: str = "") -> None:
        self.write("stack/layers.toml", layers_toml(layers, header))

    def commit(self, msg: str = "update") -> None:
        git(self.root, "add", "-A")
        git(self.root, "commit", "-q", "--allow-empty", "-m", msg)

    def run(self, *argv: str) -> Result:
        self.capsys.readouterr()
        code = main([*argv[:1], "--root", str(self.root), *argv[1:]])
        cap = self.capsys.readouterr()
        return Result(code, cap.out, cap.err)


def make_repo(root: Path, capsys: pytest.CaptureFixture[str], files: dict[str, str] | None = None,
              layers: list[dict] | None = None) -> Repo:
    root.mkdir(parents=True, exist_ok=True)
    git(root, "init", "-q")
    # Bytecode caches stay out of the commits, as a real project's .gitignore keeps them (the
    # test sessions let Python write them, and a prefix run imports the synthetic tree's modules).
    (root / ".git" / "info").mkdir(parents=True, exist_ok=True)
    (root / ".git" / "info" / "exclude").write_text("__pycache__/\n*.pyc\n")
    repo = Repo(root, capsys)
    for path, text in (files if files is not None else BASE_FILES).items():
        repo.write(path, text)
    os.symlink("../shared", root / "pkg" / "alias")
    repo.layers(layers if layers is not None else [dict(x) for x in BASE_LAYERS])
    repo.commit("initial")
    return repo
