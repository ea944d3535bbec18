"""Thin wrappers over git: tracked files (index or a commit), blobs, isolated temp repos."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

SYMLINK_MODE = "120000"
GITLINK_MODE = "160000"

# Identity and config isolation for the temporary repositories the tool creates:
# no user/system config (hooks, signing, format.* settings) leaks into the series.
ISOLATED_GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_TERMINAL_PROMPT": "0",
}


class GitError(Exception):
    pass


@dataclass(frozen=True)
class TrackedFile:
    path: str  # repository-relative, POSIX separators
    mode: str  # "100644", "100755", "120000" (symlink), "160000" (submodule)
    sha: str

    @property
    def is_symlink(self) -> bool:
        return self.mode == SYMLINK_MODE


def git(root: Path | str, *args: str, input: bytes | None = None,
        env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    full_env = None
    if env is not None:
        full_env = dict(os.environ)
        full_env.update(env)
    proc = subprocess.run(["git", "-C", str(root), *args], input=input, capture_output=True,
                          env=full_env)
    if check and proc.returncode != 0:
        raise GitError(f"git {' '.join(args)} failed in {root} (exit {proc.returncode}):\n"
                       + proc.stderr.decode(errors="replace").strip())
    return proc


def toplevel(path: Path) -> Path | None:
    proc = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return Path(proc.stdout.strip())


def index_files(root: Path) -> dict[str, TrackedFile]:
    """Every tracked file (the index, as ``git ls-files`` sees it)."""
    out = git(root, "ls-files", "-s", "-z").stdout.decode()
    files: dict[str, TrackedFile] = {}
    for rec in filter(None, out.split("\0")):
        meta, path = rec.split("\t", 1)
        mode, sha, _stage = meta.split()
        files.setdefault(path, TrackedFile(path, mode, sha))
    return files


def tree_files(root: Path, rev: str = "HEAD") -> dict[str, TrackedFile]:
    """Every file of commit ``rev``."""
    out = git(root, "ls-tree", "-r", "-z", "--full-tree", rev).stdout.decode()
    files: dict[str, TrackedFile] = {}
    for rec in filter(None, out.split("\0")):
        meta, path = rec.split("\t", 1)
        mode, _type, sha = meta.split()
        files[path] = TrackedFile(path, mode, sha)
    return files


def has_head(root: Path) -> bool:
    return git(root, "rev-parse", "--verify", "-q", "HEAD", check=False).returncode == 0


def read_blobs(root: Path, shas: list[str]) -> dict[str, bytes]:
    """Contents of blobs, in one ``git cat-file --batch`` call."""
    wanted = list(dict.fromkeys(shas))
    if not wanted:
        return {}
    out = git(root, "cat-file", "--batch", input=("\n".join(wanted) + "\n").encode()).stdout
    blobs: dict[str, bytes] = {}
    pos = 0
    for sha in wanted:
        nl = out.index(b"\n", pos)
        header = out[pos:nl].decode().split()
        if len(header) < 3 or header[1] == "missing":
            raise GitError(f"git cat-file: object {sha} is missing")
        size = int(header[2])
        blobs[sha] = out[nl + 1:nl + 1 + size]
        pos = nl + 1 + size + 1
    return blobs


def count_lines(data: bytes) -> int:
    if not data:
        return 0
    return data.count(b"\n") + (0 if data.endswith(b"\n") else 1)
