"""Rewrite a fork's files from ``parallelism.full_dtensor`` to ``parallelism.spmd_backend``.

Run it as::

    python -m torchtitan_spmd.compat.migrate [--check] [--diff] PATH...

``PATH`` may be files or directories; directories are searched recursively
(version-control, nox/tox, virtualenv and cache folders are skipped). The
rewrite is mechanical and idempotent: a second run changes nothing.

- **Python** (``.py``, ``.pyi``; needs ``libcst``, ``pip install -e ".[migrate]"``),
  formatting and comments preserved:

  - ``ParallelDims(full_dtensor=True)`` / ``False`` / ``flag`` becomes
    ``ParallelDims(spmd_backend="full_dtensor")`` / ``"default"`` /
    ``"full_dtensor" if flag else "default"``, and ``full_dtensor=cfg.full_dtensor``
    becomes ``spmd_backend=cfg.spmd_backend``; the same for ``ParallelismConfig``
    (also through an import alias or ``cls(...)`` inside the class) and for
    ``SimpleNamespace``, which takes any keyword. A ``full_dtensor=`` keyword passed
    to any other callee is left and reported with ``file:line``: when the tree
    defines that callee with its own ``full_dtensor`` parameter (a test helper, an
    experiment's module), renaming the keyword would break the call;
  - every ``full_dtensor`` declaration (function parameter, dataclass field, class
    attribute) is left and reported; inside a class that declares its own
    ``full_dtensor``, ``self.full_dtensor`` is left too;
  - a read of ``x.full_dtensor`` becomes ``x.spmd_backend == "full_dtensor"``
    (parenthesised where precedence needs it) and ``not x.full_dtensor`` becomes
    ``x.spmd_backend != "full_dtensor"``, a site reported for human review;
  - ``x.full_dtensor = value`` becomes ``x.spmd_backend = <backend>``;
  - CLI flags inside string literals are rewritten as in shell files.

  Imports and module attributes such as ``torchtitan_spmd.distributed.full_dtensor``
  are left alone: ``full_dtensor`` is also the name of a module.
- **TOML** (``.toml``): ``full_dtensor = true`` under ``[parallelism]`` becomes
  ``spmd_backend = "full_dtensor"`` (``false``: ``"default"``); the rest of the
  file is kept byte for byte.
- **Shell and YAML** (``.sh``, ``.bash``, ``.yaml``, ``.yml``): ``--parallelism.full_dtensor``
  and its variants become ``--parallelism.spmd_backend full_dtensor`` (or ``default``).
  One shell word stays one word: ``--parallelism.full_dtensor=false`` and a flag
  that is a whole quoted word or a YAML list item use ``--parallelism.spmd_backend=...``.

Then, whatever ``--to``, the fields upstream moved at a0c831c49 (:mod:`.migrate_fields`):
``training.dataset`` / ``training.dataset_path`` -> ``dataloader.*`` and
``model.hf_assets_path`` -> the root's ``hf_assets_path``, in Python attribute chains, CLI
flags (in shell, YAML and Python strings) and TOML tables; keywords of ``TrainingConfig(...)``
/ ``ModelConfig(...)`` are reported.

Exit status: 0 on success; 1 with ``--check`` when a file would change; 2 when a
path does not exist, ``libcst`` is missing, or a file could not be read or parsed.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan_spmd._errors import install_hint

from . import migrate_august as _august
from . import migrate_fields as _fields
from .legacy import LEGACY_KEY as LEGACY
from .legacy import backend_for

__all__ = [
    "Definition",
    "FileMigration",
    "MigrationError",
    "MigrationResult",
    "ReviewSite",
    "iter_files",
    "find_definitions",
    "main",
    "migrate_cli_text",
    "migrate_file",
    "migrate_path",
    "migrate_python",
    "migrate_toml",
    "tree_definitions",
]

PYTHON_SUFFIXES = frozenset({".py", ".pyi"})
TOML_SUFFIXES = frozenset({".toml"})
CLI_SUFFIXES = frozenset({".sh", ".bash", ".yaml", ".yml"})
SUFFIXES = PYTHON_SUFFIXES | TOML_SUFFIXES | CLI_SUFFIXES

#: Directory names never searched when a directory is given.
SKIP_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        ".nox",
        ".tox",
        ".venv",
        "venv",
        "__pycache__",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        "node_modules",
    }
)

_INSTALL_HINT = install_hint("migrate")

NOT_REVIEW = (
    'not X.full_dtensor became X.spmd_backend != "full_dtensor", which is now also true '
    'when spmd_backend is "spmd_types"; a human should confirm that is intended.'
)
PASSTHROUGH_REVIEW = (
    "full_dtensor=X.full_dtensor became spmd_backend=X.spmd_backend, which now also "
    'forwards "spmd_types" (the old code passed False, meaning "default"); confirm.'
)


@dataclass(frozen=True)
class ReviewSite:
    """A place a human should look at: 1-based ``line`` and what to check."""

    line: int
    message: str


@dataclass
class MigrationResult:
    """The rewritten ``text`` and the sites that need a human's review."""

    text: str
    review_sites: list[ReviewSite] = field(default_factory=list)


