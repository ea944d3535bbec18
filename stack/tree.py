"""The tracked tree as Python sees it: files, symlinks, module names and their resolution.

Module names follow what the interpreter does when the repository root is on
``sys.path`` (it is: pytest runs with cwd = root) plus pytest's default
``prepend`` import mode, which puts a test file's *basedir* (its first ancestor
directory without ``__init__.py``) first on ``sys.path``. Tracked symlinks to
directories are followed, so with ``pkg/compat -> ../compat`` the file
``compat/z.py`` is the module ``pkg.compat.z``.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from .gitfiles import GITLINK_MODE, TrackedFile


@dataclass(frozen=True)
class Resolution:
    touched: tuple[str, ...]  # tracked files the import executes or traverses, outermost first
    complete: bool  # False: only a prefix of the dotted name was found in the tree


def _identifier_path(path: str) -> bool:
    return all(part.isidentifier() for part in path.split("/"))


class Tree:
    def __init__(self, files: dict[str, TrackedFile], link_targets: dict[str, str]):
        self.files = files
        self.regular = {p for p, f in files.items() if not f.is_symlink and f.mode != GITLINK_MODE}
        self.symlinks: dict[str, str | None] = {}
        for path, raw in link_targets.items():
            target = None
            if not raw.startswith("/"):
                norm = posixpath.normpath(posixpath.join(posixpath.dirname(path), raw))
                if norm != ".." and not norm.startswith("../") and norm != ".":
                    target = norm
            self.symlinks[path] = target
        self.dirs: set[str] = set()
        for p in self.regular:
            d = posixpath.dirname(p)
            while d and d not in self.dirs:
                self.dirs.add(d)
                d = posixpath.dirname(d)

    # -- paths ------------------------------------------------------------------------------
    def resolve(self, path: str) -> tuple[str | None, list[str]]:
        """Follow tracked symlinks in ``path``; return (real path, symlinks traversed)."""
        via: list[str] = []
        parts = path.split("/")
        cur = ""
        i = 0
        hops = 0
        while i < len(parts):
            cur = f"{cur}/{parts[i]}" if cur else parts[i]
            i += 1
            if cur in self.symlinks:
                hops += 1
                target = self.symlinks[cur]
                if target is None or hops > 40:
                    return None, via
                via.append(cur)
                rest = parts[i:]
                parts = target.split("/") + rest
                cur, i = "", 0
        return cur, via

    def is_package_dir(self, path: str) -> bool:
        if not path:
            return False
        real, _ = self.resolve(path)
        return real is not None and f"{real}/__init__.py" in self.regular

    def basedir(self, path: str) -> str:
        """The first ancestor directory of ``path`` without ``__init__.py`` ('' = root)."""
        d = posixpath.dirname(path)
        while d and self.is_package_dir(d):
            d = posixpath.dirname(d)
        return d

    def module_of(self, path: str) -> tuple[str, str, bool] | None:
        """(module name, sys.path base, is package) for a .py file, preferring a symlinked
        alias that lives inside a package (``pkg/compat/z.py`` over ``compat/z.py``)."""
        if not path.endswith(".py"):
            return None
        candidates = [path]
        for link, target in self.symlinks.items():
            if target and path.startswith(target + "/"):
                candidates.insert(0, link + path[len(target):])
        for logical in candidates:
            base = self.basedir(logical)
            rel = logical[len(base) + 1:] if base else logical
            stem = rel[:-3]
            is_pkg = stem == "__init__" or stem.endswith("/__init__")
            if is_pkg:
                stem = posixpath.dirname(stem)
            if not stem or not _identifier_path(stem):
                continue
            if logical is not path and "/" not in stem:
                continue  # an alias must be inside a package to be preferred
            return stem.replace("/", "."), base, is_pkg
        return None

    def root_names(self, path: str) -> set[str]:
        """Every dotted name importing ``path`` from the root of ``sys.path`` (packages,
        namespace packages and symlinked aliases)."""
        names: set[str] = set()
        logicals = [path]
        for link, target in self.symlinks.items():
            if target and path.startswith(target + "/"):
                logicals.append(link + path[len(target):])
        for logical in logicals:
            if logical.endswith("/__init__.py"):
                stem = logical[: -len("/__init__.py")]
            elif logical.endswith(".py"):
                stem = logical[:-3]
            else:
                stem = logical  # a symlink to a package directory
            if stem and _identifier_path(stem):
                names.add(stem.replace("/", "."))
        return names

    # -- modules ----------------------------------------------------------------------------
    def find_module(self, name: str, base: str) -> Resolution:
        """Resolve a dotted name against one sys.path base directory of the tree."""
        touched: list[str] = []
        cur = base
        parts = name.split(".")
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            cur = f"{cur}/{part}" if cur else part
            real, via = self.resolve(cur)
            if real is None:
                return Resolution(tuple(touched), False)
            if f"{real}/__init__.py" in self.regular:
                touched.extend(via)
                touched.append(f"{real}/__init__.py")
            elif f"{real}.py" in self.regular:
                touched.extend(via)
                touched.append(f"{real}.py")
                if not last:
                    return Resolution(tuple(touched), False)
            elif real in self.dirs:
                touched.extend(via)  # namespace package portion
            else:
                return Resolution(tuple(touched), False)
            cur = real
        return Resolution(tuple(touched), True)

    def top_found(self, name: str, base: str) -> int:
        """How strongly base provides the top-level name: 2 regular, 1 namespace, 0 none."""
        top = name.split(".", 1)[0]
        path = f"{base}/{top}" if base else top
        real, _ = self.resolve(path)
        if real is None:
            return 0
        if f"{real}/__init__.py" in self.regular or f"{real}.py" in self.regular:
            return 2
        return 1 if real in self.dirs else 0

    def resolve_absolute(self, name: str, importer: str) -> Resolution:
        """Resolve ``import name`` written in file ``importer``."""
        bases = []
        b = self.basedir(importer)
        if b:
            bases.append(b)
        bases.append("")
        best: str | None = None
        for strength in (2, 1):
            for base in bases:
                if self.top_found(name, base) == strength:
                    best = base
                    break
            if best is not None:
                break
        if best is None:
            return Resolution((), False)
        return self.find_module(name, best)

    def inferred_packages(self) -> tuple[str, ...]:
        """Top-level directories with a tracked ``__init__.py`` that are not symlink targets."""
        targets = {t for t in self.symlinks.values() if t}
        pkgs = sorted({p.split("/", 1)[0] for p in self.regular
                       if p.count("/") == 1 and p.endswith("/__init__.py")})
        return tuple(p for p in pkgs if p not in targets and p.isidentifier()
                     and p not in ("tests", "bench", "stack", "docs"))
