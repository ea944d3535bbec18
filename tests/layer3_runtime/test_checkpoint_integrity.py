"""Layer 3: checkpoints that cannot load wrong -- checksums, one-line load errors, save faults, signals.

Every run is the trainer's exit path (``train.run_job``) or its start (the Trainer built)
on 2 forked gloo ranks (FSDP 2, the tiny model, fp32). The saved checkpoint of the module
fixture (steps 2 async and 4 sync) is copied and damaged per case; faults go into DCP's
storage writer (``integrity_helpers``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import zlib
from pathlib import Path
from typing import Any

import pytest
from integrity_helpers import cfg, run_jobs, run_starts

from torchtitan_spmd.checkpoint.integrity import file_digest
from torchtitan_spmd.checkpoint.manager import COMPLETE_MARKER, find_checkpoints

pytestmark = [pytest.mark.multiproc, pytest.mark.backend("default")]


def _same_on_every_rank(per_rank: list[dict[str, Any]], case: str, key: str) -> Any:
    values = [r[case][key] for r in per_rank]
    assert all(v == values[0] for v in values), (case, key, values)
    return values[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 4-step run saving step 2 (async) and step 4 (the last, sync; full), logging every fsync."""
    root = tmp_path_factory.mktemp("integrity")
    log = root / "fsync.log"
    config = cfg(str(root), steps=4, async_mode="async", keep_latest_k=0, last_save_model_only=False)
    faults = [("log_fsync", rank, str(log)) for rank in (0, 1)]
    per_rank = run_jobs([("run", config, faults, None)])
    assert _same_on_every_rank(per_rank, "run", "status") == 0, per_rank
    return root, log


# ------------------------------------------------------------------ what a save records
def test_the_marker_records_each_files_size_and_hash_by_the_rank_that_wrote_it(saved) -> None:
    root, _ = saved
    for step in (2, 4):
        folder = root / "checkpoint" / f"step-{step}"
        marker = json.loads((folder / COMPLETE_MARKER).read_text())
        assert marker["hash"] == "crc32"
        files = marker["files"]
        assert sorted(files) == sorted(set(os.listdir(folder)) - {COMPLETE_MARKER})
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(files)
        for name, record in files.items():
            data = (folder / name).read_bytes()
            assert record["size"] == len(data), name
            assert record["crc32"] == f"{zlib.crc32(data):08x}", name  # recomputed here, with zlib
            writer = 0 if name == ".metadata" else int(re.match(r"__(\d+)_", name).group(1))
            assert record["rank"] == writer, name


def test_every_file_is_synced_by_its_writer_before_the_marker_is_written(saved) -> None:
    root, log = saved
    lines = [line.split(" ", 1) for line in log.read_text().splitlines()]
    for step in (2, 4):
        partial = str(root / "checkpoint" / f"step-{step}.partial")
        marker_at = [i for i, (_, path) in enumerate(lines) if path == f"{partial}/{COMPLETE_MARKER}.tmp"]
        assert len(marker_at) == 1, (step, lines)
        files = json.loads((root / "checkpoint" / f"step-{step}" / COMPLETE_MARKER).read_text())["files"]
        for name, record in files.items():
            synced = os.path.join(partial, ".metadata.tmp" if name == ".metadata" else name)
            at = [i for i, (rank, path) in enumerate(lines) if path == synced and int(rank) == record["rank"]]
            assert at and at[0] < marker_at[0], (step, name, lines)


def test_file_digest_is_zlib_crc32_or_hashlib_blake2b(tmp_path: Path) -> None:
    data = os.urandom((9 << 20) + 123)  # more than one 8 MiB chunk
    (tmp_path / "f").write_bytes(data)
    assert file_digest(str(tmp_path / "f")) == (len(data), f"{zlib.crc32(data):08x}")
    assert file_digest(str(tmp_path / "f"), "blake2b") == (len(data), hashlib.blake2b(data, digest_size=16).hexdigest())
    with pytest.raises(ValueError, match="unknown checkpoint hash 'md5'; known: crc32, blake2b"):
        file_digest(str(tmp_path / "f"), "md5")