@dataclass
class FileMigration:
    """The outcome for one file: its original text and the :class:`MigrationResult`."""

    path: Path
    original: str
    result: MigrationResult

    @property
    def changed(self) -> bool:
        """Whether the rewrite changes the file."""
        return self.result.text != self.original

    def diff(self) -> str:
        """A unified diff from the original to the rewritten text."""
        name = str(self.path)
        return "".join(
            difflib.unified_diff(
                self.original.splitlines(keepends=True),
                self.result.text.splitlines(keepends=True),
                fromfile=f"a/{name}",
                tofile=f"b/{name}",
            )
        )

    def write(self) -> None:
        """Write the rewritten text back, keeping the file's line endings."""
        with open(self.path, "w", encoding="utf-8", newline="") as f:
            f.write(self.result.text)


class MigrationError(ValueError):
    """A file could not be migrated (for example, it does not parse)."""


# --------------------------------------------------------------------------------------
# CLI flags (shell, YAML and Python string literals).
# --------------------------------------------------------------------------------------
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True}
_BOOL_WORDS |= {"false": False, "0": False, "no": False, "off": False}

_CLI_FLAG = re.compile(
    r"(?<![\w.-])--parallelism\.(?P<neg>no[-_])?full[-_]dtensor(?![\w-])"
    r"(?:=(?P<inline>[^\s\"'`;&|)\]},]*)"
    r"|(?P<sep>[ \t]+)(?P<value>(?i:true|false|yes|no|on|off|1|0))(?![\w.-]))?"
)
# A bare flag whose value follows as a shell variable or template placeholder.
_PLACEHOLDER_AFTER = re.compile(r"[ \t]+[\"']?[$\{]")
_YAML_ITEM_BEFORE = re.compile(r"(?:^|\n)[ \t]*-[ \t]+\Z")
_YAML_ITEM_AFTER = re.compile(r"[ \t]*(?:#[^\n]*)?(?:\r?\n|\Z)")
_CLI_REVIEW = (
    "legacy flag {flag} left unchanged: its value is not a literal boolean; "
    "rewrite it as --parallelism.spmd_backend {{default,full_dtensor,spmd_types}} by hand."
)
_CLI_NEGATIVE_REVIEW = (
    "legacy flag {flag} left unchanged: a negative flag takes no value; "
    "rewrite it as --parallelism.spmd_backend default by hand."
)


def _rewrite_cli(text: str, *, placeholder_at_end: bool = False) -> tuple[str, list[tuple[int, str]]]:
    """Rewrite legacy flags in ``text``; return it and (offset, message) review notes."""
    notes: list[tuple[int, str]] = []

    def replace(m: re.Match[str]) -> str:
        negative = m.group("neg") is not None
        inline, value = m.group("inline"), m.group("value")
        given = inline if inline is not None else value
        if given is not None:
            if negative:
                notes.append((m.start(), _CLI_NEGATIVE_REVIEW.format(flag=m.group(0))))
                return m.group(0)
            if given.lower() not in _BOOL_WORDS:
                notes.append((m.start(), _CLI_REVIEW.format(flag=m.group(0))))
                return m.group(0)
            backend = backend_for(_BOOL_WORDS[given.lower()])
            if inline is not None:
                return f"--parallelism.spmd_backend={backend}"
            return f"--parallelism.spmd_backend{m.group('sep')}{backend}"
        backend = backend_for(not negative)
        rest = text[m.end() :]
        if _PLACEHOLDER_AFTER.match(rest) or (placeholder_at_end and not rest.strip()):
            notes.append((m.start(), _CLI_REVIEW.format(flag=m.group(0))))
            return m.group(0)
        before = text[m.start() - 1] if m.start() else ""
        quoted_word = before in {'"', "'"} and rest.startswith(before)
        yaml_item = _YAML_ITEM_BEFORE.search(text, 0, m.start()) is not None and bool(
            _YAML_ITEM_AFTER.match(rest)
        )
        if quoted_word or yaml_item:  # the flag is one whole argument: keep it one word
            return f"--parallelism.spmd_backend={backend}"
        return f"--parallelism.spmd_backend {backend}"

    return _CLI_FLAG.sub(replace, text), notes


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def migrate_cli_text(text: str) -> MigrationResult:
    """Rewrite ``--parallelism.full_dtensor`` flags in shell, YAML or any plain text.

    ``--parallelism.full_dtensor`` (or ``full-dtensor``) becomes
    ``--parallelism.spmd_backend full_dtensor``; a following ``true``/``false``
    picks the backend; ``--parallelism.no-full_dtensor`` (or ``no_full_dtensor``)
    becomes ``--parallelism.spmd_backend default``. Forms that are one argument
    (``--parallelism.full_dtensor=false``, a whole quoted word, a YAML list item)
    become ``--parallelism.spmd_backend=<backend>``. Flags whose value is not a
    literal (``--parallelism.full_dtensor=$X``) are left as they are and reported.
    """
    new, notes = _rewrite_cli(text)
    return MigrationResult(new, [ReviewSite(_line_of(text, o), msg) for o, msg in notes])


