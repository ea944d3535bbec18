"""Layer 3: a checkpoint folder someone else wrote, every file of it theirs (issue 44).

Each finding of the issue is a hostile folder built here and loaded through the trainer
(``run_job``: the one-process tiny job, the default backend) in a real process
(``hostile_runner.py``, under a ``timeout``): no file outside the folder is read (a sentinel
value, the step ``1234567`` or the size ``31337``, must not appear), no process state changes
(pathlib's classes, ``torch.serialization._get_layout``'s cache, DCP's classes compare equal
before and after, and a legitimate save after the refused loads lands where it should and
nothing else), no crash, no hang (each case has an alarm; the whole process a ``timeout``),
and one ``error:`` line naming the file, exit 2.

All cases run in one process (one start-up with torch), each written to its own result file
as it ends, so each test below asserts one finding; a case that kills the process (a crash)
is named in the failure of every test whose result is then missing.
``docs/checkpoint-trust.md``'s table of attacks lists these tests.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from torchtitan_spmd.checkpoint.manager import COMPLETE_MARKER
from torchtitan_spmd.checkpoint.safe_metadata import read_metadata_bytes

pytestmark = [pytest.mark.backend("default")]

RUNNER = Path(__file__).with_name("hostile_runner.py")
SENTINEL = "1234567"  # the step a file outside the folder holds
VICTIM_SIZE = 31337  # the size of another file outside the folder
STEP = "train_state.step"


def _hf_supported() -> bool:
    try:
        from torch.distributed.checkpoint.protocol import CheckpointableTensor  # noqa: F401
    except ImportError:
        return False
    return True


def _run(cases: list[dict[str, Any]], root: Path, timeout: int) -> tuple[dict[str, dict[str, Any]], str]:
    """Run ``cases`` in one ``hostile_runner.py`` process (cwd: an empty folder); each case's
    result, and what became of the process (``""``: it exited 0)."""
    out, cwd = root / "results", root / "cwd"
    out.mkdir(parents=True)
    cwd.mkdir()
    spec = root / "spec.json"
    spec.write_text(json.dumps({"cases": cases}))
    # (PYTHONWARNINGS: a library's warnings on stderr are not the trainer's lines)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, str(RUNNER), str(spec), str(out)], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
        fate = "" if done.returncode == 0 else f"exited {done.returncode} ({done.stderr[-2000:]})"
    except subprocess.TimeoutExpired:
        fate = f"was still running after {timeout} s (timeout)"
    started = (out / "progress").read_text().split() if (out / "progress").exists() else []
    if fate and started:
        fate += f", in case {started[-1]!r}"
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    return results, fate


# ------------------------------------------------------------------ building hostile folders
def _metadata(folder: Path) -> Any:
    return read_metadata_bytes((folder / ".metadata").read_bytes())


def _marker(folder: Path) -> dict[str, Any]:
    return json.loads((folder / COMPLETE_MARKER).read_text())


def _write_marker(folder: Path, marker: dict[str, Any]) -> None:
    (folder / COMPLETE_MARKER).write_text(json.dumps(marker))


def _rerecord(folder: Path, *names: str) -> None:
    """Update the marker's size and crc32 of ``names`` (what whoever wrote the folder can do)."""
    marker = _marker(folder)
    for name in names:
        data = (folder / name).read_bytes()
        marker["files"].setdefault(name, {"rank": 0})
        marker["files"][name].update(size=len(data), crc32=f"{zlib.crc32(data):08x}")
    _write_marker(folder, marker)


