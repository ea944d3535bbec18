"""The codemod's field-move step: fields upstream moved at a0c831c49, to their new place.

Run as part of ``python -m torchtitan_spmd.compat.migrate PATH...`` (both ``--to june`` and
``--to august``, after the ``full_dtensor`` step). The moves (:data:`MOVES`, the same table
as the runtime's :data:`~torchtitan_spmd.compat.legacy.RENAMED_FIELDS`):

- ``training.dataset`` -> ``dataloader.dataset``, ``training.dataset_path`` -> ``dataloader.dataset_path``;
- ``model.hf_assets_path`` -> the root's ``hf_assets_path``.

Each rewrite is mechanical and idempotent; what is not is left and reported (``file:line:
review: ...``).

- **Python** (``libcst``; formatting and comments kept): an attribute chain ``X.training.dataset``
  / ``X.training.dataset_path`` becomes ``X.dataloader.dataset`` / ``...dataset_path`` and
  ``X.model.hf_assets_path`` becomes ``X.hf_assets_path`` (reads, assignments, ``del``); CLI
  flags inside string literals as in shell files. A ``TrainingConfig(dataset=...)`` /
  ``ModelConfig(hf_assets_path=...)`` keyword is reported: its new place is another call
  (``DataloaderConfig(...)``, the root config's), which the codemod does not invent.
- **TOML**: ``dataset`` / ``dataset_path`` under ``[training]`` move to ``[dataloader]`` (the
  existing table, or a new one right after ``[training]``) and ``hf_assets_path`` under
  ``[model]`` becomes a top-level key (before the first table), each with the comment lines
  directly above it; a key whose new place already holds one is left and reported. The rest
  of the file is kept byte for byte.
- **Shell and YAML**: ``--training.dataset`` / ``--training.dataset_path`` become
  ``--dataloader.dataset`` / ``--dataloader.dataset_path`` and ``--model.hf_assets_path``
  ``--hf_assets_path`` (hyphenated spellings kept as written).
"""

from __future__ import annotations

import re
from typing import Any

from .legacy import RENAMED_FIELDS
from .migrate_august import ReviewSite, StepResult, _import_libcst

__all__ = ["MOVES", "migrate_cli_text_fields", "migrate_python_fields", "migrate_toml_fields"]

#: old ``(section, field)`` -> new ``(section, field)``; ``""``: the root config.
MOVES: dict[tuple[str, str], tuple[str, str]] = dict(RENAMED_FIELDS)

_NOTE_KEYWORD = ("{callee}({name}=...): upstream moved this field to {new} (a0c831c49); pass it there "
                 "by hand (the old spelling still works, with a DeprecationWarning)")
_NOTE_TOML_BOTH = "{old} not moved: {new} is already set in this file; drop one of them by hand"
_NOTE_TOML_MULTILINE = "{old} not moved: its value spans several lines; move it to {new} by hand"


def _spelled(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name


# ----------------------------------------------------------------------------- CLI flags
_CLI_FLAG = re.compile(r"--(training|model)\.(dataset(?:[-_]path)?|hf[-_]assets[-_]path)\b")


def _rewrite_flags(text: str) -> str:
    def replace(m: re.Match[str]) -> str:
        section, name = m.group(1), m.group(2)
        new = MOVES.get((section, name.replace("-", "_")))
        if new is None:  # e.g. --model.dataset: not a moved field
            return m.group(0)
        return f"--{new[0]}.{name}" if new[0] else f"--{name}"

    return _CLI_FLAG.sub(replace, text)


def migrate_cli_text_fields(text: str) -> StepResult:
    """The field-move step of a shell or YAML file's text."""
    return StepResult(_rewrite_flags(text))


# ----------------------------------------------------------------------------- Python
def _transformer() -> type:
    cst = _import_libcst()
    m = cst.metadata
    keywords = {("TrainingConfig", "dataset"), ("TrainingConfig", "dataset_path"), ("ModelConfig", "hf_assets_path")}
    owner_class = {"training": "TrainingConfig", "model": "ModelConfig"}

    class Fields(cst.CSTTransformer):
        METADATA_DEPENDENCIES = (m.PositionProvider,)

        def __init__(self) -> None:
            super().__init__()
            self.sites: list[ReviewSite] = []

        def leave_Attribute(self, original: Any, updated: Any) -> Any:
            inner = updated.value
            if not isinstance(inner, cst.Attribute):
                return updated
            new = MOVES.get((inner.attr.value, updated.attr.value))
            if new is None:
                return updated
            if new[0]:  # X.training.dataset -> X.dataloader.dataset
                return updated.with_changes(value=inner.with_changes(attr=cst.Name(new[0])))
            return updated.with_changes(value=inner.value)  # X.model.hf_assets_path -> X.hf_assets_path

        def leave_Call(self, original: Any, updated: Any) -> Any:
            func = updated.func
            callee = func.value if isinstance(func, cst.Name) else func.attr.value \
                if isinstance(func, cst.Attribute) else None
            for arg in updated.args:
                if arg.keyword is not None and (callee, arg.keyword.value) in keywords:
                    section = next(s for s, c in owner_class.items() if c == callee)
                    new = MOVES[(section, arg.keyword.value)]
                    line = self.get_metadata(m.PositionProvider, original).start.line
                    self.sites.append(ReviewSite(line, _NOTE_KEYWORD.format(
                        callee=callee, name=arg.keyword.value, new=_spelled(*new))))
            return updated

        def leave_SimpleString(self, original: Any, updated: Any) -> Any:
            new = _rewrite_flags(updated.value)
            return updated if new == updated.value else updated.with_changes(value=new)

        def leave_FormattedStringText(self, original: Any, updated: Any) -> Any:
            new = _rewrite_flags(updated.value)
            return updated if new == updated.value else updated.with_changes(value=new)

    return Fields


def migrate_python_fields(source: str) -> StepResult:
    """The field-move step of one Python file's text (see the module docstring)."""
    cst = _import_libcst()
    wrapper = cst.metadata.MetadataWrapper(cst.parse_module(source))
    transformer = _transformer()()
    new = wrapper.visit(transformer)
    return StepResult(new.code, sorted(transformer.sites, key=lambda s: s.line))


# ----------------------------------------------------------------------------- TOML
_HEADER = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\-\"' ]+?)\s*\]\s*(#.*)?$")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*=\s*(.*)$")
_COMMENT = re.compile(r"^\s*#")