def test_verification_reads_the_hash_the_record_names_and_only_this_ranks_share(tmp_path: Path) -> None:
    from torchtitan_spmd.checkpoint.integrity import local_problems

    files = {}
    for name, rank in ((".metadata", 0), ("__0_0.distcp", 0), ("__1_0.distcp", 1), ("__2_0.distcp", 2)):
        (tmp_path / name).write_bytes(os.urandom(1000 + rank))
        size, digest = file_digest(str(tmp_path / name), "blake2b")
        files[name] = {"size": size, "blake2b": digest, "rank": rank}
    record = {"hash": "blake2b", "files": files}
    assert local_problems(str(tmp_path), record, 0, 2) == []
    _flip(tmp_path / "__2_0.distcp")  # written by rank 2; checked by rank 0 of a 2-rank start
    assert local_problems(str(tmp_path), record, 1, 2) == []
    assert [name for name, _ in local_problems(str(tmp_path), record, 0, 2)] == ["__2_0.distcp"]
    assert local_problems(str(tmp_path), {"step": 4}, 0, 2) is None  # no checksums recorded
    assert local_problems(str(tmp_path), {"hash": "md5", "files": files}, 0, 2) == [
        (COMPLETE_MARKER, "names the hash 'md5'; known: crc32, blake2b")]


# ------------------------------------------------------------------ damaged checkpoints
def _copy(saved_root: Path, dst: Path) -> Path:
    for step in (2, 4):
        shutil.copytree(saved_root / "checkpoint" / f"step-{step}", dst / "checkpoint" / f"step-{step}")
    return dst / "checkpoint"


