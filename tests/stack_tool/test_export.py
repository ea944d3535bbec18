"""``export`` and ``verify-export`` on a synthetic tree."""

from __future__ import annotations

import re
from pathlib import Path

from stack_synth import BASE_LAYERS, Repo, git


def _export(repo: Repo, out: Path, *extra: str) -> list[Path]:
    r = repo.run("export", str(out), *extra)
    assert r.code == 0, r.text
    return sorted(out.glob("*.patch"))


def test_export_writes_a_ghstack_style_series(synthetic_repo: Repo, tmp_path: Path) -> None:
    out = tmp_path / "series"
    patches = _export(synthetic_repo, out)
    assert [p.name for p in patches] == ["0001-base.patch", "0002-mid.patch", "0003-top.patch"]
    first, second = patches[0].read_text(), patches[1].read_text()
    assert first.startswith("From ")
    assert "Subject: [PATCH 1/3] pkg: the base layer" in first
    assert "Subject: [PATCH 2/3] pkg: mid-level ops" in second
    body = second.split("\n\n", 1)[1].split("\n---\n", 1)[0]
    assert body == (
        "Adds pkg.mid.\n\nTest Plan:\npytest tests/l2\n\n"
        "Stack from ghstack (oldest at bottom):\n"
        "* #3 pkg: the top\n* __->__ #2 pkg: mid-level ops\n* #1 pkg: the base layer")
    # The symlink survives as a symlink; each patch adds only its layer's files.
    assert re.search(r"diff --git a/pkg/alias b/pkg/alias\nnew file mode 120000\n", first)
    assert "+++ b/pkg/mid/ops.py" in second and "pkg/core.py" not in second
    assert "+++ b/pkg/mid" not in first


def test_export_is_reproducible_and_replaces_old_patches(synthetic_repo: Repo,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "series"
    out.mkdir()
    (out / "0009-stale.patch").write_text("old")
    (out / "notes.txt").write_text("keep me")
    a = [p.read_bytes() for p in _export(synthetic_repo, out)]
    assert not (out / "0009-stale.patch").exists() and (out / "notes.txt").exists()
    b = [p.read_bytes() for p in _export(synthetic_repo, out)]
    assert a == b
    assert [p.name for p in _export(synthetic_repo, tmp_path / "two", "--layers", "2")] == [
        "0001-base.patch", "0002-mid.patch"]


def test_export_reads_head_not_the_working_tree(synthetic_repo: Repo, tmp_path: Path) -> None:
    synthetic_repo.write("pkg/core.py", "VALUE = 'uncommitted'\n")
    synthetic_repo.write("pkg/mid/new.py", "X = 1\n")
    # An uncommitted fourth layer in the working tree's layer list is not exported either.
    layers = [dict(x) for x in BASE_LAYERS]
    layers.append(dict(slug="wip", title="wip", summary="", test_plan="", paths=["wip/"],
                       tests=[]))
    synthetic_repo.layers(layers)
    r = synthetic_repo.run("export", str(tmp_path / "s"))
    assert r.code == 0
    assert ("2 layer file(s) differ from HEAD and are exported as committed: pkg/core.py, "
            "stack/layers.toml") in r.out
    assert "1 untracked file(s) under layer paths are not exported: pkg/mid/new.py" in r.out
    assert "uncommitted" not in (tmp_path / "s" / "0001-base.patch").read_text()
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [
        "0001-base.patch", "0002-mid.patch", "0003-top.patch"]


def test_export_refuses_orphans(synthetic_repo: Repo, tmp_path: Path) -> None:
    synthetic_repo.write("pkg/stray.py", "")
    synthetic_repo.commit()
    r = synthetic_repo.run("export", str(tmp_path / "s"))
    assert r.code == 1
    assert "pkg/stray.py: orphan" in r.out
    assert "does not partition HEAD's files" in r.out


def test_round_trip_verify_export(synthetic_repo: Repo, tmp_path: Path) -> None:
    out = tmp_path / "series"
    _export(synthetic_repo, out)
    r = synthetic_repo.run("verify-export", str(out))
    assert r.code == 0, r.text
    assert "0001-base.patch: applied; tree == layers 1..1 of HEAD" in r.out
    assert "prefix 1..1 (base) in the replayed repo: ok, 2 passed / 2 collected" in r.out
    # Prefix 1..3 runs layer 3's own test: no lower-layer test reached for a blocked module.
    assert "prefix 1..3 (top) in the replayed repo: ok, 1 passed / 1 collected" in r.out
    assert "carried" not in r.out
    assert "final tree: byte-identical to the 15 layer-owned files of HEAD, nothing extra" in r.out
    assert "stack verify-export: ok" in r.out


def test_verify_export_catches_a_changed_project_and_a_bad_patch(synthetic_repo: Repo,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "series"
    _export(synthetic_repo, out)
    synthetic_repo.write("pkg/top.py", "from pkg.mid.ops import DOUBLE\n\nTRIPLE = 3\n")
    synthetic_repo.commit()
    r = synthetic_repo.run("verify-export", str(out), "--no-tests")
    assert r.code == 1
    assert "0003-top.patch: the tree after it is not layers 1..3" in r.out
    assert "pkg/top.py: content differs from HEAD" in r.out

    _export(synthetic_repo, out)
    patch = out / "0002-mid.patch"
    patch.write_text(patch.read_text().replace("+DOUBLE = VALUE * 2", "+DOUBLE = VALUE * 3"))
    r = synthetic_repo.run("verify-export", str(out), "--no-tests")
    assert r.code == 1
    assert "pkg/mid/ops.py: content differs from HEAD" in r.out

    (out / "0002-mid.patch").rename(out / "0002-middle.patch")
    r = synthetic_repo.run("verify-export", str(out), "--no-tests")
    assert r.code == 1
    assert "expected 0002-mid.patch for layer 2 (mid)" in r.err


def test_verify_export_tests_the_replayed_tree_not_the_project(synthetic_repo: Repo,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "series"
    _export(synthetic_repo, out)
    # Break the project's working tree: the replayed repository must not see it.
    synthetic_repo.write("pkg/core.py", "raise RuntimeError('working tree is not under test')\n")
    r = synthetic_repo.run("verify-export", str(out), "--layers", "1", "--keep")
    assert r.code == 0, r.text
    kept = Path(r.out.split("kept the replayed repository: ", 1)[1].split()[0])
    assert (kept / "pkg" / "alias").is_symlink()
    assert git(kept, "log", "--format=%s").splitlines() == [
        "pkg: the top", "pkg: mid-level ops", "pkg: the base layer"]
