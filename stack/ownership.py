"""Step 1: every tracked file belongs to exactly one layer; every layers.toml path is live."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .config import DEFAULT_REQUIRED, Layer, StackConfig, covers, owns
from .tree import Tree


@dataclass
class Ownership:
    owner: dict[str, Layer]  # tracked file -> its layer (the first claim on a double claim)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unowned: list[str] = field(default_factory=list)  # tracked, not required, not owned

    def files_of(self, layer: Layer) -> list[str]:
        return sorted(p for p, lay in self.owner.items() if lay.index == layer.index)


def required_entries(config: StackConfig, tree: Tree) -> tuple[str, ...]:
    if config.require_owned is not None:
        return config.require_owned
    packages = config.packages if config.packages is not None else tree.inferred_packages()
    targets = tuple(f"{t}/" for t in tree.symlinks.values() if t and t in tree.dirs)
    return tuple(dict.fromkeys((*(f"{p}/" for p in packages), *targets, *DEFAULT_REQUIRED)))


def check_ownership(config: StackConfig, tree: Tree, root: Path | None = None, *,
                    stale_is_error: bool = True) -> Ownership:
    """Assign every tracked file to its layer and report orphans, double claims and
    stale entries. ``root`` (the working tree) only improves the stale-entry hint."""
    result = Ownership(owner={})
    required = required_entries(config, tree)
    used: set[tuple[int, str]] = set()
    for path in sorted(tree.files):
        claims = [(layer, entry) for layer in config.layers for entry in layer.paths
                  if owns(entry, path)]
        for layer, entry in claims:
            used.add((layer.index, entry))
        layers = list(dict.fromkeys(layer.index for layer, _ in claims))
        if not claims:
            if any(owns(e, path) or path == e.rstrip("/") for e in required):
                result.errors.append(
                    f"{path}: orphan: tracked file is owned by no layer "
                    f"(add it to the paths of one [[layer]] in {config.display})")
            else:
                result.unowned.append(path)
            continue
        result.owner[path] = claims[0][0]
        if len(layers) > 1:
            by = "; ".join(
                f"{layer.name} via {entry!r} ({config.layer_line(layer, entry)})"
                for layer, entry in claims)
            result.errors.append(f"{path}: claimed by {len(layers)} layers: {by}")

    for layer in config.layers:
        for entry in layer.paths:
            if (layer.index, entry) in used:
                continue
            hint = ""
            on_disk = Path(root) / entry.rstrip("/") if root is not None else None
            if on_disk is not None and (
                    (on_disk.is_dir() and any(p.is_file() for p in on_disk.rglob("*")))
                    or (not on_disk.is_dir() and os.path.lexists(on_disk))):
                hint = " (it exists in the working tree but is not tracked: `git add` it)"
            msg = (f"{config.layer_line(layer, entry)}: {layer.name}: path {entry!r} "
                   f"matches no tracked file{hint}")
            (result.errors if stale_is_error else result.warnings).append(msg)

    for layer in config.layers:
        for key, entries in (("tests", layer.tests), ("stack_tests", layer.stack_tests or ())):
            for entry in entries:
                hits = [p for p in tree.files if covers(entry, p)]
                where = config.layer_line(layer, f"<{key}>")
                if not hits:
                    msg = f"{where}: {layer.name}: {key} entry {entry!r} matches no tracked file"
                    (result.errors if stale_is_error else result.warnings).append(msg)
                    continue
                # Upper-layer files inside a lower test directory are fine (they are not
                # collected for the lower prefixes); a test path wholly above is not.
                levels = {result.owner[p].index for p in hits if p in result.owner}
                above = sorted(i for i in levels if i > layer.index)
                if above and len(above) == len(levels):
                    names = ", ".join(config.layers[i - 1].name for i in above)
                    result.errors.append(
                        f"{where}: {layer.name}: {key} entry {entry!r} covers files of {names} "
                        f"above it")
    if result.unowned:
        shown = ", ".join(result.unowned[:5]) + (" ..." if len(result.unowned) > 5 else "")
        result.warnings.append(
            f"{len(result.unowned)} tracked file(s) outside the checked areas belong to no layer "
            f"and are left out of the export: {shown}")
    return result