def _flip(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x5A
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _unrecord(folder: Path) -> None:
    """Make ``folder`` a checkpoint from before checksums: its marker without them."""
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    del marker["files"], marker["hash"]
    (folder / COMPLETE_MARKER).write_text(json.dumps(marker))


def test_a_damaged_checkpoint_stops_the_start_in_one_line_naming_the_file_and_the_newest_good_one(
        saved, tmp_path: Path) -> None:
    saved_root, _ = saved
    cases, folders = [], {}

    def case(name: str, mode: str, damage: Any, faults: list[Any] | None = None, **checkpoint: Any) -> None:
        folders[name] = ck = _copy(saved_root, tmp_path / name)
        damage(ck)
        cases.append((name, mode, cfg(str(tmp_path / name), steps=4, **checkpoint), faults or []))

    case("truncated", "job", lambda ck: _truncate(ck / "step-4" / "__1_0.distcp"))
    case("flipped", "job", lambda ck: _flip(ck / "step-4" / "__0_0.distcp"))  # tensor bytes, same size
    case("metadata", "job", lambda ck: _flip(ck / "step-4" / ".metadata"))
    case("missing", "job", lambda ck: (ck / "step-4" / "__1_0.distcp").unlink())
    case("both", "job", lambda ck: (_flip(ck / "step-4" / "__0_0.distcp"), _flip(ck / "step-2" / "__1_0.distcp")))
    case("told", "start", lambda ck: _flip(ck / "step-4" / "__0_0.distcp"), load_step=2,
         faults=[("log_digest", r, str(tmp_path / "digests.log")) for r in (0, 1)])
    case("legacy", "start", lambda ck: _unrecord(ck / "step-4"))
    case("legacy_truncated", "job", lambda ck: (_unrecord(ck / "step-4"), _truncate(ck / "step-4" / "__1_0.distcp")))
    case("partial", "start", lambda ck: shutil.copytree(ck / "step-4", ck / "step-6.partial"))
    case("no_marker", "job", lambda ck: (shutil.copytree(ck / "step-4", ck / "step-6"),
                                         (ck / "step-6" / COMPLETE_MARKER).unlink()))
    case("bad_marker", "job", lambda ck: (shutil.copytree(ck / "step-4", ck / "step-6"),
                                          (ck / "step-6" / COMPLETE_MARKER).write_text('{"step": 6, "fil')))
    per_rank = run_starts(cases)

    def error_line(name: str) -> str:
        assert _same_on_every_rank(per_rank, name, "status") == 2, per_rank[0][name]
        lines = per_rank[0][name]["stderr"]
        assert len(lines) == 1, lines
        # every rank's line, or none: an error every rank agrees on (rank 0's decision) is printed once
        assert all(r[name]["stderr"] in ([], lines) for r in per_rank), [r[name]["stderr"] for r in per_rank]
        assert not any("checkpoint: loaded" in line for r in per_rank for line in r[name]["log"])
        return lines[0]

    good = "the newest checkpoint that verifies is step-2: load it with --checkpoint.load_step 2"
    # first the flip DCP cannot see (unverified, it loads wrong weights without a word)
    line = error_line("flipped")
    assert re.fullmatch(r"error: checkpoint step-4: __0_0\.distcp has crc32 [0-9a-f]{8}, its record [0-9a-f]{8} "
                        r"\(same size: bytes changed\); " + re.escape(good) + r" \(.*/flipped/checkpoint/step-4/"
                        r"__0_0\.distcp\)", line), line
    line = error_line("truncated")
    size = (saved_root / "checkpoint" / "step-4" / "__1_0.distcp").stat().st_size
    assert line == (f"error: checkpoint step-4: __1_0.distcp has {size // 2} bytes, its record {size} (cut short or "
                    f"overwritten?); {good} ({folders['truncated'] / 'step-4' / '__1_0.distcp'})")
    line = error_line("metadata")
    assert line.startswith("error: checkpoint step-4: .metadata has crc32 ") and line.endswith(
        f"{good} ({folders['metadata'] / 'step-4' / '.metadata'})"), line
    assert error_line("missing").startswith(f"error: checkpoint step-4: __1_0.distcp is missing; {good} (")
    assert error_line("both").startswith("error: checkpoint step-4: __0_0.distcp has crc32 ")
    assert "; no other checkpoint verifies (" in error_line("both")
    # the flag the message names loads the older one; each rank hashed only its own files
    told = [r["told"] for r in per_rank]
    assert all(t.get("loaded", {}).get("step") == 2 and t["start_step"] == 2 for t in told), told
    hashed: dict[int, set[str]] = {0: set(), 1: set()}
    for entry in (tmp_path / "digests.log").read_text().splitlines():
        rank, path = entry.split(" ", 1)
        hashed[int(rank)].add(os.path.basename(path))
    assert hashed == {0: {".metadata", "__0_0.distcp"}, 1: {"__1_0.distcp"}}
    # a checkpoint from before checksums loads, with one warning
    for r in per_rank:
        assert r["legacy"].get("loaded", {}).get("step") == 4, r["legacy"]
    warnings = [m for m in per_rank[0]["legacy"]["log"] if "records no checksums" in m]
    assert warnings == [f"checkpoint step-4: its {COMPLETE_MARKER} records no checksums (saved before they were "
                        f"recorded), so it loads unverified ({folders['legacy'] / 'step-4'})"]
    # ... and DCP's own error on it is one line naming the file
    line = error_line("legacy_truncated")
    # (the restricted reader checks each item against its opened file: the cut item lies past its end)
    assert line.startswith("error: checkpoint step-4: the item ") and " lies at bytes " in line and line.endswith(
        f"; {good} ({folders['legacy_truncated'] / 'step-4' / '__1_0.distcp'})"), line
    # a complete-looking .partial (marker written, never renamed) is not a checkpoint
    for r in per_rank:
        assert r["partial"].get("loaded", {}).get("step") == 4, r["partial"]
    assert any("ignoring" in m and "step-6.partial" in m for m in per_rank[0]["partial"]["log"])
    # but a published step-N that is not complete (damaged, or copied in part) is no reason to load an older one
    newest_good = "the newest checkpoint that verifies is step-4: load it with --checkpoint.load_step 4"
    assert error_line("no_marker") == (f"error: checkpoint step-6: no {COMPLETE_MARKER} marker: not a save that "
                                       f"finished here (a folder copied in part?); {newest_good} "
                                       f"({folders['no_marker'] / 'step-6' / COMPLETE_MARKER})")
    line = error_line("bad_marker")  # (the JSON parser's own words in the parentheses)
    assert line.startswith(f"error: checkpoint step-6: its {COMPLETE_MARKER} marker is not valid JSON (") and \
        line.endswith(f"); {newest_good} ({folders['bad_marker'] / 'step-6' / COMPLETE_MARKER})"), line


# ------------------------------------------------------------------ faults during a save
SAVE_FAULTS = [  # name, async mode, rank, errno
    ("sync-ENOSPC", "disabled", 1, 28),
    ("sync-EIO", "disabled", 0, 5),
    ("sync-EACCES", "disabled", 1, 13),
    ("async-ENOSPC", "async", 1, 28),
    ("async-EIO", "async", 0, 5),
]


def _check_failed_save(per_rank: list[dict[str, Any]], name: str, folder: Path, rank: int, code: str) -> None:
    assert _same_on_every_rank(per_rank, name, "status") == 2, per_rank[0][name]
    lines = _same_on_every_rank(per_rank, name, "stderr")
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: checkpoint: saving step-4 into {folder} failed on rank {rank}: "
                               f"[Errno {getattr(__import__('errno'), code)} {code}] "), lines
    assert lines[0].endswith("; step-4.partial removed; the newest complete checkpoint, step-2, is untouched"), lines
    assert sorted(os.listdir(folder)) == ["step-2"]
    for r in per_rank:  # the next start loads it, verified (no warning)
        assert r[name]["next"].get("loaded", {}).get("step") == 2, r[name]["next"]
        assert not any("unverified" in m for m in r[name]["next"]["log"])


