"""Step 2: a static (ast) scan for imports that reach a layer above the importer's."""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config import Layer
from .tree import Resolution, Tree


@dataclass(frozen=True)
class ImportRef:
    line: int
    kind: str  # "top-level", "function-local", "TYPE_CHECKING", ... (may be combined)
    module: str  # as written; relative names keep their leading dots
    names: tuple[str, ...] = ()  # `from module import names`
    package: str | None = None  # importlib.import_module(name, package)


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    if isinstance(test, ast.Attribute):
        return test.attr == "TYPE_CHECKING"
    return False


def _literal(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


class _Collector(ast.NodeVisitor):
    def __init__(self, tree: ast.Module):
        self.refs: list[ImportRef] = []
        self.func = 0
        self.type_checking = 0
        self.importlib_names = {"importlib"}
        self.import_module_names: set[str] = set()
        self.builtins_names = {"builtins"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "importlib":
                        self.importlib_names.add(a.asname or "importlib")
                    elif a.name == "builtins":
                        self.builtins_names.add(a.asname or "builtins")
            elif isinstance(node, ast.ImportFrom) and node.module == "importlib" and not node.level:
                for a in node.names:
                    if a.name == "import_module":
                        self.import_module_names.add(a.asname or a.name)

    def kind(self, extra: str | None = None) -> str:
        parts = []
        if self.type_checking:
            parts.append("TYPE_CHECKING")
        parts.append("function-local" if self.func else "top-level")
        if extra:
            parts.append(extra)
        return " ".join(parts)

    def _scoped(self, node: ast.AST) -> None:
        self.func += 1
        self.generic_visit(node)
        self.func -= 1

    visit_FunctionDef = _scoped
    visit_AsyncFunctionDef = _scoped
    visit_Lambda = _scoped

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.visit(node.test)
        self.type_checking += 1
        for stmt in node.body:
            self.visit(stmt)
        self.type_checking -= 1
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.refs.append(ImportRef(node.lineno, self.kind(), a.name))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = "." * node.level + (node.module or "")
        names = tuple(a.name for a in node.names if a.name != "*")
        self.refs.append(ImportRef(node.lineno, self.kind(), module, names))

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        target = _literal(node.args[0]) if node.args else None
        if target is None:
            for kw in node.keywords:
                if kw.arg == "name":
                    target = _literal(kw.value)
        is_import_module = (
            (isinstance(func, ast.Attribute) and func.attr == "import_module"
             and isinstance(func.value, ast.Name) and func.value.id in self.importlib_names)
            or (isinstance(func, ast.Name) and func.id in self.import_module_names))
        is_dunder = (
            (isinstance(func, ast.Name) and func.id == "__import__")
            or (isinstance(func, ast.Attribute) and func.attr == "__import__"
                and isinstance(func.value, ast.Name) and func.value.id in self.builtins_names))
        if target and is_import_module:
            package = _literal(node.args[1]) if len(node.args) > 1 else None
            for kw in node.keywords:
                if kw.arg == "package":
                    package = _literal(kw.value)
            self.refs.append(ImportRef(node.lineno, self.kind("importlib.import_module"), target,
                                       package=package))
        elif target and is_dunder and not target.startswith("."):
            self.refs.append(ImportRef(node.lineno, self.kind("__import__"), target))
        self.generic_visit(node)


def collect_imports(source: str | bytes, filename: str = "<file>") -> list[ImportRef]:
    """Every import in a module: statements anywhere plus literal dynamic imports."""
    tree = ast.parse(source, filename=filename)
    collector = _Collector(tree)
    collector.visit(tree)
    return collector.refs


def _absolute(relative: str, package: str) -> str | None:
    level = len(relative) - len(relative.lstrip("."))
    rest = relative[level:]
    parts = package.split(".") if package else []
    if level - 1 > len(parts) or (level - 1 == len(parts) and not rest):
        return None
    base = parts[: len(parts) - (level - 1)]
    return ".".join([*base, rest] if rest else base) or None


@dataclass
class ImportScan:
    errors: list[str]
    warnings: list[str]
    scanned: int
    skipped: int = 0


def _resolutions(tree: Tree, path: str, ref: ImportRef) -> list[tuple[str, Resolution]]:
    """(module name, resolution) for each module the import reaches."""
    info = tree.module_of(path)
    mod = ref.module
    base: str | None = None  # None: search like an absolute import
    if mod.startswith("."):
        anchor = ref.package
        if anchor is None:
            if info is None:
                return []
            name, base, is_pkg = info
            anchor = name if is_pkg else name.rpartition(".")[0]
        full = _absolute(mod, anchor)
        if full is None:
            return []
        mod = full

    def res(name: str) -> Resolution:
        return tree.find_module(name, base) if base is not None else tree.resolve_absolute(name, path)

    out = []
    if ref.names:
        head = res(mod)
        for n in ref.names:
            sub = res(f"{mod}.{n}")
            out.append((f"{mod}.{n}", sub) if sub.complete else (mod, head))
    else:
        out.append((mod, res(mod)))
    return out


def _worst(touched: tuple[str, ...], owner: dict[str, Layer],
           layer: Layer) -> tuple[Layer, str] | None:
    """The highest layer above ``layer`` among the touched files (the deepest on ties)."""
    worst: tuple[Layer, str] | None = None
    for t in touched:
        lay = owner.get(t)
        if lay is not None and lay.index > layer.index and (
                worst is None or lay.index >= worst[0].index):
            worst = (lay, t)
    return worst


def excluded_from_scan(path: str, exclude: tuple[str, ...] = ()) -> bool:
    """Test fixtures (any file under a directory named ``fixtures``) are data: never
    imported, so they cannot create a dependency. ``exclude`` adds layers.toml entries."""
    if "fixtures" in path.split("/")[:-1]:
        return True
    return any(path.startswith(e) if e.endswith("/") else path == e for e in exclude)


def scan_imports(tree: Tree, owner: dict[str, Layer], read: Callable[[str], bytes | None],
                 exclude: tuple[str, ...] = ()) -> ImportScan:
    """Check every owned .py file. ``read(path) -> bytes | None`` supplies the source."""
    errors: list[str] = []
    warnings: list[str] = []
    scanned = skipped = 0
    for path in sorted(owner):
        f = tree.files[path]
        if not path.endswith(".py") or f.is_symlink or path not in tree.regular:
            continue
        if excluded_from_scan(path, exclude):
            skipped += 1
            continue
        layer = owner[path]
        data = read(path)
        if data is None:
            warnings.append(f"{path}: tracked but missing from the working tree; not scanned")
            continue
        try:
            refs = collect_imports(data, path)
        except (SyntaxError, ValueError) as exc:
            line = getattr(exc, "lineno", None)
            warnings.append(f"{path}:{line or 1}: not scanned: cannot parse ({exc.__class__.__name__})")
            continue
        scanned += 1
        # Implicit: a module needs its parent packages' __init__.py (and the symlinks on
        # the way).
        info = tree.module_of(path)
        if info is not None:
            name, base, _ = info
            parents = name.split(".")[:-1]
            for i in range(1, len(parents) + 1):
                pkg = ".".join(parents[:i])
                worst = _worst(tree.find_module(pkg, base).touched, owner, layer)
                if worst is not None:
                    errors.append(
                        f"{path}:1: {layer.name}: module {name} lives in package {pkg}, but "
                        f"{worst[1]} belongs to {worst[0].name}, above it")
                    break
        seen: set[tuple[int, str]] = set()
        for ref in refs:
            for name, resolution in _resolutions(tree, path, ref):
                worst = _worst(resolution.touched, owner, layer)
                if worst is None or (ref.line, worst[1]) in seen:
                    continue
                seen.add((ref.line, worst[1]))
                errors.append(
                    f"{path}:{ref.line}: {layer.name} imports {name} ({ref.kind}), but "
                    f"{worst[1]} belongs to {worst[0].name}, above it")
    return ImportScan(errors, warnings, scanned, skipped)


def working_tree_reader(root: Path) -> Callable[[str], bytes | None]:
    def read(path: str) -> bytes | None:
        try:
            return (Path(root) / path).read_bytes()
        except OSError:
            return None
    return read
