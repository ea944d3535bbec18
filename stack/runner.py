"""Step 3: run the tests of layers 1..k with every module of the layers above k blocked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .config import StackConfig, covers
from .tree import Tree

BOOTSTRAP = Path(__file__).with_name("_bootstrap.py")
# Set in the environment of every prefix run: lets a test refuse to recurse into the tool.
ACTIVE_ENV = "STACK_CHECK_PREFIX"
TAIL_LINES = 60


@dataclass
class PrefixResult:
    k: int
    exit_code: int
    seconds: float
    counts: dict[str, int] = field(default_factory=dict)
    output: str = ""
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def tests_cell(self) -> str:
        if not self.counts:
            return self.note or "-"
        return f"{self.counts.get('passed', 0)}/{self.counts.get('collected', 0)}"

    def tail(self, n: int = TAIL_LINES) -> str:
        lines = self.output.rstrip().splitlines()
        return "\n".join(lines[-n:])


def prefix_plan(config: StackConfig, tree: Tree, owner: dict, k: int, run_root: Path) -> dict:
    """The bootstrap spec for prefix k: pytest args, blocked names and files."""
    lower = config.layers[:k]
    upper = config.layers[k:]
    test_args = list(dict.fromkeys(t for layer in lower for t in layer.prefix_tests))
    ignores: list[str] = []
    for layer in upper:
        for entry in layer.paths:
            if any(covers(t, entry.rstrip("/")) for t in test_args):
                ignores.append(f"--ignore={entry.rstrip('/')}")
    blocked_names: dict[str, tuple[int, str]] = {}
    blocked_files: dict[str, tuple[int, str]] = {}
    for path, layer in owner.items():
        if layer.index <= k:
            continue
        how = (layer.index, layer.slug)
        if path.endswith(".py") or tree.files[path].is_symlink:
            for name in tree.root_names(path):
                if name not in blocked_names or blocked_names[name][0] < layer.index:
                    blocked_names[name] = how
        if path.endswith(".py") and path in tree.regular:
            blocked_files[str(Path(run_root) / path)] = how
    # A name is blocked only if no lower-layer module shares it (e.g. a namespace dir).
    for path, layer in owner.items():
        if layer.index <= k and (path.endswith(".py") or tree.files[path].is_symlink):
            for name in tree.root_names(path):
                blocked_names.pop(name, None)
    packages = config.packages if config.packages is not None else tree.inferred_packages()
    return {
        "root": str(run_root),
        "packages": list(packages),
        "blocked_names": blocked_names,
        "blocked_files": blocked_files,
        "pytest_args": ["-q", "-p", "no:cacheprovider", *ignores, *test_args],
        "tests": test_args,
    }


def run_prefix(config: StackConfig, tree: Tree, owner: dict, k: int, run_root: Path, *,
               timeout: float | None = None) -> PrefixResult:
    plan = prefix_plan(config, tree, owner, k, run_root)
    if not plan["tests"]:
        return PrefixResult(k, 0, 0.0, note="no tests")
    with tempfile.TemporaryDirectory(prefix="stack-prefix-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        plan["result"] = str(Path(tmp) / "result.json")
        spec_path.write_text(json.dumps(plan), encoding="utf-8")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(run_root), *filter(None, [env.get("PYTHONPATH")])])
        env[ACTIVE_ENV] = str(k)
        cmd = [sys.executable, "-c", BOOTSTRAP.read_text(encoding="utf-8"), str(spec_path)]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=run_root, env=env, capture_output=True, text=True,
                                  errors="replace", timeout=timeout)
            code, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout or ""
            out = out.decode(errors="replace") if isinstance(out, bytes) else out
            code, output = -1, out + f"\n[stack] timed out after {timeout:.0f}s"
        seconds = time.monotonic() - start
        counts: dict[str, int] = {}
        result_path = Path(plan["result"])
        if result_path.exists():
            counts = json.loads(result_path.read_text(encoding="utf-8"))
    result = PrefixResult(k, code, seconds, counts, output)
    if code == 5:
        result.note = "no tests collected (exit 5)"
    elif code == 3 and "stack bootstrap: FATAL" in output:
        result.note = "import isolation failed"
    elif code == -1:
        result.note = "timeout"
    elif code != 0:
        result.note = f"pytest exit {code}"
    return result