# --------------------------------------------------------------------------------------
# TOML.
# --------------------------------------------------------------------------------------
_TOML_HEADER = re.compile(r"^[ \t]*\[\[?(?P<name>[^\[\]#]*)\]\]?[ \t]*(?:#.*)?$")
_TOML_KEY = r"(?:full[_-]dtensor|\"full[_-]dtensor\"|'full[_-]dtensor')"
_TOML_LEGACY = re.compile(
    r"^(?P<indent>[ \t]*)(?P<prefix>(?:parallelism[ \t]*\.[ \t]*)?)" + _TOML_KEY
    + r"(?P<eq>[ \t]*=[ \t]*)(?P<value>[^#]*?)(?P<rest>[ \t]*(?:#.*)?)$"
)
_TOML_BACKEND = re.compile(
    r"^[ \t]*(?P<prefix>(?:parallelism[ \t]*\.[ \t]*)?)[\"']?spmd[_-]backend[\"']?[ \t]*="
)


def _toml_table(name: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in name.split("."))


def _toml_scan(lines: list[str]) -> Iterator[tuple[int, str, str | None]]:
    """Yield (index, line without newline, table) for each line; the root table is ''."""
    table = ""
    for index, line in enumerate(lines):
        body = line.rstrip("\r\n")
        header = _TOML_HEADER.match(body)
        if header:
            table = _toml_table(header.group("name"))
            yield index, body, None
        else:
            yield index, body, table


def _legacy_toml_match(body: str, table: str | None) -> re.Match[str] | None:
    m = _TOML_LEGACY.match(body)
    if m is None:
        return None
    dotted = bool(m.group("prefix"))
    return m if (table == "" and dotted) or (table == "parallelism" and not dotted) else None


def migrate_toml(text: str) -> MigrationResult:
    """Rewrite ``full_dtensor = true|false`` under ``[parallelism]`` as ``spmd_backend``.

    Also handles the hyphenated key and the root-level dotted key
    ``parallelism.full_dtensor``. Keys of the same name in other tables are not
    touched. Every other byte of the file, comments included, is kept.
    """
    lines = text.splitlines(keepends=True)
    has_backend = False
    for _, body, table in _toml_scan(lines):
        m = _TOML_BACKEND.match(body)
        if m and ((table == "" and m.group("prefix")) or (table == "parallelism" and not m.group("prefix"))):
            has_backend = True
    review: list[ReviewSite] = []
    for index, body, table in _toml_scan(lines):
        m = _legacy_toml_match(body, table)
        if m is None:
            continue
        value = m.group("value").strip()
        if value not in ("true", "false"):
            review.append(ReviewSite(index + 1, f"left unchanged, not a boolean: {body.strip()}"))
            continue
        if has_backend:
            review.append(
                ReviewSite(
                    index + 1,
                    f"left unchanged, [parallelism] already sets spmd_backend: {body.strip()}; "
                    "delete the legacy key by hand.",
                )
            )
            continue
        newline = lines[index][len(body) :]
        prefix = "parallelism." if m.group("prefix") else ""
        backend = backend_for(value == "true")
        lines[index] = (
            f'{m.group("indent")}{prefix}spmd_backend{m.group("eq")}"{backend}"{m.group("rest")}{newline}'
        )
    return MigrationResult("".join(lines), review)


# --------------------------------------------------------------------------------------
# Python.
# --------------------------------------------------------------------------------------
def _import_libcst() -> Any:
    try:
        import libcst
        import libcst.metadata  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "Rewriting Python files needs libcst, which is not installed; install the "
            f"'migrate' extra: {_INSTALL_HINT}"
        ) from exc
    return libcst