def _legacy(folder: Path) -> None:
    """A marker without checksums (an older save): the folder loads unverified, DCP reads it."""
    marker = _marker(folder)
    del marker["files"], marker["hash"]
    _write_marker(folder, marker)


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _replace_item(folder: Path, fqn: str, new: bytes) -> tuple[str, int, int]:
    """Replace item ``fqn`` in its shard file with ``new``, shift the later items, rewrite
    ``.metadata`` and the marker; ``(shard, offset, length)`` of the new item."""
    metadata = _metadata(folder)
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    data = (folder / info.relative_path).read_bytes()
    (folder / info.relative_path).write_bytes(data[:info.offset] + new + data[info.offset + info.length:])
    shift = len(new) - info.length
    for i, other in list(metadata.storage_data.items()):
        if other.relative_path == info.relative_path and other.offset > info.offset:
            metadata.storage_data[i] = dataclasses.replace(other, offset=other.offset + shift)
    metadata.storage_data[index] = dataclasses.replace(info, length=len(new))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _rerecord(folder, ".metadata", info.relative_path)
    return info.relative_path, info.offset, len(new)


def _repoint(folder: Path, fqn: str, relative: Any, offset: int, length: int) -> None:
    """Point item ``fqn`` of ``.metadata`` at ``relative`` (anything DCP's pickle may hold)."""
    metadata = _metadata(folder)
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    metadata.storage_data[index] = _StorageInfo(relative, offset, length)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _rerecord(folder, ".metadata")


class _CachedStr:
    """Pickles as a ``PurePosixPath`` of ``parts`` whose cached string (set by BUILD) is ``text``."""

    def __init__(self, parts: str, text: str) -> None:
        self.parts, self.text = parts, text

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.PurePosixPath, (self.parts,), (None, {"_str": self.text}))


