"""Step 3: prove each prefix 1..k green with every module of the layers above k blocked.

Prefix k runs layer k's own tests, plus every test of a lower layer that *reached for* a blocked
module in an earlier prefix run (the bootstrap logs each refused import with the test, or the
test file being collected, that asked for it). A lower-layer test that reached for nothing
blocked imported only modules of its own prefix, which a longer prefix holds unchanged, so it
behaves the same there: running it again would repeat its own prefix's run. A test that did
reach (it skipped, fell back, or failed without an upper layer) can behave differently once more
layers are present, so it runs again in the next prefix, and in each one after it for as long as
its latest run still reached for a blocked module: once a run of it reaches for nothing blocked,
the same argument holds for it as for a test that never reached, and it is not carried further.
An import refused outside any test (a conftest at start-up) carries every lower-layer test along.
"""

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


#: What the bootstrap logs when a blocked import is refused outside any test or collected file.
ANYWHERE = "<session>"


@dataclass
class PrefixResult:
    k: int
    exit_code: int
    seconds: float
    counts: dict[str, int] = field(default_factory=dict)
    output: str = ""
    note: str = ""
    #: Tests of lower layers run again here because they reached for a blocked module before.
    carried: tuple[str, ...] = ()
    #: Node ids (or test files, or :data:`ANYWHERE`) that reached for a blocked module in this run.
    reached: tuple[str, ...] = ()

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


def _is_test_file(path: str) -> bool:
    """pytest's default test-file names (``test_*.py``, ``*_test.py``)."""
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def _within(test: str, arg: str) -> bool:
    """Whether node id or file ``test`` lies inside pytest argument ``arg`` (a directory, file or
    node id)."""
    test_file, _, test_name = test.partition("::")
    arg_file, _, arg_name = arg.partition("::")
    if not covers(arg_file, test_file):
        return False
    return not arg_name or test_name == arg_name or test_name.startswith((arg_name + "::",
                                                                         arg_name + "["))


def carried_tests(config: StackConfig, k: int, reached: list[str]) -> list[str]:
    """The lower-layer tests prefix k runs again: those of ``reached`` (node ids, test files or
    :data:`ANYWHERE`, logged by prefix k-1's runs, the tests it carried included) that lie in
    layers 1..k-1's tests. Every test carried into k-1 ran there, so ``reached`` says which of
    them still reached for a blocked module: the others are not carried again.

    A file logged at collection carries the tests of it that its layer declares (all of them
    when the layer names the file or a folder above it).
    """
    lower = list(dict.fromkeys(t for layer in config.layers[: k - 1] for t in layer.prefix_tests))
    if ANYWHERE in reached:
        return lower
    out: list[str] = []
    for hit in dict.fromkeys(reached):
        for arg in lower:
            if _within(hit, arg):
                out.append(hit)
                break
            if _within(arg, hit):  # a collected file that holds tests the layer names one by one
                out.append(arg)
    files = {t for t in out if "::" not in t}
    return list(dict.fromkeys(t for t in out if "::" not in t or t.split("::", 1)[0] not in files))


def prefix_plan(config: StackConfig, tree: Tree, owner: dict, k: int, run_root: Path,
                carried: list[str] | None = None, *, own_tests: bool = True) -> dict:
    """The bootstrap spec for prefix k: pytest args, blocked names and files.

    ``own_tests=False``: only ``carried`` (the second half of a prefix run in parallel mode)."""
    upper = config.layers[k:]
    # Layer k's test files that a lower layer's test folder collects (its own list may not name
    # them): they are collectable from prefix k on, so prefix k runs them.
    lower_args = [t for layer in config.layers[: k - 1] for t in layer.prefix_tests]
    newly_collectable = sorted(
        path for path, layer in owner.items()
        if layer.index == k and _is_test_file(path)
        and any("::" not in arg and covers(arg, path) for arg in lower_args))
    own = [*config.layers[k - 1].prefix_tests, *newly_collectable] if own_tests else []
    test_args = list(dict.fromkeys([*own, *(carried or [])]))
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
               timeout: float | None = None, carried: list[str] | None = None,
               own_tests: bool = True) -> PrefixResult:
    """Run prefix k: layer k's tests (unless ``own_tests`` is false) and ``carried`` (see
    :func:`carried_tests`), layers above k blocked."""
    plan = prefix_plan(config, tree, owner, k, run_root, carried, own_tests=own_tests)
    if not plan["tests"]:
        return PrefixResult(k, 0, 0.0, note="no tests")
    with tempfile.TemporaryDirectory(prefix="stack-prefix-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        plan["result"] = str(Path(tmp) / "result.json")
        plan["reached"] = str(Path(tmp) / "reached.txt")
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
        reached_path = Path(plan["reached"])
        reached = reached_path.read_text(encoding="utf-8").splitlines() if reached_path.exists() else []
    result = PrefixResult(k, code, seconds, counts, output, carried=tuple(carried or ()),
                          reached=tuple(dict.fromkeys(r for r in reached if r)))
    if code == 5:
        result.note = "no tests collected (exit 5)"
    elif code == 3 and "stack bootstrap: FATAL" in output:
        result.note = "import isolation failed"
    elif code == -1:
        result.note = "timeout"
    elif code != 0:
        result.note = f"pytest exit {code}"
    return result


def merged(own: PrefixResult, carried_run: PrefixResult | None) -> PrefixResult:
    """Prefix k's result from its two runs in parallel mode: its own tests, then the carried ones."""
    if carried_run is None or carried_run.note == "no tests":
        return own
    counts = {key: own.counts.get(key, 0) + carried_run.counts.get(key, 0)
              for key in own.counts.keys() | carried_run.counts.keys()}
    failing = own if not own.ok else carried_run
    return PrefixResult(own.k, failing.exit_code, own.seconds + carried_run.seconds, counts,
                        own.output + "\n" + carried_run.output, note=failing.note,
                        carried=carried_run.carried,
                        reached=tuple(dict.fromkeys((*own.reached, *carried_run.reached))))
