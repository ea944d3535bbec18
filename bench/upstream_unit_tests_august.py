"""Upstream's own unit tests for the config sections and ``ParallelDims``, on this library.

For each upstream commit (b5bcd76, August: surface ``august``; a0c831c49, June: surface
``june``) and each of its ``tests/unit_tests/test_config_manager.py`` and
``tests/unit_tests/test_parallel_dims.py``, it runs pytest twice:

- ``upstream``: the file as it is, in upstream's tree (the baseline on this machine: a
  test that needs CUDA fails here either way);
- ``library``: the file with only its imports changed, in a fork of that tree whose
  ``torchtitan/config/configs.py`` and ``torchtitan/distributed/parallel_dims.py`` re-export
  this library (``bench/upstream_trainer_august.py`` builds both trees): every name the test
  imports from those two modules, or a config section it imports from ``torchtitan.config``,
  comes from ``torchtitan_spmd.config.configs`` / ``torchtitan_spmd.distributed.parallel_dims``
  (also ``patch("...parallel_dims.device_type")`` targets). Everything else it imports
  (upstream's ``ConfigManager``, FSDP, models, spmd_types helpers) stays upstream's, as in a fork.

    python bench/upstream_unit_tests_august.py --deps DIR [--commits b5bcd76 a0c831c49]
        [--files test_parallel_dims.py] [-k EXPR] [--sides library]

``--deps``: a ``pip install --target`` folder with upstream's data dependencies (grain,
einops; a0c831c49's trainer also imports ``torchdata``: install it with ``--no-deps``, or
pip pulls another torch) and ``expecttest`` (torch's ``DTensorTestBase`` needs it; its
classes spawn 4 or 8 ranks per test: minutes on 2 cores). Prints pytest's summary per run and a table of counts.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import upstream_trainer_august as trees  # noqa: E402  (the sibling measuring tool)

HERE = Path(__file__).resolve().parents[1]
SURFACE = {"b5bcd76": "august", "a0c831c49": "june"}
FILES = ("test_config_manager.py", "test_parallel_dims.py", "test_compile_moe.py", "test_context_parallel_validation.py")
#: The config sections a fork re-exports (June also had ``ActivationCheckpointConfig`` there).
SECTIONS = {"ActivationCheckpointConfig", "CommConfig", "CompileConfig", "DebugConfig", "ParallelismConfig",
            "TrainingConfig"}
MODULES = {
    "torchtitan.config.configs": "torchtitan_spmd.config.configs",
    "torchtitan.distributed.parallel_dims": "torchtitan_spmd.distributed.parallel_dims",
    "torchtitan.distributed.context_parallel": "torchtitan_spmd.distributed.context_parallel",
}


def _import_line(module: str, names: list[ast.alias]) -> str:
    return f"from {module} import " + ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in names)


def rewrite(source: str) -> str:
    """Change the imports only (module docstring); every other line is kept as it is."""
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ImportFrom) or node.module is None:
            continue
        new: list[str] = []
        if node.module in MODULES:
            new = [_import_line(MODULES[node.module], node.names)]
        elif node.module == "torchtitan.config" and any(a.name in SECTIONS for a in node.names):
            keep = [a for a in node.names if a.name not in SECTIONS]
            moved = [a for a in node.names if a.name in SECTIONS]
            new = ([_import_line("torchtitan.config", keep)] if keep else []) + [
                _import_line("torchtitan_spmd.config.configs", moved)]
        if new:
            edits.append((node.lineno - 1, node.end_lineno or node.lineno, "\n".join(new) + "\n"))
    for start, end, text in reversed(edits):
        lines[start:end] = [text]
    out = "".join(lines)
    return re.sub(r"([\"'])torchtitan\.distributed\.parallel_dims\.", r"\1torchtitan_spmd.distributed.parallel_dims.",
                  out)


_COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected)")


def run_file(tree: Path, name: str, source: str, surface: str, deps: str | None, library: bool,
             keyword: str | None, log: Path) -> dict[str, int]:
    """Run one test file (written into ``tree``'s ``tests/unit_tests``) with pytest; its counts."""
    target = tree / "tests" / "unit_tests" / (f"_lib_{name}" if library else name)
    target.write_text(source)
    path = [str(tree), *( [str(HERE)] if library else []), *([deps] if deps else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "TORCHTITAN_SPMD_SURFACE": surface}
    cmd = [sys.executable, "-m", "pytest", str(target.relative_to(tree)), "-q", "-p", "no:cacheprovider",
           "-rfE", "--tb=line", "-W", "ignore::DeprecationWarning"] + (["-k", keyword] if keyword else [])
    with open(log, "w") as out:
        subprocess.run(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    tail = log.read_text(errors="replace").strip().splitlines()[-1:]
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
              for n, kind in _COUNTS.findall(tail[0] if tail else "")}
    return counts


def main() -> int:
    """Command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=trees.DEFAULT_WORK.with_name("upstream_unit_tests"))
    parser.add_argument("--commits", nargs="*", default=list(SURFACE))
    parser.add_argument("--files", nargs="*", default=list(FILES))
    parser.add_argument("--sides", nargs="*", default=["upstream", "library"])
    parser.add_argument("--deps")
    parser.add_argument("-k", dest="keyword")
    args = parser.parse_args()
    rows = []
    for commit in args.commits:
        work = args.work / commit
        if not (work / "library").is_dir():
            trees.setup(work, commit)
        for name in args.files:
            original = (work / "unmodified" / "tests" / "unit_tests" / name).read_text()
            for side in args.sides:
                library = side == "library"
                tag = "_k_" + re.sub(r"\W+", "_", args.keyword)[:60] if args.keyword else ""
                log = work / f"{side}_{name}{tag}.log"
                counts = run_file(work / ("library" if library else "unmodified"), name,
                                  rewrite(original) if library else original, SURFACE[commit], args.deps, library,
                                  args.keyword, log)
                rows.append((commit, name, side, counts, log))
                print(f"{commit} {name} {side}: {counts} ({log})", flush=True)
    print("| commit | file | run | passed | failed | errors | skipped |")
    print("|---|---|---|---|---|---|---|")
    for commit, name, side, c, _ in rows:
        print(f"| {commit} | {name} | {side} | {c.get('passed', 0)} | {c.get('failed', 0)} | {c.get('error', 0)} | "
              f"{c.get('skipped', 0)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
