"""Bootstrap run as ``python -c <this source> SPEC.json`` to test one prefix of the stack.

It is passed as source text (no sitecustomize, nothing installed) and does, in order:

1. installs a ``sys.meta_path`` finder (first in line) that raises ModuleNotFoundError
   for every module of a layer above the prefix: by dotted name, and by file for
   modules that pytest imports by a bare name (test helpers next to test files); each refusal
   appends the asking test's node id (or the test file being collected, or ``<session>``) to
   SPEC["reached"], so later prefixes run that test again (stack/runner.py);
2. drops setuptools' editable-install finders and puts the tree under test first on
   ``sys.path``, then checks that each top-level package resolves inside that tree;
3. runs ``pytest.main`` with a small plugin counting collected/passed tests;
4. checks every imported module of those packages came from the tree, writes the
   counts to SPEC["result"] and exits with pytest's exit code (3 on a leak).
"""

if __name__ == "__main__":
    import importlib.machinery
    import importlib.util
    import json
    import os
    import sys

    with open(sys.argv[1], encoding="utf-8") as fh:
        SPEC = json.load(fh)
    ROOT = os.path.realpath(SPEC["root"])
    BLOCKED = {name: tuple(v) for name, v in SPEC["blocked_names"].items()}
    BLOCKED_FILES = {os.path.realpath(p): tuple(v) for p, v in SPEC["blocked_files"].items()}
    # The last name component that can import each blocked file (a package: its directory).
    BLOCKED_STEMS = {os.path.basename(os.path.dirname(p)) if p.endswith("__init__.py")
                     else os.path.basename(p)[:-3] for p in BLOCKED_FILES}

    def _inside(path):
        real = os.path.realpath(path)
        return real == ROOT or real.startswith(ROOT + os.sep)

    REACHED = SPEC.get("reached")
    os.environ.pop("PYTEST_CURRENT_TEST", None)  # an outer pytest's (this tool's own tests), not ours
    COLLECTING = []  # the test file being collected, if any (set by StackCounter)
    ARMED = []  # non-empty once pytest runs: the tool's own probes below are not the tests' reach

    def _log_reach():
        if not REACHED or not ARMED:
            return
        current = os.environ.get("PYTEST_CURRENT_TEST", "")
        who = current.rsplit(" (", 1)[0] if current else (COLLECTING[-1] if COLLECTING else "<session>")
        # One short append per refusal; forked ranks of a test inherit its PYTEST_CURRENT_TEST.
        with open(REACHED, "a", encoding="utf-8") as fh:
            fh.write(who + "\n")

    def _blocked(name, how):
        index, slug = how
        _log_reach()
        return ModuleNotFoundError(
            f"blocked by stack check: {name} belongs to layer {index} ({slug}) above the prefix",
            name=name)

    class StackPrefixBlocker:
        """Makes the modules of the layers above the prefix unimportable."""

        @classmethod
        def find_spec(cls, fullname, path=None, target=None):
            parts = fullname.split(".")
            for i in range(1, len(parts) + 1):
                how = BLOCKED.get(".".join(parts[:i]))
                if how is not None:
                    raise _blocked(fullname, how)
            if parts[-1] in BLOCKED_STEMS:
                spec = importlib.machinery.PathFinder.find_spec(fullname, path)
                origin = getattr(spec, "origin", None)
                if origin and os.path.realpath(origin) in BLOCKED_FILES:
                    raise _blocked(f"{fullname} ({os.path.relpath(origin, ROOT)})",
                                   BLOCKED_FILES[os.path.realpath(origin)])
            return None

        @classmethod
        def invalidate_caches(cls):
            pass

    sys.meta_path.insert(0, StackPrefixBlocker)
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not getattr(f, "__module__", "").startswith("__editable__")]
    while ROOT in sys.path:
        sys.path.remove(ROOT)
    sys.path.insert(0, ROOT)
    importlib.invalidate_caches()

    for pkg in SPEC["packages"]:
        try:
            spec = importlib.util.find_spec(pkg)
        except ModuleNotFoundError:  # the package itself is above the prefix
            continue
        where = getattr(spec, "origin", None) if spec else None
        if spec is None or not where or not _inside(where):
            print(f"stack bootstrap: FATAL: package {pkg!r} resolves to {where!r}, "
                  f"not inside the tree under test {ROOT}", file=sys.stderr, flush=True)
            sys.exit(3)

    import pytest

    class StackCounter:
        def __init__(self):
            self.counts = dict(collected=0, passed=0, failed=0, skipped=0, errors=0)

        def pytest_collection_finish(self, session):
            self.counts["collected"] = len(session.items)

        def pytest_collectstart(self, collector):
            if isinstance(collector, pytest.Module):
                COLLECTING.append(collector.nodeid)

        def pytest_collectreport(self, report):
            if report.failed:
                self.counts["errors"] += 1
            if COLLECTING and report.nodeid == COLLECTING[-1]:
                COLLECTING.pop()

        def pytest_runtest_logreport(self, report):
            c = self.counts
            if report.when == "call":
                key = "passed" if report.passed else "failed" if report.failed else "skipped"
                c[key] += 1
            elif report.failed:
                c["errors"] += 1
            elif report.skipped and report.when == "setup":
                c["skipped"] += 1

    counter = StackCounter()
    ARMED.append(True)
    code = int(pytest.main(SPEC["pytest_args"], plugins=[counter]))

    leaks = []
    for name, mod in list(sys.modules.items()):
        if name.split(".", 1)[0] in SPEC["packages"]:
            file = getattr(mod, "__file__", None)
            if file and not _inside(file):
                leaks.append(f"{name} -> {file}")
    if leaks:
        print(f"stack bootstrap: FATAL: modules imported from outside the tree under test "
              f"{ROOT}:\n  " + "\n  ".join(sorted(leaks)), file=sys.stderr, flush=True)
        code = 3
    counter.counts["exit"] = code
    with open(SPEC["result"], "w", encoding="utf-8") as fh:
        json.dump(counter.counts, fh)
    sys.stdout.flush()
    sys.exit(code)
