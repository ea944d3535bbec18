"""The checkpoint fault table: every fault of the integrity tests once, on 2 forked gloo ranks.

    python bench/checkpoint_faults.py      # about a minute on 2 cores; prints a markdown table

Each row: the fault (an OSError injected into DCP's storage writer, a signal, a real full or
read-only tmpfs where ``mount`` is allowed, a damaged file), each rank's exit status, the
one line it printed, what stayed in the checkpoint folder, and what the next start loaded
(for a damaged checkpoint: without the flag, and with the ``--checkpoint.load_step`` the
message names). It reuses the test helpers (``tests/layer3_runtime/integrity_helpers.py``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "layer3_runtime")]

from integrity_helpers import cfg, run_jobs, run_starts  # noqa: E402
from test_checkpoint_integrity import _copy, _flip, _truncate, _unrecord  # noqa: E402

#: name, async mode, fault (integrity_helpers), description
SAVE_FAULTS: list[tuple[str, str, tuple[Any, ...], str]] = [
    ("enospc-sync", "disabled", ("oserror", 1, 4, 28), "ENOSPC in rank 1's write of step 4 (blocking save)"),
    ("eio-sync", "disabled", ("oserror", 0, 4, 5), "EIO in rank 0's write of step 4 (blocking)"),
    ("eacces-sync", "disabled", ("oserror", 1, 4, 13), "EACCES in rank 1's write of step 4 (blocking)"),
    ("enospc-async", "async", ("oserror", 1, 4, 28), "ENOSPC in rank 1's write of step 4 (background save)"),
    ("eio-async", "async", ("oserror", 0, 4, 5), "EIO in rank 0's write of step 4 (background)"),
    ("sigterm-save", "disabled", ("signal", 1, 2, signal.SIGTERM), "SIGTERM to rank 1 while it writes step 2 (blocking)"),
    ("sigint-async", "async", ("signal", 0, 2, signal.SIGINT), "SIGINT to rank 0 while step 2 is written in the background"),
    ("sigterm-between", "disabled", ("signal_in_step", 0, 3, signal.SIGTERM), "SIGTERM to rank 0 in step 3 (between saves)"),
]

#: name, description, damage, the step the message should name
DAMAGE: list[tuple[str, str, Callable[[Path], Any], int]] = [
    ("cut", "step-4's `__1_0.distcp` cut to half its size", lambda c: _truncate(c / "step-4" / "__1_0.distcp"), 2),
    ("flip", "one byte of tensor data flipped in step-4's `__0_0.distcp`",
     lambda c: _flip(c / "step-4" / "__0_0.distcp"), 2),
    ("meta", "one byte flipped in step-4's `.metadata`", lambda c: _flip(c / "step-4" / ".metadata"), 2),
    ("gone", "step-4's `__1_0.distcp` deleted", lambda c: (c / "step-4" / "__1_0.distcp").unlink(), 2),
    ("legacy_cut", "a checkpoint without checksums (older save), `__1_0.distcp` cut",
     lambda c: (_unrecord(c / "step-4"), _truncate(c / "step-4" / "__1_0.distcp")), 2),
    ("nomarker", "a `step-6` copied without its marker",
     lambda c: (shutil.copytree(c / "step-4", c / "step-6"), (c / "step-6" / ".complete").unlink()), 4),
]


def _mount(path: Path, size: str) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _save_rows(tmp: Path) -> list[tuple[str, ...]]:
    cases, desc = [], {}
    for name, mode, fault, what in SAVE_FAULTS:
        root = str(tmp / name)
        cases.append((name, cfg(root, async_mode=mode), [fault], cfg(root)))
        desc[name] = what
    full, ro = tmp / "full", tmp / "ro"
    mounted = [m for m, size in ((full, "4m"), (ro, "16m")) if _mount(m, size)]
    if full in mounted:
        cases.append(("full", cfg(str(full)), [], cfg(str(full))))
        desc["full"] = "a real full disk (4 MiB tmpfs) during the step-4 save"
    if ro in mounted:
        cases.append(("ro", cfg(str(ro)), [("remount_ro", 0, 3, str(ro))], cfg(str(ro))))
        desc["ro"] = "the folder's file system remounted read-only in step 3"
    rows = []
    try:
        per_rank = run_jobs(cases)
        for name, *_ in cases:
            r, nxt = per_rank[0][name], per_rank[0][name]["next"]
            loaded = f"step-{nxt['loaded']['step']}" if nxt.get("loaded") else nxt.get("error", "nothing")
            left = ", ".join(sorted(os.listdir(tmp / name / "checkpoint")))
            rows.append((desc[name], f"{r['status']} / {per_rank[1][name]['status']}",
                         " ".join(r["stderr"]).replace(str(tmp / name), "…"), left, loaded))
    finally:
        for m in mounted:
            subprocess.run(["umount", str(m)], capture_output=True)
    return rows


def _damage_rows(tmp: Path) -> list[tuple[str, ...]]:
    base = tmp / "base"
    run_jobs([("run", cfg(str(base), steps=4, keep_latest_k=0, last_save_model_only=False), [], None)])
    cases = []
    for name, _, damage, _ in DAMAGE:
        damage(_copy(base, tmp / name))
        cases.append((name, "job", cfg(str(tmp / name), steps=4), []))
    first = run_starts(cases)
    again = run_starts([(n + "-again", "job", c, f) for n, _, c, f in cases])
    told = run_starts([(name + "-told", "start", cfg(str(tmp / name), steps=4, load_step=flag), [])
                       for name, _, _, flag in DAMAGE])
    rows = []
    for name, what, _, flag in DAMAGE:
        r = first[0][name]
        same = all(a[name + "-again"]["stderr"] == f[name]["stderr"] for a, f in zip(again, first, strict=True))
        got = sorted({str(t[name + "-told"].get("loaded", {}).get("step")) for t in told})
        rows.append((what, f"{r['status']} / {first[1][name]['status']}",
                     " ".join(r["stderr"]).replace(str(tmp / name), "…"), "unchanged",
                     f"without the flag: {'the same error' if same else 'ANOTHER OUTCOME'}; with "
                     f"--checkpoint.load_step {flag}: step-{'/'.join(got)}"))
    return rows


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="ckfaults-"))
    try:
        rows = _save_rows(tmp) + _damage_rows(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("| fault | exit status (rank 0 / 1) | message (on every rank; paths shortened) | left in `checkpoint/` "
          "| what the next start loaded |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(x.replace("|", "\\|") for x in row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