@functools.cache
def _transformer_class() -> type:
    """Build the libcst transformer (libcst is imported only when Python is rewritten)."""
    cst = _import_libcst()
    from libcst.metadata import ParentNodeProvider, PositionProvider

    full_dtensor = cst.SimpleString('"full_dtensor"')
    default = cst.SimpleString('"default"')

    def is_name_chain(node: Any) -> bool:
        while isinstance(node, cst.Attribute):
            node = node.value
        return isinstance(node, cst.Name)

    def is_module_path(node: Any) -> bool:
        """``distributed`` or ``<names>.distributed``: a package, not a config object."""
        if isinstance(node, cst.Name):
            return node.value == "distributed"
        return isinstance(node, cst.Attribute) and node.attr.value == "distributed" and is_name_chain(node.value)

    def is_legacy_attribute(node: Any) -> bool:
        return (
            isinstance(node, cst.Attribute)
            and node.attr.value == "full_dtensor"
            and not is_module_path(node.value)
        )

    def bool_literal(node: Any) -> bool | None:
        if isinstance(node, cst.Name) and node.value in ("True", "False"):
            return node.value == "True"
        return None

    def renamed(attr: Any) -> Any:
        return attr.with_changes(attr=cst.Name("spmd_backend"))

    def parenthesized(node: Any) -> Any:
        return node.with_changes(
            lpar=[cst.LeftParen(), *node.lpar], rpar=[*node.rpar, cst.RightParen()]
        )

    class Migrator(cst.CSTTransformer):
        METADATA_DEPENDENCIES = (PositionProvider, ParentNodeProvider)

        def __init__(
            self, index: dict[str, Definition], aliases: dict[str, str], owners: set[str]
        ) -> None:
            super().__init__()
            self.review_sites: list[ReviewSite] = []
            self._targets: set[int] = set()
            # id of each comparison made from a read -> the renamed attribute.
            self._reads: dict[int, tuple[Any, Any]] = {}
            self._index = index
            self._aliases = aliases
            self._owners = owners  # classes that declare their own full_dtensor
            # For each enclosing class: its name, and whether `self.full_dtensor` there is
            # the class's own.
            self._classes: list[tuple[str, bool]] = []

        # -- classes with their own full_dtensor -------------------------------------
        def visit_ClassDef(self, node: Any) -> None:
            name = node.name.value
            self._classes.append((name, name not in API_CALLEES and name in self._owners))

        def leave_ClassDef(self, original: Any, updated: Any) -> Any:
            self._classes.pop()
            return updated

        def _is_legacy(self, node: Any) -> bool:
            """A legacy config attribute: ``x.full_dtensor``, but not a module path and not
            ``self.full_dtensor`` inside a class that declares its own ``full_dtensor``."""
            if not is_legacy_attribute(node):
                return False
            own = bool(self._classes) and self._classes[-1][1]
            return not (own and isinstance(node.value, cst.Name) and node.value.value in ("self", "cls"))

        # -- helpers ----------------------------------------------------------------
        def _line(self, node: Any) -> int:
            return self.get_metadata(PositionProvider, node).start.line

        def _review(self, node: Any, message: str) -> None:
            self.review_sites.append(ReviewSite(self._line(node), message))

        def _mark_targets(self, node: Any, *, whole: bool) -> None:
            if self._is_legacy(node):
                self._targets.add(id(node))
                if not whole:
                    self._review(node, "assignment to full_dtensor left unchanged; migrate by hand.")
            elif isinstance(node, (cst.Tuple, cst.List)):
                for element in node.elements:
                    self._mark_targets(element.value, whole=False)
            elif isinstance(node, cst.StarredElement):
                self._mark_targets(node.value, whole=False)

        def _backend_value(self, original: Any, updated: Any) -> Any:
            """The ``spmd_backend`` expression for a legacy boolean expression."""
            literal = bool_literal(original)
            if literal is not None:
                return cst.SimpleString(f'"{backend_for(literal)}"')
            if id(updated) in self._reads:
                self._review(original, PASSTHROUGH_REVIEW)
                return self._reads[id(updated)][1]
            test = updated
            if not test.lpar and isinstance(
                test, (cst.IfExp, cst.Lambda, cst.NamedExpr, cst.Yield, cst.Tuple)
            ):
                test = parenthesized(test)
            return cst.IfExp(test=test, body=full_dtensor, orelse=default)

        # -- never rewrite imports ---------------------------------------------------
        def visit_Import(self, node: Any) -> bool:
            return False

        def visit_ImportFrom(self, node: Any) -> bool:
            return False

        # -- stores ------------------------------------------------------------------
        def visit_Assign(self, node: Any) -> None:
            whole = all(self._is_legacy(t.target) for t in node.targets)
            for target in node.targets:
                self._mark_targets(target.target, whole=whole)

        def visit_AugAssign(self, node: Any) -> None:
            self._mark_targets(node.target, whole=False)

        def visit_AnnAssign(self, node: Any) -> None:
            self._mark_targets(node.target, whole=False)

        def visit_Del(self, node: Any) -> None:
            self._mark_targets(node.target, whole=False)

        def leave_Assign(self, original: Any, updated: Any) -> Any:
            if not all(self._is_legacy(t.target) for t in original.targets):
                return updated
            targets = [t.with_changes(target=renamed(t.target)) for t in updated.targets]
            value = self._backend_value(original.value, updated.value)
            return updated.with_changes(targets=targets, value=value)

        # -- reads -------------------------------------------------------------------
        def leave_Attribute(self, original: Any, updated: Any) -> Any:
            if not self._is_legacy(original) or id(original) in self._targets:
                return updated
            if isinstance(self.get_metadata(ParentNodeProvider, original), cst.MatchValue):
                self._review(original, "full_dtensor in a match pattern left unchanged; migrate by hand.")
                return updated
            attribute = renamed(updated)
            left = attribute.with_changes(lpar=(), rpar=())
            comparison = cst.Comparison(
                left=left,
                comparisons=[cst.ComparisonTarget(cst.Equal(), full_dtensor)],
                lpar=updated.lpar,
                rpar=updated.rpar,
            )
            if not updated.lpar and self._binds_tighter(original):
                comparison = parenthesized(comparison)
            self._reads[id(comparison)] = (comparison, attribute)
            return comparison

        def _binds_tighter(self, node: Any) -> bool:
            """Whether ``node``'s parent binds tighter than a comparison does."""
            parent = self.get_metadata(ParentNodeProvider, node)
            if isinstance(parent, cst.Attribute | cst.Subscript):
                return parent.value is node
            if isinstance(parent, cst.Call):
                return parent.func is node
            if isinstance(parent, cst.UnaryOperation):
                return not isinstance(parent.operator, cst.Not)
            if isinstance(parent, cst.Arg):
                return bool(parent.star)
            return isinstance(
                parent,
                cst.BinaryOperation
                | cst.Comparison
                | cst.ComparisonTarget
                | cst.Await
                | cst.StarredElement
                | cst.StarredDictElement,
            )

        def leave_UnaryOperation(self, original: Any, updated: Any) -> Any:
            if not isinstance(updated.operator, cst.Not) or id(updated.expression) not in self._reads:
                return updated
            comparison = updated.expression
            target = comparison.comparisons[0].with_changes(operator=cst.NotEqual())
            self._review(original, NOT_REVIEW)
            return comparison.with_changes(
                comparisons=[target],
                # `(not (x.full_dtensor))` keeps one pair of parentheses, not two.
                lpar=updated.lpar or comparison.lpar,
                rpar=updated.rpar or comparison.rpar,
            )

        # -- keyword arguments -------------------------------------------------------
        def _callee(self, call: Any) -> str | None:
            """The called name (``f`` of ``f(...)`` and ``a.b.f(...)``), import aliases resolved;
            ``cls(...)`` is the enclosing class."""
            func = getattr(call, "func", None) if isinstance(call, cst.Call) else None
            if isinstance(func, cst.Name):
                name = func.value
                if name == "cls" and self._classes:
                    return self._classes[-1][0]
            elif isinstance(func, cst.Attribute):
                name = func.attr.value
            else:
                return None
            return self._aliases.get(name, name)

        def leave_Arg(self, original: Any, updated: Any) -> Any:
            if updated.keyword is None or updated.keyword.value != "full_dtensor":
                return updated
            parent = self.get_metadata(ParentNodeProvider, original)
            callee = self._callee(parent)
            if callee not in API_CALLEES | STAND_IN_CALLEES:
                self._review(original, _keyword_left_message(callee, self._index.get(callee or "")))
                return updated
            siblings = getattr(parent, "args", ())
            if any(a.keyword is not None and a.keyword.value == "spmd_backend" for a in siblings):
                self._review(
                    original,
                    "full_dtensor= left unchanged: the call also passes spmd_backend=; "
                    "delete the legacy keyword by hand.",
                )
                return updated
            value = self._backend_value(original.value, updated.value)
            return updated.with_changes(keyword=cst.Name("spmd_backend"), value=value)

        # -- CLI flags in string literals ----------------------------------------------
        def _rewrite_string_part(self, original: Any, text: str, *, placeholder_at_end: bool = False) -> str:
            new, notes = _rewrite_cli(text, placeholder_at_end=placeholder_at_end)
            for offset, message in notes:
                line = self._line(original) + text.count("\n", 0, offset)
                self.review_sites.append(ReviewSite(line, message))
            return new

        def leave_SimpleString(self, original: Any, updated: Any) -> Any:
            return updated.with_changes(value=self._rewrite_string_part(original, updated.value))

        def leave_FormattedString(self, original: Any, updated: Any) -> Any:
            parts = list(updated.parts)
            for index, part in enumerate(parts):
                if isinstance(part, cst.FormattedStringText):
                    followed = index + 1 < len(parts) and isinstance(
                        parts[index + 1], cst.FormattedStringExpression
                    )
                    value = self._rewrite_string_part(original, part.value, placeholder_at_end=followed)
                    parts[index] = part.with_changes(value=value)
            return updated.with_changes(parts=parts)

        def _fold_argv(self, original: Any, updated: Any) -> Any:
            """``["--parallelism.full_dtensor", "false"]`` -> ``["--parallelism.spmd_backend=default"]``."""
            old, new = list(original.elements), list(updated.elements)
            out: list[Any] = []
            index = 0
            while index < len(new):
                flag = string_value(old[index].value)
                value = string_value(old[index + 1].value) if index + 1 < len(old) else None
                if (
                    flag is not None
                    and value is not None
                    and re.fullmatch(r"--parallelism\.full[-_]dtensor", flag)
                    and value.lower() in _BOOL_WORDS
                ):
                    string = old[index].value
                    text = f"--parallelism.spmd_backend={backend_for(_BOOL_WORDS[value.lower()])}"
                    literal = string.with_changes(value=f"{string.prefix}{string.quote}{text}{string.quote}")
                    out.append(new[index].with_changes(value=literal, comma=new[index + 1].comma))
                    index += 2
                else:
                    out.append(new[index])
                    index += 1
            return updated.with_changes(elements=out) if len(out) != len(new) else updated

        def leave_List(self, original: Any, updated: Any) -> Any:
            return self._fold_argv(original, updated)

        def leave_Tuple(self, original: Any, updated: Any) -> Any:
            return self._fold_argv(original, updated)

    def string_value(node: Any) -> str | None:
        if isinstance(node, cst.SimpleString) and "\\" not in node.value and "b" not in node.prefix.lower():
            return str(node.evaluated_value)
        return None

    return Migrator


