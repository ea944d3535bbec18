"""``export``: the stack as a ``git format-patch`` series; ``verify-export``: replay it.

Export reads the files from the project's **HEAD commit** (not the working tree), so a
series is reproducible: the same HEAD and layers.toml give byte-identical patches (the
commits reuse HEAD's author and date). It builds the series in a throwaway repository
that borrows HEAD's objects through ``objects/info/alternates`` (nothing is written to
the project's repository): commit k's tree is layers 1..k's files, with their modes, so
symlinks and executable bits survive.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .config import Layer, StackConfig
from .gitfiles import ISOLATED_GIT_ENV, GitError, TrackedFile, git

PATCH_RE = re.compile(r"^(\d{4})-(.+)\.patch$")


class ExportError(Exception):
    pass


def commit_message(config: StackConfig, layer: Layer, count: int | None = None) -> str:
    """Subject, summary, Test Plan, and the ghstack-style stack list (newest on top)."""
    listed = config.layers[: count or len(config.layers)]
    stack = "\n".join(
        f"* {'__->__ ' if other.index == layer.index else ''}#{other.index} {other.title}"
        for other in reversed(listed))
    parts = [layer.title.strip()]
    if layer.summary.strip():
        parts.append(layer.summary.strip())
    parts.append("Test Plan:\n" + (layer.test_plan.strip() or "(none)"))
    parts.append("Stack from ghstack (oldest at bottom):\n" + stack)
    return "\n\n".join(parts) + "\n"


@dataclass
class Identity:
    name: str
    email: str
    date: str

    def env(self) -> dict[str, str]:
        return {
            "GIT_AUTHOR_NAME": self.name, "GIT_AUTHOR_EMAIL": self.email,
            "GIT_AUTHOR_DATE": self.date, "GIT_COMMITTER_NAME": self.name,
            "GIT_COMMITTER_EMAIL": self.email, "GIT_COMMITTER_DATE": self.date,
            **ISOLATED_GIT_ENV,
        }


def head_identity(root: Path) -> Identity:
    out = git(root, "log", "-1", "--format=%an%x00%ae%x00%aI", "HEAD").stdout.decode().strip()
    name, email, date = out.split("\0")
    return Identity(name or "stack", email or "stack@localhost", date)


def git_objects_dir(root: Path) -> Path:
    common = git(root, "rev-parse", "--git-common-dir").stdout.decode().strip()
    path = Path(common)
    if not path.is_absolute():
        path = Path(root) / path
    return (path / "objects").resolve()


def build_series(root: Path, config: StackConfig, layer_files: list[list[TrackedFile]],
                 outdir: Path) -> list[Path]:
    """Commit each layer on top of the previous ones in a temp repo; format-patch them."""
    ident = head_identity(root)
    env = ident.env()
    outdir.mkdir(parents=True, exist_ok=True)
    for old in outdir.iterdir():
        if PATCH_RE.match(old.name) and old.is_file():
            old.unlink()
    with tempfile.TemporaryDirectory(prefix="stack-export-") as tmp:
        repo = Path(tmp) / "repo"
        git(tmp, "init", "-q", str(repo), env=env)
        (repo / ".git" / "objects" / "info").mkdir(parents=True, exist_ok=True)
        (repo / ".git" / "objects" / "info" / "alternates").write_text(
            f"{git_objects_dir(root)}\n")
        parent: str | None = None
        for layer, files in zip(config.layers, layer_files, strict=False):
            info = "".join(f"{f.mode} {f.sha}\t{f.path}\0" for f in files)
            git(repo, "update-index", "-z", "--add", "--index-info", input=info.encode(), env=env)
            tree = git(repo, "write-tree", env=env).stdout.decode().strip()
            msg = commit_message(config, layer, len(layer_files))
            args = ["commit-tree", tree, *(["-p", parent] if parent else [])]
            parent = git(repo, *args, input=msg.encode(), env=env).stdout.decode().strip()
        assert parent is not None
        git(repo, "update-ref", "refs/heads/stack", parent, env=env)
        raw = Path(tmp) / "out"
        git(repo, "format-patch", "-q", "--root", "--binary", "--no-signature",
            "-o", str(raw), "refs/heads/stack", env=env)
        produced = sorted(raw.iterdir())
        if len(produced) != len(layer_files):
            raise ExportError(f"git format-patch wrote {len(produced)} patches for "
                              f"{len(layer_files)} layers")
        written = []
        for i, (src, layer) in enumerate(zip(produced, config.layers, strict=False), start=1):
            dest = outdir / f"{i:04d}-{layer.slug}.patch"
            shutil.copyfile(src, dest)
            written.append(dest)
    return written


def find_patches(outdir: Path, config: StackConfig) -> list[Path]:
    """The series in OUTDIR, checked against the layer list (names and order)."""
    if not outdir.is_dir():
        raise ExportError(f"{outdir}: no such directory")
    patches = sorted(p for p in outdir.iterdir() if PATCH_RE.match(p.name))
    if not patches:
        raise ExportError(f"{outdir}: no NNNN-<slug>.patch files")
    if len(patches) > len(config.layers):
        raise ExportError(f"{outdir}: {len(patches)} patches but {config.display} lists "
                          f"{len(config.layers)} layers")
    for i, (patch, layer) in enumerate(zip(patches, config.layers, strict=False), start=1):
        m = PATCH_RE.match(patch.name)
        assert m
        if int(m.group(1)) != i or m.group(2) != layer.slug:
            raise ExportError(f"{patch}: expected {i:04d}-{layer.slug}.patch for {layer.name} "
                              f"(was the layer list changed after the export?)")
    return patches


def apply_patch(repo: Path, patch: Path, env: dict[str, str]) -> None:
    proc = git(repo, "am", "-q", "--keep-cr", str(patch), env=env, check=False)
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr).decode(errors="replace").strip()
        git(repo, "am", "--abort", env=env, check=False)
        raise GitError(f"git am {patch.name} failed:\n{out}")


def compare_trees(actual: dict[str, TrackedFile], expected: dict[str, TrackedFile]) -> list[str]:
    """Differences between two {path: file} maps (content by blob id, and mode)."""
    problems = []
    for path in sorted(set(expected) - set(actual)):
        problems.append(f"{path}: missing from the replayed tree")
    for path in sorted(set(actual) - set(expected)):
        problems.append(f"{path}: in the replayed tree but not a layer-owned file of HEAD")
    for path in sorted(set(actual) & set(expected)):
        a, e = actual[path], expected[path]
        if a.sha != e.sha:
            problems.append(f"{path}: content differs from HEAD")
        elif a.mode != e.mode:
            problems.append(f"{path}: mode {a.mode} differs from HEAD's {e.mode}")
    return problems