def _single_line_value(value: str) -> bool:
    """Whether a TOML value starting at ``value`` ends on its line (no open multi-line string or array)."""
    v = value.strip()
    if v.startswith(('"""', "'''")):
        return v.count(v[:3]) >= 2
    if v.startswith("["):
        return v.count("[") == v.count("]")
    if v.startswith("{"):
        return v.count("{") == v.count("}")
    return True


def migrate_toml_fields(text: str) -> StepResult:
    """The field-move step of a TOML file's text (see the module docstring)."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
        had_newline = False
    else:
        had_newline = True
    tables: list[str | None] = []  # the table of each line (None: the root, before any header)
    table: str | None = None
    for line in lines:
        header = _HEADER.match(line) if not line.lstrip().startswith("[[") else None
        if header:
            table = header.group(1).strip().strip("\"'")
        tables.append(table)

    def keys_in(section: str | None) -> set[str]:
        return {k.group(1).replace("-", "_") for line, t in zip(lines, tables, strict=True)
                if t == section and (k := _KEY.match(line)) and not _HEADER.match(line)}

    sites: list[ReviewSite] = []
    moves: dict[str, list[int]] = {}  # new table ("" root) -> line indices to move there
    for i, (line, t) in enumerate(zip(lines, tables, strict=True)):
        k = _KEY.match(line)
        if t is None or k is None or _HEADER.match(line):
            continue
        new = MOVES.get((t, k.group(1).replace("-", "_")))
        if new is None:
            continue
        old_name, new_name = _spelled(t, k.group(1)), _spelled(*new)
        if new[1] in keys_in(new[0] or None):
            sites.append(ReviewSite(i + 1, _NOTE_TOML_BOTH.format(old=old_name, new=new_name)))
            continue
        if not _single_line_value(k.group(2)):
            sites.append(ReviewSite(i + 1, _NOTE_TOML_MULTILINE.format(old=old_name, new=new_name)))
            continue
        block = [i]
        j = i - 1
        while j >= 0 and tables[j] == t and _COMMENT.match(lines[j]) and not _HEADER.match(lines[j]):
            block.insert(0, j)  # the comment lines directly above travel with the key
            j -= 1
        moves.setdefault(new[0], []).extend(block)
    if not moves:
        return StepResult(text, sites)

    moved = {i for block in moves.values() for i in block}
    inserts: dict[int, list[str]] = {}  # insert before line index (len(lines): at the end)
    for section, indices in moves.items():
        body = [lines[i] for i in sorted(indices)]
        if not section:  # the root: before the first table header
            first = next((i for i, t in enumerate(tables) if t is not None), len(lines))
            inserts.setdefault(first, []).extend([*body, "\n"])
            continue
        existing = [i for i, t in enumerate(tables) if t == section]
        if existing:  # after the last non-blank line of the existing table
            last = max(i for i in existing if lines[i].strip() and i not in moved)
            inserts.setdefault(last + 1, []).extend(body)
            continue
        # a new table right after the table the keys came from
        source = tables[sorted(indices)[0]]
        after = max(i for i, t in enumerate(tables) if t == source)
        while after >= 0 and (not lines[after].strip() or after in moved) and tables[after] == source:
            after -= 1
        inserts.setdefault(after + 1, []).extend(["\n", f"[{section}]\n", *body])
    out: list[str] = []
    for i, line in enumerate(lines):
        out.extend(inserts.get(i, []))
        if i not in moved:
            out.append(line)
    out.extend(inserts.get(len(lines), []))
    result = "".join(out)
    if not had_newline:
        result = result[:-1]
    return StepResult(result, sites)