_PYTHON_HINT = re.compile(r"full[-_]dtensor")

#: Callees whose ``full_dtensor=`` keyword is the legacy config spelling: the config
#: and mesh API (torchtitan_spmd's, or torchtitan's if the tree still has it).
API_CALLEES = frozenset({"ParallelismConfig", "ParallelDims"})
#: Callees that take any keyword, used as stand-ins for a config (e.g. in tests).
STAND_IN_CALLEES = frozenset({"SimpleNamespace"})


@dataclass(frozen=True)
class Definition:
    """A function or class of the tree that takes its own ``full_dtensor`` parameter."""

    name: str
    kind: str  # "function" or "class"
    path: str | None
    line: int  # where ``full_dtensor`` is declared

    def where(self) -> str:
        """``path:line`` (or ``line N`` when the path is unknown)."""
        return f"{self.path}:{self.line}" if self.path else f"line {self.line}"


def _param_line(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int | None:
    args = fn.args
    for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
        if arg.arg == LEGACY:
            return arg.lineno
    return None


def _class_field_line(node: ast.ClassDef) -> int | None:
    """The line of a ``full_dtensor`` dataclass field or class attribute in ``node``'s body."""
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == LEGACY:
            return stmt.lineno
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == LEGACY for t in stmt.targets):
            return stmt.lineno
    return None


