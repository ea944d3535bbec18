"""Step 2b: the package's levels and its import circles.

The stacked series orders *layers* (config -> mesh -> runtime -> spmd_types); inside a
layer the package still has a direction: what sits below the models (meshes, layouts, the
representations) must not import the models, the models must not import the techniques
that use them, and so on. ``[stack] levels`` in ``layers.toml`` lists the package's levels,
bottom first, each a list of path entries ("dir/" owns everything under it, any other entry
exactly that file). :func:`scan_levels` reports

- every import that reaches a module of a higher level than the importer's (at top level,
  in a function, under ``TYPE_CHECKING`` or through a literal ``importlib.import_module``:
  the same scan as the layer check, :mod:`stack.imports`), and
- every import circle among the scanned modules (a strongly connected component of the
  module graph, found with Tarjan's algorithm), whatever the levels: a circle is what made
  "below" and "above" meaningless before the levels existed.

A file under no level is not checked against the levels but is part of the circle check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .config import owns
from .imports import _resolutions, collect_imports, excluded_from_scan
from .tree import Tree

__all__ = ["LevelScan", "level_of", "scan_levels"]


@dataclass
class LevelScan:
    errors: list[str]
    upward: int
    circles: int
    scanned: int


def level_of(path: str, levels: Sequence[Sequence[str]]) -> int | None:
    """The index of the level owning ``path`` (the most specific entry wins), or None."""
    best: tuple[int, int] | None = None  # (entry length, level)
    for index, entries in enumerate(levels):
        for entry in entries:
            if owns(entry, path) and (best is None or len(entry) > best[0]):
                best = (len(entry), index)
    return best[1] if best is not None else None


def _level_name(index: int, levels: Sequence[Sequence[str]]) -> str:
    return f"level {index} ({', '.join(levels[index])})"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing
    itself), each sorted, in sorted order (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            if children:
                child = children.pop(0)
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, sorted(graph.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    out.append(sorted(component))
    return sorted(out)


def scan_levels(tree: Tree, paths: Sequence[str], read: Callable[[str], bytes | None],
                levels: Sequence[Sequence[str]], exclude: tuple[str, ...] = ()) -> LevelScan:
    """Check the ``.py`` files among ``paths`` (the package's, owned by the layers) against
    ``levels``, and the module graph of all of them for circles."""
    errors: list[str] = []
    graph: dict[str, set[str]] = {}
    upward = scanned = 0
    for path in sorted(paths):
        if not path.endswith(".py") or path not in tree.regular or excluded_from_scan(path, exclude):
            continue
        data = read(path)
        if data is None:
            continue
        try:
            refs = collect_imports(data, path)
        except (SyntaxError, ValueError):
            continue  # the layer scan reports it
        scanned += 1
        mine = level_of(path, levels) if levels else None
        edges = graph.setdefault(path, set())
        for ref in refs:
            for name, resolution in _resolutions(tree, path, ref):
                if not resolution.complete or not resolution.touched:
                    continue
                target = resolution.touched[-1]
                if target != path:
                    edges.add(target)
                if mine is None:
                    continue
                theirs = level_of(target, levels)
                if theirs is not None and theirs > mine:
                    upward += 1
                    errors.append(f"{path}:{ref.line}: imports {name} ({ref.kind}), but {target} is at "
                                  f"{_level_name(theirs, levels)}, above {_level_name(mine, levels)}")
    for edges in graph.values():
        edges.intersection_update(graph)
    found = _circles(graph)
    for component in found:
        members = set(component)
        where = [f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in members]
        errors.append(f"import circle among {len(component)} modules: {'; '.join(where)}")
    return LevelScan(errors, upward, len(found), scanned)
