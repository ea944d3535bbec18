"""Load and validate ``stack/layers.toml``: the ordered list of layers.

Schema (every error is collected and reported with its line)::

    [stack]                      # optional
    packages = ["pkg"]           # top-level import packages (default: inferred)
    require_owned = ["x/", ...]  # tracked paths that must belong to a layer
                                 # (default: DEFAULT_REQUIRED + the package dirs)
    scan_exclude = ["x/", ...]   # .py files the import scan skips, besides any file in a
                                 # directory named "fixtures" (data, never imported)
    levels = [["a/", "b.py"], ["c/"], ...]   # the package's levels, bottom first: a module
                                 # imports only modules of its own level or below
                                 # (stack/levels.py; every import circle is an error too)

    [[layer]]                    # oldest (bottom of the stack) first
    slug = "short-name"          # [a-z0-9][a-z0-9._-]*, unique; names the patch file
    title = "one line"           # the patch subject
    summary = "..."              # the patch body
    test_plan = "..."            # the "Test Plan:" section
    paths = ["dir/", "file"]     # "dir/" owns everything under it, else exactly that file
    tests = ["tests/x"]          # pytest paths proving the layer
    stack_tests = ["tests/x"]    # optional: the subset run for every prefix
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

LAYER_REQUIRED = ("slug", "title", "summary", "test_plan", "paths", "tests")
LAYER_OPTIONAL = ("stack_tests",)
STACK_KEYS = ("packages", "require_owned", "scan_exclude", "levels")
TOP_KEYS = ("layer", "stack")

# Tracked paths that must be owned by some layer (besides the package directories).
DEFAULT_REQUIRED = (
    "tests/",
    "compat/",
    "bench/",
    "stack/",
    "docs/",
    ".ci/",
    "pyproject.toml",
    "noxfile.py",
    "README.md",
)

SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_HEADER_RE = re.compile(r"^\s*\[\[\s*layer\s*\]\]\s*(#.*)?$")
_STACK_HEADER_RE = re.compile(r"^\s*\[\s*stack\s*\]\s*(#.*)?$")


class ConfigError(Exception):
    """layers.toml is malformed; ``errors`` holds one line per problem."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


@dataclass
class Layer:
    index: int  # 1-based position in the stack
    slug: str
    title: str
    summary: str
    test_plan: str
    paths: tuple[str, ...]
    tests: tuple[str, ...]
    stack_tests: tuple[str, ...] | None = None
    line: int | None = None  # line of the [[layer]] header
    path_lines: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"layer {self.index} ({self.slug})"

    @property
    def prefix_tests(self) -> tuple[str, ...]:
        """The tests run for every prefix containing this layer."""
        return self.stack_tests if self.stack_tests is not None else self.tests


@dataclass
class StackConfig:
    path: Path  # absolute path of layers.toml
    display: str  # how messages name it (relative to the root when possible)
    layers: list[Layer]
    packages: tuple[str, ...] | None  # None: infer from the tree
    require_owned: tuple[str, ...] | None  # None: defaults
    scan_exclude: tuple[str, ...] = ()
    #: The package's levels, bottom first (each a tuple of path entries); () : no level check.
    levels: tuple[tuple[str, ...], ...] = ()

    def where(self, line: int | None) -> str:
        return f"{self.display}:{line}" if line else self.display

    def layer_line(self, layer: Layer, entry: str | None = None) -> str:
        if entry is not None and entry in layer.path_lines:
            return self.where(layer.path_lines[entry])
        return self.where(layer.line)


def owns(entry: str, path: str) -> bool:
    """Whether a layers.toml ``paths`` entry owns the repository path ``path``."""
    if entry.endswith("/"):
        return path.startswith(entry)
    return path == entry


def covers(test_path: str, path: str) -> bool:
    """Whether a pytest argument (file, directory, or node id) covers ``path``."""
    base = test_path.split("::", 1)[0].rstrip("/")
    return path == base or path.startswith(base + "/")


def _quoted_line(lines: list[str], start: int, stop: int, text: str) -> int | None:
    needles = (f'"{text}"', f"'{text}'")
    for i in range(start, stop):
        if any(n in lines[i] for n in needles):
            return i + 1
    return None


def _key_line(lines: list[str], start: int, stop: int, key: str) -> int | None:
    pat = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for i in range(start, stop):
        if pat.match(lines[i]):
            return i + 1
    return None


def _check_str_list(value: object, what: str, errors: list[str], *, allow_empty: bool) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        errors.append(f"{what} must be a list of strings, got {value!r}")
        return ()
    if not allow_empty and not value:
        errors.append(f"{what} must not be empty")
    seen: set[str] = set()
    for v in value:
        if not v.strip():
            errors.append(f"{what} contains an empty string")
        elif v.startswith(("/", "./")) or ".." in v.split("/") or "\\" in v:
            errors.append(f"{what}: {v!r} must be a plain path relative to the repository root")
        if v in seen:
            errors.append(f"{what} lists {v!r} twice")
        seen.add(v)
    return tuple(value)


def _unknown(keys: object, known: tuple[str, ...], what: str, errors: list[str]) -> None:
    for key in keys:  # type: ignore[attr-defined]
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(f"{what}: unknown key {key!r}{hint}; known keys: {', '.join(known)}")


