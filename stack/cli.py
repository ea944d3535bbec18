"""Command line: ``python -m stack {check,export,verify-export,list,which}``.

Exit codes: 0 green, 1 a check failed, 2 usage error (bad arguments, not a git
repository, malformed layers.toml).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .config import ConfigError, Layer, StackConfig, load_config
from .export import (
    ExportError,
    apply_patch,
    build_series,
    compare_trees,
    find_patches,
    head_identity,
)
from .gitfiles import (
    ISOLATED_GIT_ENV,
    GitError,
    TrackedFile,
    count_lines,
    git,
    has_head,
    index_files,
    read_blobs,
    toplevel,
    tree_files,
)
from .imports import scan_imports, working_tree_reader
from .levels import scan_levels
from .ownership import Ownership, check_ownership
from .runner import PrefixResult, carried_tests, merged, run_prefix
from .tree import Tree

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


def say(msg: str = "") -> None:
    print(msg, flush=True)


# -- loading --------------------------------------------------------------------------------
@dataclass
class Project:
    root: Path
    config: StackConfig
    files: dict[str, TrackedFile]
    tree: Tree
    own: Ownership
    source: str  # "index" (git ls-files + working tree) or "HEAD"
    lines: dict[str, int] = field(default_factory=dict)


def _resolve_root(arg: str | None) -> Path:
    start = Path(arg) if arg else Path.cwd()
    if not start.is_dir():
        raise UsageError(f"--root {start}: no such directory")
    top = toplevel(start)
    if top is None:
        raise UsageError(f"{start.resolve()}: not inside a git repository (use --root)")
    return top.resolve()


def load_project(args: argparse.Namespace, source: str) -> Project:
    root = _resolve_root(args.root)
    config_path = Path(args.config) if args.config else root / "stack" / "layers.toml"
    if not config_path.is_absolute():
        config_path = Path.cwd() / config_path
    if source == "HEAD":
        if not has_head(root):
            raise UsageError(f"{root}: the repository has no commits; export reads HEAD")
        files = tree_files(root, "HEAD")
        blobs = read_blobs(root, [f.sha for f in files.values() if f.mode != "160000"])
        # The layer list is read from HEAD too (unless --config names another file), so
        # the series matches the commit it is cut from.
        rel = None
        if not args.config:
            try:
                rel = config_path.resolve().relative_to(root).as_posix()
            except ValueError:
                rel = None
        if rel in files:
            config = load_config(config_path, root, text=blobs[files[rel].sha].decode(),
                                 display=f"HEAD:{rel}")
        else:
            config = load_config(config_path, root)
        links = {p: blobs[f.sha].decode(errors="surrogateescape")
                 for p, f in files.items() if f.is_symlink}
        lines = {p: count_lines(blobs[f.sha]) for p, f in files.items()
                 if not f.is_symlink and f.mode != "160000"}
    else:
        config = load_config(config_path, root)
        files = index_files(root)
        link_paths = [f for f in files.values() if f.is_symlink]
        blobs = read_blobs(root, [f.sha for f in link_paths])
        links = {f.path: blobs[f.sha].decode(errors="surrogateescape") for f in link_paths}
        lines = {}
        for p, f in files.items():
            if f.is_symlink or f.mode == "160000":
                continue
            try:
                lines[p] = count_lines((root / p).read_bytes())
            except OSError:
                lines[p] = 0
    tree = Tree(files, links)
    own = check_ownership(config, tree, root, stale_is_error=(source != "HEAD"))
    return Project(root, config, files, tree, own, source, lines)


def _limit(args: argparse.Namespace, config: StackConfig) -> int:
    n = len(config.layers)
    if getattr(args, "layers", None) is None:
        return n
    if not 1 <= args.layers <= n:
        raise UsageError(f"--layers {args.layers}: the stack has layers 1..{n}")
    return args.layers


# -- reporting -------------------------------------------------------------------------------
def table(project: Project, results: dict[int, PrefixResult], statuses: dict[int, str],
          count: int | None = None) -> str:
    rows = [("layer", "slug", "files", "lines", "tests", "result", "time")]
    for layer in project.config.layers[: count or len(project.config.layers)]:
        files = project.own.files_of(layer)
        lines = sum(project.lines.get(p, 0) for p in files)
        r = results.get(layer.index)
        rows.append((
            str(layer.index), layer.slug, str(len(files)), str(lines),
            r.tests_cell if r else "-",
            statuses.get(layer.index, ("ok" if r.ok else "FAIL") if r else "not run"),
            f"{r.seconds:.1f}s" if r and r.seconds else "-",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    right = {2, 3, 4, 6}
    out = []
    for j, row in enumerate(rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in
                 enumerate(zip(row, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _print_list(title: str, items: list[str]) -> None:
    for item in items:
        say(f"  {title}: {item}" if title else f"  {item}")


def _report_prefix(r: PrefixResult, layer: Layer, where: str) -> None:
    tests = f"{r.counts.get('passed', 0)} passed / {r.counts.get('collected', 0)} collected" \
        if r.counts else r.note
    if r.counts and r.carried:
        tests += f" ({len(r.carried)} carried from lower layers)"
    label = f"prefix 1..{r.k} ({layer.slug})" + (f" {where}" if where else "")
    if r.ok:
        say(f"  {label}: ok, {tests} in {r.seconds:.1f}s")
        return
    say(f"  {label}: FAILED ({r.note}; {tests}) in {r.seconds:.1f}s")
    blocked = [ln.strip() for ln in r.output.splitlines() if "blocked by stack check:" in ln]
    if blocked:
        say("  blocked imports (a lower layer needs a module of a layer above it):")
        for ln in list(dict.fromkeys(blocked))[:10]:
            say(f"    {ln}")
    say(f"  ---- last lines of the pytest output (prefix 1..{r.k}) ----")
    for ln in r.tail().splitlines():
        say(f"  | {ln}")
    say("  ----")


# -- commands --------------------------------------------------------------------------------
def cmd_check(args: argparse.Namespace) -> int:
    project = load_project(args, "index")
    config, own = project.config, project.own
    limit = _limit(args, config)
    say(f"stack check: {len(config.layers)} layer(s) in {config.display}, "
        f"{len(project.files)} tracked files, root {project.root}")
    failed = False

    say(f"[1/3] ownership: {len(own.owner)} files in layers")
    _print_list("error", own.errors)
    _print_list("warning", own.warnings)
    failed |= bool(own.errors)

    scan = scan_imports(project.tree, own.owner, working_tree_reader(project.root),
                        config.scan_exclude)
    skipped = f" ({scan.skipped} fixture/excluded files skipped)" if scan.skipped else ""
    say(f"[2/3] imports: {scan.scanned} modules scanned{skipped}")
    _print_list("error", scan.errors)
    _print_list("warning", scan.warnings)
    failed |= bool(scan.errors)
    levels = scan_levels(project.tree, list(own.owner), working_tree_reader(project.root), config.levels,
                         config.scan_exclude)
    say(f"[2/3] levels: {levels.scanned} modules, {len(config.levels)} package levels: "
        f"{levels.upward} upward import(s), {levels.circles} import circle(s)")
    _print_list("error", levels.errors)
    failed |= bool(levels.errors)

    results: dict[int, PrefixResult] = {}
    statuses: dict[int, str] = {}
    if args.no_tests:
        say("[3/3] prefixes: skipped (--no-tests)")
        statuses = {i: "skipped" for i in range(1, len(config.layers) + 1)}
    elif failed and not args.keep_going:
        say("[3/3] prefixes: skipped: fix the errors above first (or pass --keep-going)")
        statuses = {i: "skipped" for i in range(1, len(config.layers) + 1)}
    else:
        say(f"[3/3] prefixes: for k = 1..{limit}, layer k's tests and every lower-layer test "
            f"that reached for a blocked module, layers above k blocked")
        jobs = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
        if jobs > 1 and not args.exitfirst and limit > 1:
            results = _prefixes_in_parallel(project, limit, jobs, args.timeout)
            for layer in config.layers[:limit]:
                _report_prefix(results[layer.index], layer, "")
                failed |= not results[layer.index].ok
        else:
            reached: list[str] = []
            for layer in config.layers[:limit]:
                r = run_prefix(config, project.tree, own.owner, layer.index, project.root,
                               timeout=args.timeout,
                               carried=carried_tests(config, layer.index, reached))
                reached = list(r.reached)  # what is still to carry: see carried_tests
                results[layer.index] = r
                _report_prefix(r, layer, "")
                if not r.ok:
                    failed = True
                    if args.exitfirst:
                        break
        for layer in config.layers:
            if layer.index not in results:
                statuses[layer.index] = "not run"
    say()
    say(table(project, results, statuses))
    say()
    say("stack check: FAILED" if failed else "stack check: ok")
    return EXIT_FAIL if failed else EXIT_OK


def _prefixes_in_parallel(project: Project, limit: int, jobs: int,
                          timeout: float | None) -> dict[int, PrefixResult]:
    """Every prefix's own tests at once (``jobs`` at a time), then each prefix's carried tests,
    in order: which lower-layer tests prefix k carries is known only once the prefixes below it
    ran. The same runs as one prefix after the other, in less time on several cores."""
    config, own = project.config, project.own
    layers = config.layers[:limit]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {layer.index: pool.submit(run_prefix, config, project.tree, own.owner, layer.index,
                                            project.root, timeout=timeout) for layer in layers}
        first = {k: f.result() for k, f in futures.items()}
    results: dict[int, PrefixResult] = {}
    reached: list[str] = []
    for layer in layers:
        carried = carried_tests(config, layer.index, reached)
        second = run_prefix(config, project.tree, own.owner, layer.index, project.root, timeout=timeout,
                            carried=carried, own_tests=False) if carried else None
        results[layer.index] = merged(first[layer.index], second)
        reached = list(results[layer.index].reached)  # what is still to carry: see carried_tests
    return results


def _layer_files(project: Project, count: int) -> list[list[TrackedFile]]:
    return [[project.files[p] for p in project.own.files_of(layer)]
            for layer in project.config.layers[:count]]


def _warn_uncommitted(project: Project) -> None:
    out = git(project.root, "status", "--porcelain", "-z", "--untracked-files=all").stdout
    changed, untracked = [], []
    for rec in filter(None, out.decode(errors="replace").split("\0")):
        if len(rec) < 4 or rec[2] != " ":
            continue  # the source path of a rename record
        status, path = rec[:2], rec[3:]
        owned = any(path.startswith(e) if e.endswith("/") else path == e
                    for layer in project.config.layers for e in layer.paths)
        if not owned:
            continue
        (untracked if status == "??" else changed).append(path)
    if changed:
        say(f"  warning: {len(changed)} layer file(s) differ from HEAD and are exported as "
            f"committed: {', '.join(sorted(changed)[:5])}{' ...' if len(changed) > 5 else ''}")
    if untracked:
        say(f"  warning: {len(untracked)} untracked file(s) under layer paths are not exported: "
            f"{', '.join(sorted(untracked)[:5])}{' ...' if len(untracked) > 5 else ''}")


def cmd_export(args: argparse.Namespace) -> int:
    project = load_project(args, "HEAD")
    limit = _limit(args, project.config)
    say(f"stack export: {limit} of {len(project.config.layers)} layer(s) from HEAD of "
        f"{project.root} -> {args.outdir}")
    _print_list("warning", project.own.warnings)
    if project.own.errors:
        _print_list("error", project.own.errors)
        say("stack export: FAILED: the layer list does not partition HEAD's files")
        return EXIT_FAIL
    _warn_uncommitted(project)
    layer_files = _layer_files(project, limit)
    empty = [layer.name for layer, files in zip(project.config.layers, layer_files, strict=False)
             if not files]
    if empty:
        say(f"stack export: FAILED: no files at HEAD for {', '.join(empty)}")
        return EXIT_FAIL
    written = build_series(project.root, project.config, layer_files, Path(args.outdir))
    for path in written:
        say(f"  wrote {path}")
    say()
    say(table(project, {}, {i: "exported" for i in range(1, limit + 1)}, limit))
    return EXIT_OK


def cmd_verify_export(args: argparse.Namespace) -> int:
    project = load_project(args, "HEAD")
    config = project.config
    outdir = Path(args.outdir)
    if not outdir.is_dir():
        raise UsageError(f"{outdir}: no such directory")
    patches = find_patches(outdir, config)
    count = len(patches)
    test_limit = 0 if args.no_tests else min(_limit(args, config), count)
    say(f"stack verify-export: replaying {count} patch(es) from {args.outdir} into an empty "
        f"repository; testing prefixes 1..{test_limit}" if test_limit else
        f"stack verify-export: replaying {count} patch(es) from {args.outdir} (no tests)")
    _print_list("warning", project.own.warnings)
    _print_list("error", project.own.errors)
    ident = head_identity(project.root)
    env = {**ident.env(), **ISOLATED_GIT_ENV}
    failed = bool(project.own.errors)
    results: dict[int, PrefixResult] = {}
    statuses: dict[int, str] = {}
    expected_all = {p: project.files[p] for p in project.own.owner}
    tmp = Path(tempfile.mkdtemp(prefix="stack-verify-"))
    repo = tmp / "repo"
    reached: list[str] = []
    try:
        git(tmp, "init", "-q", str(repo), env=env)
        for layer, patch in zip(config.layers, patches, strict=False):
            try:
                apply_patch(repo, patch, env)
            except GitError as exc:
                say(f"  {patch.name}: FAILED to apply\n{exc}")
                statuses[layer.index] = "FAIL (apply)"
                failed = True
                break
            want = {p: f for p, f in expected_all.items()
                    if project.own.owner[p].index <= layer.index}
            problems = compare_trees(tree_files(repo, "HEAD"), want)
            if problems:
                say(f"  {patch.name}: the tree after it is not layers 1..{layer.index}:")
                _print_list("", problems[:20])
                statuses[layer.index] = "FAIL (tree)"
                failed = True
                break
            say(f"  {patch.name}: applied; tree == layers 1..{layer.index} of HEAD")
            if layer.index <= test_limit:
                r = run_prefix(config, project.tree, project.own.owner, layer.index, repo,
                               timeout=args.timeout,
                               carried=carried_tests(config, layer.index, reached))
                reached = list(r.reached)  # what is still to carry: see carried_tests
                results[layer.index] = r
                _report_prefix(r, layer, "in the replayed repo")
                if not r.ok:
                    failed = True
                    if args.exitfirst:
                        break
            else:
                statuses[layer.index] = "applied"
        else:
            final = compare_trees(tree_files(repo, "HEAD"),
                                  {p: f for p, f in expected_all.items()
                                   if project.own.owner[p].index <= count})
            if final:
                failed = True
                say("  final tree differs from the project's layer files:")
                _print_list("", final[:20])
            else:
                n = sum(1 for p in expected_all if project.own.owner[p].index <= count)
                say(f"  final tree: byte-identical to the {n} layer-owned files of HEAD, "
                    f"nothing extra")
    finally:
        if args.keep:
            say(f"  kept the replayed repository: {repo}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    say()
    say(table(project, results, statuses, count))
    say()
    say("stack verify-export: FAILED" if failed else "stack verify-export: ok")
    return EXIT_FAIL if failed else EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    project = load_project(args, "index")
    say(table(project, {}, {i: "" for i in range(1, len(project.config.layers) + 1)}))
    return EXIT_OK


def cmd_which(args: argparse.Namespace) -> int:
    project = load_project(args, "index")
    code = EXIT_OK
    for raw in args.paths:
        path = Path(raw)
        if path.is_absolute() or Path.cwd().resolve() != project.root:
            try:
                path = (Path.cwd() / path).resolve().relative_to(project.root)
            except ValueError:
                pass
        rel = path.as_posix()
        claims = [(layer, e) for layer in project.config.layers for e in layer.paths
                  if (rel.startswith(e) if e.endswith("/") else rel == e)]
        if not claims:
            say(f"{rel}: no layer")
            code = EXIT_FAIL
        for layer, entry in claims:
            say(f"{rel}: {layer.name} via {entry!r} ({project.config.layer_line(layer, entry)})")
    return code


# -- argument parsing ------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", default=argparse.SUPPRESS,
                        help="repository root (default: the git top level of the cwd)")
    common.add_argument("--config", default=argparse.SUPPRESS,
                        help="layer list (default: ROOT/stack/layers.toml)")
    tests = argparse.ArgumentParser(add_help=False)
    tests.add_argument("--layers", type=int, metavar="N",
                       help="run the tests of prefixes 1..N only")
    tests.add_argument("--no-tests", action="store_true", help="skip the per-prefix test runs")
    tests.add_argument("-x", "--exitfirst", action="store_true",
                       help="stop at the first failing prefix")
    tests.add_argument("-j", "--jobs", type=int, default=None, metavar="N",
                       help="prefix runs at once (default: the CPU count; 1: one after the other)")
    tests.add_argument("--timeout", type=float, default=3600.0, metavar="S",
                       help="time limit for one prefix's pytest run (default 3600)")

    parser = argparse.ArgumentParser(
        prog="python -m stack",
        description="Check the layered stack (stack/layers.toml) and export it as a "
                    "ghstack-style patch series.",
        parents=[common])
    parser.set_defaults(root=None, config=None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("check", parents=[common, tests],
                       help="ownership, upward imports, and every prefix green")
    p.add_argument("--keep-going", action="store_true",
                   help="run the prefix tests even when steps 1-2 found errors")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("export", parents=[common],
                       help="write OUTDIR/NNNN-<slug>.patch (git format-patch) from HEAD")
    p.add_argument("outdir")
    p.add_argument("--layers", type=int, metavar="N", help="export layers 1..N only")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("verify-export", parents=[common, tests],
                       help="git am the series into an empty repo, test each prefix, "
                            "compare the result with HEAD")
    p.add_argument("outdir")
    p.add_argument("--keep", action="store_true", help="keep the replayed repository")
    p.set_defaults(func=cmd_verify_export)

    p = sub.add_parser("list", parents=[common], help="the layers with file and line counts")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("which", parents=[common], help="the layer(s) owning paths")
    p.add_argument("paths", nargs="+")
    p.set_defaults(func=cmd_which)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"stack: malformed layer list ({len(exc.errors)} problem(s)):", file=sys.stderr)
        for err in exc.errors:
            print(f"  {err}", file=sys.stderr)
        return EXIT_USAGE
    except (UsageError, ExportError) as exc:
        print(f"stack: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_FAIL
    except GitError as exc:
        print(f"stack: git failed: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        return 130
    finally:
        sys.stdout.flush()


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