@dataclass(frozen=True)
class _Declaration:
    name: str  # the callable that takes full_dtensor: a function or a class
    kind: str  # "function" or "class"
    line: int
    what: str  # for the report; empty for a class declared through its __init__ (reported as that)
    owner: str | None  # the enclosing class
    attribute: bool  # the class's own self.full_dtensor (a field, or an __init__ parameter)


def _declarations(node: ast.AST, owner: str | None = None) -> Iterator[_Declaration]:
    """Every ``full_dtensor`` declaration under ``node``: parameters, fields, class attributes."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            line = _param_line(child)
            if line is not None:
                qualified = f"{owner}.{child.name}" if owner else child.name
                yield _Declaration(child.name, "function", line, f"parameter full_dtensor of {qualified}()",
                                   owner, owner is not None and child.name == "__init__")
            yield from _declarations(child, owner)
        elif isinstance(child, ast.ClassDef):
            line = _class_field_line(child)
            if line is not None:
                yield _Declaration(child.name, "class", line, f"field full_dtensor of class {child.name}",
                                   child.name, True)
            else:
                init = next(
                    (s for s in child.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"),
                    None,
                )
                init_line = _param_line(init) if init is not None else None
                if init_line is not None:
                    yield _Declaration(child.name, "class", init_line, "", child.name, True)
            yield from _declarations(child, child.name)
        else:
            yield from _declarations(child, owner)


def find_definitions(source: str, path: str | None = None) -> dict[str, Definition]:
    """The functions and classes of ``source`` that take their own ``full_dtensor``, by name.

    A class counts when it declares a ``full_dtensor`` field or class attribute
    (a dataclass's constructor takes it) or its ``__init__`` has the parameter.
    Raises :class:`MigrationError` if ``source`` does not parse.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise MigrationError(f"cannot parse Python: {exc}") from exc
    found: dict[str, Definition] = {}
    for d in _declarations(tree):
        found.setdefault(d.name, Definition(d.name, d.kind, path, d.line))
    return found


def _import_aliases(tree: ast.AST) -> dict[str, str]:
    """``{"PD": "ParallelDims"}`` for ``from ... import ParallelDims as PD`` (API names only)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.asname and alias.name in API_CALLEES | STAND_IN_CALLEES:
                    aliases[alias.asname] = alias.name
    return aliases


def _keyword_left_message(callee: str | None, definition: Definition | None) -> str:
    if definition is not None:
        return (
            f"full_dtensor= left unchanged: {callee} is this tree's own {definition.kind} with "
            f"a full_dtensor parameter (declared at {definition.where()}), not the config API; "
            "if it mirrors parallelism.full_dtensor, migrate it and its calls together by hand."
        )
    return (
        f"full_dtensor= left unchanged: the callee {callee or '(an expression)'} is neither "
        "ParallelismConfig nor ParallelDims and is not defined in the migrated files; "
        "check what it accepts."
    )


def _declaration_message(d: _Declaration) -> str:
    if d.owner in API_CALLEES:
        return (
            f"declaration left unchanged: {d.what} is the legacy field itself; replace it with "
            "spmd_backend (or import torchtitan_spmd's class) by hand."
        )
    inside = f" and self.full_dtensor inside {d.owner}" if d.attribute else ""
    return (
        f"declaration left unchanged: {d.what} is this tree's own; calls passing it "
        f"full_dtensor={inside} are left too."
    )


def migrate_python(source: str, *, definitions: dict[str, Definition] | None = None) -> MigrationResult:
    """Rewrite legacy ``full_dtensor`` uses in Python ``source``, keeping its formatting.

    See the module docstring for the conversions. ``review_sites`` lists each
    ``not x.full_dtensor`` that became ``x.spmd_backend != "full_dtensor"`` (it
    now also covers ``spmd_types``), every ``full_dtensor`` declaration left, and
    every site left for a human, such as a ``full_dtensor=`` keyword passed to a
    callee other than ``ParallelismConfig``/``ParallelDims``.

    ``definitions``: the tree's functions and classes with their own
    ``full_dtensor`` parameter (:func:`find_definitions` over every file), so that
    a call to one is named in its review note; default: those of ``source``.

    Raises :class:`ImportError` naming the ``migrate`` extra if ``libcst`` is
    missing, and :class:`MigrationError` if ``source`` does not parse.
    """
    if not _PYTHON_HINT.search(source):
        return MigrationResult(source)
    cst = _import_libcst()
    try:
        module = cst.parse_module(source)
        tree = ast.parse(source)
    except (cst.ParserSyntaxError, SyntaxError) as exc:
        raise MigrationError(f"cannot parse Python: {exc}") from exc
    index = {**find_definitions(source), **(definitions or {})}
    declarations = list(_declarations(tree))
    owners = {d.owner for d in declarations if d.attribute and d.owner}
    transformer = _transformer_class()(index, _import_aliases(tree), owners)
    new = cst.MetadataWrapper(module).visit(transformer)
    declared = [ReviewSite(d.line, _declaration_message(d)) for d in declarations if d.what]
    sites = sorted(set(transformer.review_sites) | set(declared), key=lambda s: (s.line, s.message))
    return MigrationResult(new.code, sites)


# --------------------------------------------------------------------------------------
# Files and the command line.
# --------------------------------------------------------------------------------------
def _is_venv(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, "pyvenv.cfg"))


def iter_files(path: str | os.PathLike[str]) -> Iterator[Path]:
    """The files under ``path`` that the migration handles, in a stable order.

    A file named directly is yielded whatever its suffix (``migrate_file``
    decides); directories are walked, skipping :data:`SKIP_DIRS` and virtualenvs.
    Raises :class:`FileNotFoundError` if ``path`` does not exist.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"no such file or directory: {str(root)!r}")
    if not root.is_dir():
        yield root
        return
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in SKIP_DIRS and not _is_venv(os.path.join(directory, d))
        )
        for name in sorted(filenames):
            if Path(name).suffix in SUFFIXES:
                yield Path(directory, name)