def load_config(path: Path, root: Path | None = None, text: str | None = None,
                display: str | None = None) -> StackConfig:
    """Parse and validate layers.toml (``text`` if given, else the file at ``path``);
    raise ConfigError listing every problem."""
    path = Path(path).resolve()
    if display is None:
        display = str(path)
        if root is not None:
            try:
                display = path.relative_to(Path(root).resolve()).as_posix()
            except ValueError:
                pass
    if text is None:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                [f"{display}: cannot read the layer list: {exc.strerror or exc}"]) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{display}: not valid TOML: {exc}"]) from None

    lines = text.splitlines()
    headers = [i for i, line in enumerate(lines) if _HEADER_RE.match(line)]
    errors: list[str] = []

    def at(line: int | None) -> str:
        return f"{display}:{line}" if line else display

    _unknown(data.keys(), TOP_KEYS, at(None), errors)

    packages: tuple[str, ...] | None = None
    require_owned: tuple[str, ...] | None = None
    scan_exclude: tuple[str, ...] = ()
    levels: tuple[tuple[str, ...], ...] = ()
    stack = data.get("stack")
    if stack is not None:
        sline = next((i + 1 for i, ln in enumerate(lines) if _STACK_HEADER_RE.match(ln)), None)
        if not isinstance(stack, dict):
            errors.append(f"{at(sline)}: [stack] must be a table")
        else:
            _unknown(stack.keys(), STACK_KEYS, f"{at(sline)}: [stack]", errors)
            if "packages" in stack:
                packages = _check_str_list(stack["packages"], f"{at(sline)}: [stack] packages", errors,
                                           allow_empty=False)
                for p in packages:
                    if not p.isidentifier():
                        errors.append(f"{at(sline)}: [stack] packages: {p!r} is not a top-level module name")
            if "require_owned" in stack:
                require_owned = _check_str_list(stack["require_owned"],
                                                f"{at(sline)}: [stack] require_owned", errors,
                                                allow_empty=True)
            if "levels" in stack:
                raw = stack["levels"]
                if not isinstance(raw, list) or not raw:
                    errors.append(f"{at(sline)}: [stack] levels must be a non-empty list of path lists")
                else:
                    levels = tuple(_check_str_list(level, f"{at(sline)}: [stack] levels[{i}]", errors,
                                                   allow_empty=False) for i, level in enumerate(raw))
            if "scan_exclude" in stack:
                scan_exclude = _check_str_list(stack["scan_exclude"],
                                               f"{at(sline)}: [stack] scan_exclude", errors,
                                               allow_empty=True)

    raw_layers = data.get("layer")
    if raw_layers is None:
        errors.append(f"{at(None)}: no [[layer]] tables: the stack needs at least one layer")
        raw_layers = []
    elif not isinstance(raw_layers, list) or not all(isinstance(x, dict) for x in raw_layers):
        errors.append(f"{at(None)}: 'layer' must be an array of tables written as [[layer]]")
        raw_layers = []

    layers: list[Layer] = []
    slugs: dict[str, int] = {}
    for i, raw in enumerate(raw_layers):
        index = i + 1
        start = headers[i] if i < len(headers) and len(headers) == len(raw_layers) else None
        stop = headers[i + 1] if start is not None and i + 1 < len(headers) else len(lines)
        line = start + 1 if start is not None else None
        slug_text = raw.get("slug") if isinstance(raw.get("slug"), str) else "?"
        what = f"{at(line)}: layer {index} ({slug_text})"
        _unknown(raw.keys(), LAYER_REQUIRED + LAYER_OPTIONAL, what, errors)
        missing = [k for k in LAYER_REQUIRED if k not in raw]
        if missing:
            errors.append(f"{what}: missing required key(s): {', '.join(missing)}")
        for key in ("slug", "title", "summary", "test_plan"):
            if key in raw and not isinstance(raw[key], str):
                errors.append(f"{what}: {key} must be a string, got {type(raw[key]).__name__}")
        slug = raw.get("slug") if isinstance(raw.get("slug"), str) else ""
        if "slug" in raw and isinstance(raw["slug"], str):
            if not SLUG_RE.match(slug):
                errors.append(f"{what}: slug {slug!r} must match {SLUG_RE.pattern} (it names a patch file)")
            if slug in slugs:
                errors.append(f"{what}: duplicate slug {slug!r} (already used by layer {slugs[slug]})")
            slugs.setdefault(slug, index)
        title = raw.get("title") if isinstance(raw.get("title"), str) else ""
        if "title" in raw and isinstance(raw["title"], str):
            if not title.strip() or "\n" in title.strip():
                errors.append(f"{what}: title must be one non-empty line (it is the patch subject)")
        paths = _check_str_list(raw["paths"], f"{what}: paths", errors, allow_empty=False) \
            if "paths" in raw else ()
        tests = _check_str_list(raw["tests"], f"{what}: tests", errors, allow_empty=True) \
            if "tests" in raw else ()
        stack_tests = None
        if "stack_tests" in raw:
            stack_tests = _check_str_list(raw["stack_tests"], f"{what}: stack_tests", errors,
                                          allow_empty=True)
        path_lines: dict[str, int] = {}
        if start is not None:
            for p in paths:
                ln = _quoted_line(lines, start, stop, p)
                if ln:
                    path_lines[p] = ln
            for key in ("tests", "stack_tests"):
                ln = _key_line(lines, start, stop, key)
                if ln:
                    path_lines[f"<{key}>"] = ln
        layers.append(Layer(
            index=index,
            slug=slug,
            title=title.strip(),
            summary=raw.get("summary", "") if isinstance(raw.get("summary"), str) else "",
            test_plan=raw.get("test_plan", "") if isinstance(raw.get("test_plan"), str) else "",
            paths=paths,
            tests=tests,
            stack_tests=stack_tests,
            line=line,
            path_lines=path_lines,
        ))
    if errors:
        raise ConfigError(errors)
    return StackConfig(path=path, display=display, layers=layers, packages=packages,
                       require_owned=require_owned, scan_exclude=scan_exclude,
                       levels=levels)