def test_a_failed_save_stops_in_one_line_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """An OSError in DCP's write of step 4 on one rank (sync, and async: seen at the next save)."""
    import errno

    cases = []
    for name, mode, rank, code in SAVE_FAULTS:
        root = str(tmp_path / name)
        cases.append((name, cfg(root, async_mode=mode), [("oserror", rank, 4, code)], cfg(root)))
    per_rank = run_jobs(cases)
    for name, _, rank, code in SAVE_FAULTS:
        _check_failed_save(per_rank, name, tmp_path / name / "checkpoint", rank, errno.errorcode[code])


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_real_full_disk_and_a_folder_made_read_only(tmp_path: Path) -> None:
    """Tiny tmpfs mounts: one fills up during the step-4 save (a checkpoint is 2.3 MB), one is
    remounted read-only during step 3. Needs mount rights (root); skipped elsewhere."""
    full, ro = tmp_path / "full", tmp_path / "ro"
    if not _mount_tmpfs(full, "4m"):
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        assert _mount_tmpfs(ro, "16m")
        per_rank = run_jobs([
            ("full", cfg(str(full)), [], cfg(str(full))),
            ("ro", cfg(str(ro)), [("remount_ro", 0, 3, str(ro))], cfg(str(ro))),
        ])
        lines = per_rank[0]["full"]["stderr"]
        assert _same_on_every_rank(per_rank, "full", "status") == 2
        assert len(lines) == 1 and "[Errno 28 ENOSPC] No space left on device" in lines[0], lines
        assert lines[0].endswith("; step-4.partial removed; the newest complete checkpoint, step-2, is untouched")
        assert sorted(os.listdir(full / "checkpoint")) == ["step-2"]
        lines = per_rank[0]["ro"]["stderr"]
        assert _same_on_every_rank(per_rank, "ro", "status") == 2
        assert len(lines) == 1 and "[Errno 30 EROFS] Read-only file system" in lines[0], lines
        assert f"into {ro / 'checkpoint'} failed" in lines[0]
        assert sorted(os.listdir(ro / "checkpoint")) == ["step-2"]
        for r in per_rank:
            assert r["full"]["next"].get("loaded", {}).get("step") == 2, r["full"]["next"]
            assert r["ro"]["next"].get("loaded", {}).get("step") == 2, r["ro"]["next"]
    finally:
        for mount in (full, ro):
            subprocess.run(["umount", str(mount)], capture_output=True)


# ------------------------------------------------------------------ signals
SIGNAL_CASES = [  # name, async mode, fault, exit status, the steps it may stop after
    ("sigterm-in-sync-save", "disabled", ("signal", 1, 2, signal.SIGTERM), 143, (2,)),
    # the background write of step 2 runs beside steps 3 and 4 (the save of step 4 waits for
    # it): the main thread sees the signal at the end of one of steps 2-4
    ("sigint-in-async-save", "async", ("signal", 0, 2, signal.SIGINT), 130, (2, 3, 4)),
    ("sigterm-between-saves", "disabled", ("signal_in_step", 0, 3, signal.SIGTERM), 143, (3,)),
]


def test_a_signal_lets_the_save_in_progress_finish_then_stops_every_rank(tmp_path: Path) -> None:
    cases = [(name, cfg(str(tmp_path / name), async_mode=mode), [fault], cfg(str(tmp_path / name)))
             for name, mode, fault, _, _ in SIGNAL_CASES]
    per_rank = run_jobs(cases)
    for name, _, fault, status, after in SIGNAL_CASES:
        sig = signal.Signals(fault[3]).name
        assert _same_on_every_rank(per_rank, name, "status") == status, per_rank[0][name]
        lines = _same_on_every_rank(per_rank, name, "stderr")
        stopped = re.fullmatch(rf"stopped: {sig}: stopped after step (\d+); no save is in progress, and the newest "
                               r"complete checkpoint, which the next start loads, is step-(\d+)", lines[0])
        assert len(lines) == 1 and stopped, lines
        step, newest = int(stopped.group(1)), int(stopped.group(2))
        assert step in after and newest == step - step % 2, lines  # a save every 2 steps, the last one published
        assert any(m.startswith(f"{sig} received: stopping after this step")
                   for m in per_rank[fault[1]][name]["log"]), per_rank[fault[1]][name]["log"]
        folder = tmp_path / name / "checkpoint"
        assert sorted(os.listdir(folder)) == [f"step-{s}" for s in range(2, newest + 1, 2)]  # no partial folder
        assert sorted(find_checkpoints(str(folder))[0]) == list(range(2, newest + 1, 2))
        for r in per_rank:
            assert r[name]["next"].get("loaded", {}).get("step") == newest, r[name]["next"]