def _zip_with_pickle(data: bytes) -> bytes:
    """``torch.save``'s zip of an int, with ``data.pkl`` replaced by ``data``."""
    src = zipfile.ZipFile(io.BytesIO(_saved(0)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, data if info.filename.endswith("data.pkl") else src.read(info.filename))
    return out.getvalue()


#: A dict whose key is a tuple nested 10**6 deep, no global at all: hashing the key (as plain
#: pickle and torch's weights-only unpickler do) overflows the C stack.
DEEP_PICKLE = b"\x80\x04}" + b")" + b"\x85" * 10**6 + b"K\x01s."
#: BUILD on the class pathlib.PurePosixPath, setting __truediv__ to PureWindowsPath, then a refused global.
BUILD_ON_CLASS = (b"\x80\x02cpathlib\nPurePosixPath\nN}X\x0b\x00\x00\x00__truediv__cpathlib\nPureWindowsPath\n"
                  b"s\x86b0cos\nsystem\nX\x04\x00\x00\x00true\x85R.")
#: BUILD on the function torch.serialization._get_layout, replacing its cache (strided -> sparse_coo).
BUILD_ON_FUNCTION = (b"\x80\x02ctorch.serialization\n_get_layout\n}X\x05\x00\x00\x00cache}"
                     b"X\x0d\x00\x00\x00torch.stridedctorch.serialization\n_get_layout\n"
                     b"X\x10\x00\x00\x00torch.sparse_coo\x85Rssb0cos\nsystem\nX\x04\x00\x00\x00true\x85R.")
#: A global that runs a source string: refused, and never with the trust hint.
FORWARD_FROM_SRC = b"\x80\x02ctorch.fx.graph_module\n_forward_from_src\nX\x01\x00\x00\x00x}\x86R."


def _hf_file(folder: Path) -> Path:
    """The export's one safetensors file (``model-00001-of-00001.safetensors``)."""
    (found,) = folder.glob("*.safetensors")
    return found


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _symlink(path: Path, target: str | Path) -> None:
    path.unlink(missing_ok=True)
    os.symlink(target, path)


@dataclasses.dataclass
class Results:
    root: Path
    cases: dict[str, dict[str, Any]]
    fate: str
    files: dict[str, Path]

    def __getitem__(self, name: str) -> dict[str, Any]:
        if name not in self.cases:
            pytest.fail(f"case {name!r} has no result: the hostile process {self.fate or 'skipped it'}")
        return self.cases[name]

    def refused(self, name: str, *needles: str) -> str:
        """Case ``name`` stopped in one ``error:`` line (exit 2) containing each of ``needles``,
        fast, without a traceback, a hang or a sentinel; the line."""
        r = self[name]
        assert not r["hung"], f"{name}: hung (stopped by the runner's alarm after {r['seconds']:.0f} s)"
        assert "traceback" not in r, f"{name}: {r['traceback']}"
        assert r["status"] == 2 and len(r["stderr"]) == 1 and r["stderr"][0].startswith("error: "), (name, r)
        line = r["stderr"][0]
        for needle in needles:
            assert needle in line, (name, needle, line)
        text = "\n".join(r["stderr"] + r["log"])
        assert SENTINEL not in text and str(VICTIM_SIZE) not in text, (name, text)
        assert not any("training continues" in m for m in r["log"]), (name, r["log"])
        assert r["changed"] == [], (name, r["changed"])
        assert r["seconds"] < 15, (name, r["seconds"])
        return line


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-process run saving full checkpoints at steps 2 and 4, and a Hugging Face export."""
    root = tmp_path_factory.mktemp("hostile-base")
    cases = [{"name": "base", "kind": "job", "root": str(root / "dcp"), "steps": 4,
              "checkpoint": {"interval": 2, "keep_latest_k": 0, "last_save_model_only": False}}]
    if _hf_supported():
        cases.append({"name": "hf", "kind": "job", "root": str(root / "hf"), "steps": 1,
                      "checkpoint": {"interval": 1000, "last_save_in_hf": True, "last_save_model_only": True}})
    results, fate = _run(cases, root / "run", timeout=240)
    assert not fate, fate
    assert all(r.get("status") == 0 for r in results.values()), results
    return root


@pytest.fixture(scope="module")
def results(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Results:
    """Every hostile folder, built here, loaded by the trainer in one process."""
    root = tmp_path_factory.mktemp("hostile")
    cases: list[dict[str, Any]] = []
    files: dict[str, Path] = {}

    def dcp_case(name: str, build: Any, *, steps: int = 4, initial: bool = False, **checkpoint: Any) -> None:
        where = root / name / ("elsewhere" if initial else "checkpoint")
        for step in (2, 4):
            shutil.copytree(base / "dcp" / "checkpoint" / f"step-{step}", where / f"step-{step}")
        files[name] = where / "step-4"
        build(where / "step-4")
        if initial:
            checkpoint["initial_load_path"] = str(where / "step-4")
        cases.append({"name": name, "kind": "job", "root": str(root / name / ("run" if initial else "")),
                      "steps": steps, "checkpoint": checkpoint})

    def hf_case(name: str, build: Any) -> None:
        if not _hf_supported():
            return
        folder = root / name / "hf"
        shutil.copytree(base / "hf" / "checkpoint" / "step-1", folder)
        files[name] = folder
        build(folder)
        cases.append({"name": name, "kind": "job", "root": str(root / name / "run"), "steps": 1,
                      "checkpoint": {"initial_load_path": str(folder), "initial_load_in_hf": True,
                                     "initial_load_model_only": True}})

    # The victim's files, outside every hostile folder: a shard whose train_state.step is the
    # sentinel (its layout known to the attacker), and a file of VICTIM_SIZE bytes.
    victim = root / "victim"
    shutil.copytree(base / "dcp" / "checkpoint" / "step-4", victim)
    shard, offset, length = _replace_item(victim, STEP, _saved(int(SENTINEL)))
    victim_file = root / "victim.bin"
    victim_file.write_bytes(b"v" * VICTIM_SIZE)

    def in_victim(folder: Path) -> None:  # the folder's metadata as the victim's (offsets match its shard)
        shutil.copy(victim / ".metadata", folder / ".metadata")

    dcp_case("clean", lambda f: None)
    dcp_case("windows_path", lambda f: _repoint(
        f, STEP, pathlib.PureWindowsPath("..", "..", "..", "victim", shard), offset, length))
    dcp_case("cached_str", lambda f: _repoint(f, STEP, _CachedStr(str(victim / shard), shard), offset, length))
    dcp_case("symlink", lambda f: (in_victim(f), _symlink(f / shard, victim / shard), _legacy(f)))
    dcp_case("symlink_verified", lambda f: (in_victim(f), _symlink(f / shard, victim / shard),
                                            _rerecord(f, ".metadata", shard)))
    dcp_case("dev_zero", lambda f: (_symlink(f / "zero", "/dev/zero"), _repoint(f, STEP, "zero", 0, 1 << 30),
                                    _legacy(f)))
    dcp_case("beyond_file", lambda f: (_repoint(f, STEP, shard, 0, 1 << 30), _legacy(f)))
    dcp_case("marker_outside", lambda f: _write_marker(f, {**_marker(f), "files": {
        **_marker(f)["files"], str(victim_file): {"size": 1, "crc32": "00000000", "rank": 0}}}))
    dcp_case("marker_dev_zero", lambda f: (_symlink(f / "zero", "/dev/zero"), _write_marker(f, {
        **_marker(f), "files": {**_marker(f)["files"], "zero": {"size": 0, "crc32": "00000000", "rank": 0}}})))
    dcp_case("forward_from_src", lambda f: ((f / ".metadata").write_bytes(FORWARD_FROM_SRC),
                                            _rerecord(f, ".metadata")))
    dcp_case("fifo_shard", lambda f: (_fifo(f / shard), _legacy(f)))
    dcp_case("fifo_shard_verified", lambda f: _fifo(f / shard))
    dcp_case("fifo_marker", lambda f: _fifo(f / COMPLETE_MARKER))
    dcp_case("deep_marker", lambda f: (f / COMPLETE_MARKER).write_text("[" * 100_000 + "]" * 100_000))
    dcp_case("step_1e400", lambda f: (f / COMPLETE_MARKER).write_text(
        (f / COMPLETE_MARKER).read_text().replace('"step": 4', '"step": 1e400')), initial=True)
    dcp_case("rank_x", lambda f: _write_marker(f, {**_marker(f), "files": {
        **_marker(f)["files"], shard: {**_marker(f)["files"][shard], "rank": "x"}}}))
    dcp_case("lr_decay_type", lambda f: _replace_item(f, "lr_scheduler.lr_lambdas.0.decay_type", _saved("evil")),
             steps=6)
    hf_case("fifo_hf", lambda f: _fifo(_hf_file(f)))
    hf_case("deep_config", lambda f: (f / "config.json").write_text("[" * 100_000 + "]" * 100_000))
    hf_case("index_list", lambda f: (f / "model.safetensors.index.json").write_text("[]"))

    def sharding_info(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(_hf_file(folder)))
        save_file(tensors, str(_hf_file(folder)), metadata={"DCP_SHARDING_INFO": "{}"})

    hf_case("hf_sharding_info", sharding_info)
    # the documented tool on a poisoned folder
    poisoned = root / "bench_read" / "step-4"
    shutil.copytree(base / "dcp" / "checkpoint" / "step-4", poisoned)
    files["bench_read"] = root / "bench_read.flag"
    (poisoned / ".metadata").write_bytes(f"cos\nsystem\n(S'touch {files['bench_read']}'\ntR.".encode())
    cases.append({"name": "bench_read", "kind": "bench_read", "folder": str(poisoned.parent)})
    # the two that changed the process (BUILD on a class, on a function), then a legitimate save
    dcp_case("build_on_class", lambda f: ((f / ".metadata").write_bytes(BUILD_ON_CLASS), _rerecord(f, ".metadata")))
    dcp_case("build_on_function", lambda f: ((f / ".metadata").write_bytes(BUILD_ON_FUNCTION),
                                             _rerecord(f, ".metadata")))
    cases.append({"name": "save_after", "kind": "job", "root": str(root / "save_after"), "steps": 2,
                  "checkpoint": {"interval": 1, "keep_latest_k": 0, "last_save_model_only": False}})
    # last in the process: the two that crashed it (a crash loses only the cases after it)
    dcp_case("deep_metadata", lambda f: ((f / ".metadata").write_bytes(DEEP_PICKLE), _rerecord(f, ".metadata")))
    dcp_case("deep_item", lambda f: _replace_item(f, STEP, _zip_with_pickle(DEEP_PICKLE)))
    found, fate = _run(cases, root / "run", timeout=300)
    return Results(root, found, fate, files)


def _line_for(results: Results, name: str, what: str, file: str) -> str:
    return f"error: checkpoint step-4: {what} ({results.files[name] / file})"


# ------------------------------------------------------------------ a control
def test_a_clean_copy_loads(results: Results) -> None:
    r = results["clean"]
    assert r["status"] == 0 and r["stderr"] == [], r
    assert any("training continues after step 4" in m for m in r["log"]), r["log"]


# ------------------------------------------------------------------ reads outside the folder
def test_a_windows_path_is_not_a_file_name(results: Results) -> None:
    """``PureWindowsPath("..", "..", "victim", ...)`` prints without a ``/``: its *type* is refused."""
    line = results.refused("windows_path", "is stored in a PureWindowsPath")
    assert line == _line_for(results, "windows_path", ".metadata is not DCP metadata: the item 'train_state.step' "
                             "is stored in a PureWindowsPath (which can print as any path), not the str name of a "
                             "file of the checkpoint's folder", ".metadata")


def test_a_path_whose_cached_string_lies_is_refused(results: Results) -> None:
    """A ``PurePosixPath`` of the victim's absolute path whose ``_str`` (set by BUILD) says
    ``__0_0.distcp``: BUILD on a path is refused, and its type would be."""
    results.refused("cached_str", ".metadata sets attributes (BUILD) on a pathlib.PurePosixPath object")


def test_a_symlink_in_the_folder_is_not_followed(results: Results) -> None:
    """The shard file a link to the victim's: refused by DCP's read (an unverified marker) and by
    the verification (a marker with the victim's checksums)."""
    results.refused("symlink", "__0_0.distcp is a symbolic link, which a checkpoint's folder may not hold")
    results.refused("symlink_verified", "__0_0.distcp is a symbolic link")


def test_dev_zero_and_lengths_past_the_file_allocate_nothing(results: Results) -> None:
    """An item 1 GiB long in a link to ``/dev/zero`` (DCP read 1 GiB), or past its file's end."""
    results.refused("dev_zero", "zero is a symbolic link")
    assert results["dev_zero"]["rss_growth_mib"] < 256, results["dev_zero"]
    results.refused("beyond_file", f"the item 'train_state.step' in __0_0.distcp lies at bytes 0..0+{1 << 30} of a "
                                   "file of")
    assert results["beyond_file"]["rss_growth_mib"] < 256, results["beyond_file"]


def test_the_markers_file_names_are_checked(results: Results) -> None:
    """A marker listing a file outside the folder: its size never reaches the error line."""
    line = results.refused("marker_outside", "its .complete marker lists", "among its files, which is not a plain "
                           "file name of the folder")
    assert line.endswith(f"({results.files['marker_outside'] / COMPLETE_MARKER})"), line


# ------------------------------------------------------------------ the loading process
def test_build_on_a_class_changes_nothing(results: Results) -> None:
    """BUILD on ``pathlib.PurePosixPath`` (``__truediv__`` := ``PureWindowsPath``), then a refused
    global: refused at the BUILD; pathlib unchanged (``changed == []``: checked by ``refused``)."""
    results.refused("build_on_class", ".metadata sets attributes (BUILD) on the class pathlib.PurePosixPath, "
                                      "which a checkpoint may not do")


def test_build_on_a_function_changes_nothing(results: Results) -> None:
    results.refused("build_on_function", "sets attributes (BUILD) on the function torch.serialization._get_layout")


def test_a_legitimate_save_after_the_refusals_lands_where_it_should(results: Results) -> None:
    r = results["save_after"]
    assert r["status"] == 0 and not r["changed"], r
    folder = results.root / "save_after" / "checkpoint"
    assert sorted(os.listdir(folder)) == ["step-1", "step-2"]
    for step in ("step-1", "step-2"):
        assert {".metadata", COMPLETE_MARKER, "__0_0.distcp"} <= set(os.listdir(folder / step)), step
    assert os.listdir(results.root / "run" / "cwd") == []  # nothing written where the process ran


# ------------------------------------------------------------------ crashes
def test_a_deeply_nested_metadata_does_not_crash(results: Results) -> None:
    """A 1 MB ``.metadata``, no global, a tuple nested 10**6 deep as a dict key (SIGSEGV before)."""
    results.refused("deep_metadata", ".metadata nests more than 256 levels deep")


def test_a_deeply_nested_item_does_not_crash(results: Results) -> None:
    """The same pickle as ``train_state.step``'s ``data.pkl``, for ``torch.load(weights_only=True)``."""
    results.refused("deep_item", "the item 'train_state.step' in __0_0.distcp nests more than 256 levels deep")


# ------------------------------------------------------------------ hangs
def test_fifos_are_refused_not_waited_on(results: Results) -> None:
    results.refused("fifo_shard", "__0_0.distcp is a FIFO (named pipe), not a regular file")
    results.refused("fifo_shard_verified", "__0_0.distcp is a FIFO (named pipe), not a regular file")
    results.refused("fifo_marker", "its .complete marker is a FIFO (named pipe), not a regular file")


@pytest.mark.skipif(not _hf_supported(), reason="Hugging Face loads need torch >= 2.14 (CheckpointableTensor)")
def test_a_fifo_named_as_safetensors_is_refused(results: Results) -> None:
    results.refused("fifo_hf", f"{_hf_file(results.files['fifo_hf']).name} is a FIFO (named pipe), not a regular file")


def test_a_marker_entry_at_dev_zero_is_not_hashed(results: Results) -> None:
    """A marker file entry ``zero`` (a link to ``/dev/zero``) of size 0 hashed forever at full CPU."""
    results.refused("marker_dev_zero", "zero is a symbolic link")


# ------------------------------------------------------------------ one line for every malformed file
def test_malformed_markers_are_one_line_naming_the_marker(results: Results) -> None:
    marker = COMPLETE_MARKER
    line = results.refused("deep_marker", "its .complete marker nests deeper than this reader follows")
    assert line.endswith(f"({results.files['deep_marker'] / marker})"), line
    line = results.refused("step_1e400", "its .complete marker is not valid JSON (the number 1e400 is not finite")
    assert line.endswith(f"({results.files['step_1e400'] / marker})"), line
    line = results.refused("rank_x", "its .complete marker records rank 'x' for __0_0.distcp, not a whole number")
    assert line.endswith(f"({results.files['rank_x'] / marker})"), line


@pytest.mark.skipif(not _hf_supported(), reason="Hugging Face loads need torch >= 2.14 (CheckpointableTensor)")
def test_malformed_hugging_face_files_are_one_line(results: Results) -> None:
    folder = results.files["deep_config"]
    results.refused("deep_config", f"{folder / 'config.json'}: config.json nests deeper than this reader follows")
    folder = results.files["index_list"]
    results.refused("index_list", f"{folder / 'model.safetensors.index.json'} is not a safetensors index")
    file = _hf_file(results.files["hf_sharding_info"])
    results.refused("hf_sharding_info", f"{file}: {file.name} has a {'DCP_SHARDING_INFO'} header entry that has no "
                                        "saved_offsets for")


def test_a_bad_lr_schedule_is_refused_at_load_not_at_the_next_step(results: Results) -> None:
    line = results.refused("lr_decay_type", "the item 'lr_scheduler.lr_lambdas.0.decay_type' holds decay_type "
                                            "'evil', which is no decay this library knows (linear, sqrt, cosine)")
    assert line.endswith(f"({results.files['lr_decay_type'] / '__0_0.distcp'})"), line


# ------------------------------------------------------------------ the opt-out hint
def test_a_global_that_runs_code_gets_no_trust_hint(results: Results) -> None:
    line = results.refused("forward_from_src", ".metadata refers to torch.fx.graph_module._forward_from_src, which a "
                                               "checkpoint may not load")
    assert "trust" not in line, line


# ------------------------------------------------------------------ the documented tool
def test_the_documented_read_command_runs_nothing(results: Results) -> None:
    r = results["bench_read"]
    assert not r["hung"] and "traceback" not in r, r
    assert not results.files["bench_read"].exists(), "bench/checkpoint_trust_versions.py read ran the payload"
    assert r["status"] == 1 and any("refers to os.system" in line for line in r["stdout"]), r


# ------------------------------------------------------------------ the path's type (unit)
def test_only_a_str_names_a_file(tmp_path: Path) -> None:
    """A path object is refused even when it prints as a plain name (its parts, which DCP joins,
    need not say what its ``str()`` says), and so is a ``str`` subclass; ``open_inside`` takes
    only a plain ``str`` name too."""
    from torchtitan_spmd._safe_files import UnsafeFile, open_inside
    from torchtitan_spmd.checkpoint.safe_metadata import RefusedCheckpointData, check_metadata

    class Name(str):
        pass

    metadata = read_metadata_bytes(pickle.dumps(_tiny_metadata("__0_0.distcp")))
    assert metadata.storage_data
    for relative in (pathlib.PurePosixPath("__0_0.distcp"), pathlib.PureWindowsPath("__0_0.distcp")):
        with pytest.raises(RefusedCheckpointData, match=f"is stored in a {type(relative).__name__}"):
            read_metadata_bytes(pickle.dumps(_tiny_metadata(relative)))
    with pytest.raises(RefusedCheckpointData, match="is stored in a Name"):
        check_metadata(_tiny_metadata(Name("__0_0.distcp")), ".metadata")
    (tmp_path / "x").write_bytes(b"1")
    assert open_inside(tmp_path, "x").read() == b"1"
    for name in (pathlib.PurePosixPath("x"), Name("x"), "../x", "a/x", "..", "", "x\0"):
        with pytest.raises(UnsafeFile):
            open_inside(tmp_path, name)


def _tiny_metadata(relative: Any) -> Any:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

    return Metadata(state_dict_metadata={"x": BytesStorageMetadata()},
                    storage_data={MetadataIndex("x"): _StorageInfo(relative, 0, 1)}, planner_data={"x": ("x",)})


def test_damaged_metadata_is_refused_in_one_line_never_a_crash() -> None:
    """Random byte changes and cuts of a real ``.metadata`` (every kind of field DCP writes):
    the decoder reads it or refuses it with :class:`RefusedCheckpointData`, nothing else (no
    other exception, no crash, no hang)."""
    import random

    from test_checkpoint_trust import every_kind_of_metadata

    from torchtitan_spmd.checkpoint.safe_metadata import RefusedCheckpointData

    metadata = every_kind_of_metadata()  # every kind of field, four tensors of it (CI time)
    keep = {"bytes", "t0", "t1", "t2", "t3"}
    metadata.state_dict_metadata = {k: v for k, v in metadata.state_dict_metadata.items() if k in keep}
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn in keep}
    metadata.planner_data = {k: v for k, v in metadata.planner_data.items() if k in keep}
    data = pickle.dumps(metadata, protocol=4)
    rng = random.Random(44)
    refused = 0
    for trial in range(600):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        if trial % 10 == 0:
            damaged = damaged[:rng.randrange(len(damaged))]
        try:
            read_metadata_bytes(bytes(damaged))
        except RefusedCheckpointData as err:
            refused += 1
            assert "\n" not in str(err), str(err)
    assert refused > 300, refused  # most damage is caught


def test_the_trust_pages_table_of_attacks_matches_these_tests() -> None:
    """``docs/checkpoint-trust.md``'s table names each attack's test: every test there exists, and
    every test of this file but the control is there."""
    import re

    page = (Path(__file__).resolve().parents[2] / "docs" / "checkpoint-trust.md").read_text()
    table = page.split("## The attacks, and what stops each", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(test_\w+)`", table))
    here = set(re.findall(r"^def (test_\w+)\(", Path(__file__).read_text(), flags=re.M))
    expected = here - {"test_a_clean_copy_loads", "test_the_trust_pages_table_of_attacks_matches_these_tests"}
    assert listed - here == set(), f"the page names tests this file lacks: {sorted(listed - here)}"
    assert expected - listed == set(), f"the page's table lacks: {sorted(expected - listed)}"