def _read(path: Path) -> str:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise MigrationError(f"not UTF-8 text: {exc}") from exc


def tree_definitions(files: Iterable[str | os.PathLike[str]]) -> dict[str, Definition]:
    """:func:`find_definitions` over the Python ``files`` (unreadable or unparsable ones skipped)."""
    found: dict[str, Definition] = {}
    for file in files:
        path = Path(file)
        if path.suffix not in PYTHON_SUFFIXES:
            continue
        try:
            text = _read(path)
            if _PYTHON_HINT.search(text):
                for name, definition in find_definitions(text, str(path)).items():
                    found.setdefault(name, definition)
        except (MigrationError, OSError):
            continue  # reported when the file itself is migrated
    return found


def migrate_file(
    path: str | os.PathLike[str], *, definitions: dict[str, Definition] | None = None, to: str = "june"
) -> FileMigration:
    """Migrate one file's text (nothing is written); the suffix selects the rewrite.

    ``definitions``: see :func:`migrate_python`. ``to="august"`` also runs the second step,
    upstream June's spellings to August's (:mod:`.migrate_august`).
    Raises :class:`MigrationError` for an unsupported suffix, an undecodable
    file or Python that does not parse.
    """
    path = Path(path)
    suffix = path.suffix
    if suffix not in SUFFIXES:
        raise MigrationError(f"unsupported file type {suffix or '(none)'!r}")
    original = _read(path)
    if suffix in PYTHON_SUFFIXES:
        result = migrate_python(original, definitions=definitions)
    elif suffix in TOML_SUFFIXES:
        result = migrate_toml(original)
    else:
        result = migrate_cli_text(original)
    if to not in ("june", "august"):
        raise ValueError(f"migrate: to must be 'june' or 'august', got {to!r}.")
    result = _move_fields(suffix, result)
    if to == "august":
        result = _then(suffix, result, _august.migrate_python_august, _august.migrate_toml_august,
                       _august.migrate_cli_text_august)
    return FileMigration(path, original, result)


_FIELDS_HINT = re.compile(r"dataset|hf[-_]assets[-_]path")


def _move_fields(suffix: str, result: MigrationResult) -> MigrationResult:
    """The field-move step (:mod:`.migrate_fields`: ``training.dataset*`` -> ``dataloader.*``,
    ``model.hf_assets_path`` -> the root's) on the first step's text; its review sites added."""
    if not _FIELDS_HINT.search(result.text):
        return result
    return _then(suffix, result, _fields.migrate_python_fields, _fields.migrate_toml_fields,
                 _fields.migrate_cli_text_fields)


def _then(suffix: str, result: MigrationResult, python: Callable[[str], Any], toml: Callable[[str], Any],
          cli: Callable[[str], Any]) -> MigrationResult:
    """A further step on ``result``'s text, the one for this file kind (Python, TOML, else command
    lines); the review sites of both, in line order."""
    step = python if suffix in PYTHON_SUFFIXES else toml if suffix in TOML_SUFFIXES else cli
    try:
        moved = step(result.text)
    except Exception as exc:  # noqa: BLE001 - libcst's parser errors
        raise MigrationError(f"cannot parse: {exc}") from None
    sites = [*result.review_sites, *(ReviewSite(s.line, s.message) for s in moved.review_sites)]
    return MigrationResult(moved.text, sorted(sites, key=lambda site: site.line))


def migrate_path(path: str | os.PathLike[str], *, write: bool = False, to: str = "june") -> list[FileMigration]:
    """Migrate every handled file under ``path``; with ``write=True`` save the changes.

    ``to``: ``"june"`` (``full_dtensor`` -> ``spmd_backend``) or ``"august"`` (that, then
    upstream b5bcd76's spellings). Returns one :class:`FileMigration` per file examined
    (check ``.changed``).
    """
    files = list(iter_files(path))
    definitions = tree_definitions(files)
    migrations = [migrate_file(file, definitions=definitions, to=to) for file in files]
    if write:
        for migration in migrations:
            if migration.changed:
                migration.write()
    return migrations


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_spmd.compat.migrate",
        description=(
            "Rewrite parallelism.full_dtensor as parallelism.spmd_backend in Python, "
            "TOML, shell and YAML files."
        ),
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or directories")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if any file would change"
    )
    parser.add_argument(
        "--diff", action="store_true", help="write nothing; print a unified diff of the changes"
    )
    parser.add_argument(
        "--to", choices=("june", "august"), default="june",
        help="june: full_dtensor -> spmd_backend (upstream a0c831c49); august: that, then upstream "
             "b5bcd76's spellings (partial_dtensor, the dense/sparse mesh getters, token budgets)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (see the module docstring)."""
    args = _parser().parse_args(argv)
    missing = [p for p in args.paths if not os.path.exists(p)]
    if missing:
        for p in missing:
            print(f"error: no such file or directory: {p}", file=sys.stderr)
        return 2

    files: list[Path] = []
    seen: set[str] = set()
    for p in args.paths:
        for file in iter_files(p):
            key = os.path.realpath(file)
            if key not in seen:
                seen.add(key)
                files.append(file)

    changed: list[FileMigration] = []
    errors = 0
    definitions = tree_definitions(files)
    for file in files:
        try:
            migration = migrate_file(file, definitions=definitions, to=args.to)
        except ImportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except (MigrationError, OSError) as exc:
            print(f"error: {file}: {exc}", file=sys.stderr)
            errors += 1
            continue
        for site in migration.result.review_sites:
            print(f"{file}:{site.line}: review: {site.message}", file=sys.stderr)
        if migration.changed:
            changed.append(migration)

    dry_run = args.check or args.diff
    for migration in changed:
        if args.diff:
            sys.stdout.write(migration.diff())
        elif args.check:
            print(f"would rewrite {migration.path}")
        else:
            migration.write()
    if args.check:
        print(f"{len(changed)} file(s) would be rewritten")
    elif not dry_run:
        print(f"rewrote {len(changed)} file(s)")
    if errors:
        return 2
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
