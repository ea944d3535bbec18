"""Layer 3: loading a checkpoint runs none of its author's code.

A poisoned checkpoint holds a pickle that, read with plain ``pickle`` (DCP's
``read_metadata``) or ``torch.load(weights_only=False)`` (DCP's ``load_bytes``), runs
``os.system("touch <flag>")``. The flag file proves whether it ran: the restricted reader
(``torchtitan_spmd.checkpoint.safe_metadata``) must refuse it in one line naming the global,
on every load path, and ``checkpoint.trust_checkpoint_folder`` (the opt-out) must really run
it (so the payload is live and the flag can appear).

The unit tests read pickles directly; the trainer's tests run on 2 forked gloo ranks (FSDP 2,
the tiny model) through ``train.run_job``.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import shutil
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from integrity_helpers import cfg, run_starts
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from torchtitan_spmd.checkpoint.manager import COMPLETE_MARKER
from torchtitan_spmd.checkpoint.safe_metadata import (
    RefusedCheckpointData,
    RestrictedLoadPlanner,
    read_metadata_bytes,
)

pytestmark = [pytest.mark.backend("default")]

REFUSED = "refers to os.system, which a checkpoint may not load"


def payload(flag: Path) -> bytes:
    """A protocol-0 pickle that calls ``os.system("touch <flag>")`` when read with plain pickle."""
    return f"cos\nsystem\n(S'touch {flag}'\ntR.".encode()


class _System:
    """Pickles as a call of ``os.system`` (``posix.system``) with ``cmd``."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.cmd,))


def every_kind_of_metadata() -> Metadata:
    """A ``Metadata`` with every field DCP fills, every dtype, layout and memory format."""
    dtypes = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
    entries: dict[str, Any] = {"bytes": BytesStorageMetadata()}
    storage: dict[MetadataIndex, Any] = {MetadataIndex("bytes"): _StorageInfo("__0_0.distcp", 0, 10)}
    formats = (torch.contiguous_format, torch.channels_last, torch.preserve_format)
    for i, dtype in enumerate(dtypes):
        props = TensorProperties(dtype=dtype, layout=(torch.strided, torch.sparse_coo)[i % 2],
                                 memory_format=formats[i % 3], requires_grad=bool(i % 2), pin_memory=False)
        chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3])),
                  ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([2, 3]))]
        entries[f"t{i}"] = TensorStorageMetadata(properties=props, size=torch.Size([4, 3]), chunks=chunks)
        for c in chunks:
            storage[MetadataIndex(f"t{i}", c.offsets, index=1)] = _StorageInfo(
                f"__{i % 2}_0.distcp", 64 * i, 64, transform_descriptors=["zstd"] if i % 2 else None)
    planner = OrderedDict((k, (k.split(".")[0], 0, "x")) for k in entries)
    return Metadata(state_dict_metadata=entries, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=pathlib.Path("/a/step-4.partial"), save_id="s",
                                             modules=["m"]),
                    version="1.0.0")


# ------------------------------------------------------------------ the allow-list
@pytest.mark.parametrize("protocol", [2, 3, 4, pickle.HIGHEST_PROTOCOL])
def test_everything_dcp_pickles_reads_back_as_plain_pickle_reads_it(protocol: int) -> None:
    metadata = every_kind_of_metadata()
    data = pickle.dumps(metadata, protocol=protocol)
    got, plain = read_metadata_bytes(data), pickle.loads(data)
    assert got == plain == metadata
    for key, entry in plain.state_dict_metadata.items():  # TensorProperties compares by dtype only
        if isinstance(entry, TensorStorageMetadata):
            want = entry.properties
            have = got.state_dict_metadata[key].properties
            assert (have.dtype, have.layout, have.memory_format, have.requires_grad) == (
                want.dtype, want.layout, want.memory_format, want.requires_grad), key


def _refusal(data: bytes) -> RefusedCheckpointData:
    with pytest.raises(RefusedCheckpointData) as caught:
        read_metadata_bytes(data)
    return caught.value


def test_any_other_global_is_refused_before_it_runs(tmp_path: Path) -> None:
    flag = tmp_path / "flag"
    err = _refusal(payload(flag))
    assert not flag.exists(), "the payload ran"
    assert str(err) == f".metadata {REFUSED}" and err.refused == "os.system"
    # inside a real Metadata, at any depth, at any protocol
    poisoned = every_kind_of_metadata()
    poisoned.planner_data = {"x": [(1, _System(f"touch {flag}"))]}
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        err = _refusal(pickle.dumps(poisoned, protocol=protocol))
        assert err.refused == "posix.system" and err.file == ".metadata", err
    for obj, name in ((eval, "builtins.eval"), (getattr, "builtins.getattr"), (shutil.rmtree, "shutil.rmtree"),
                      (set, "builtins.set"), (torch.load, "torch.serialization.load")):
        assert _refusal(pickle.dumps(obj)).refused == name
    # only a DCP class name may be a newer torch's: the line says how to load it if trusted
    newer = b"\x80\x04c" + b"torch.distributed.checkpoint.metadata\nNewerStorageMetadata\n)\x81."
    assert str(_refusal(newer)).endswith(
        "if a newer torch wrote it and you trust whoever wrote the folder, --checkpoint.trust_checkpoint_folder loads it")
    # never for a global that runs code, torch's or any other's
    assert "trust" not in str(_refusal(pickle.dumps(torch.load)))
    assert "trust" not in str(_refusal(payload(flag)))
    assert not flag.exists()


def test_what_is_not_dcp_metadata_is_refused_in_one_line(tmp_path: Path) -> None:
    assert str(_refusal(pickle.dumps(7))) == ".metadata is not DCP metadata: it holds a int, not a Metadata"
    assert str(_refusal(b"\x80\x04")).startswith(".metadata cannot be read as DCP metadata (")
    for where in ("../../etc/passwd", "/etc/passwd", "sub/x.distcp", ".."):
        escaping = every_kind_of_metadata()
        escaping.storage_data[MetadataIndex("bytes")] = _StorageInfo(where, 0, 10)
        assert str(_refusal(pickle.dumps(escaping))) == (
            f".metadata is not DCP metadata: the item 'bytes' is stored in {where!r}, outside the checkpoint's folder")


def test_non_tensor_items_are_read_with_weights_only(tmp_path: Path) -> None:
    """DCP's own ``load_bytes`` reads them with ``torch.load(weights_only=False)``."""
    flag = tmp_path / "flag"

    class Item:
        dest_index = MetadataIndex("train_state.step")

    def saved(obj: Any) -> io.BytesIO:
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return buf

    planner = RestrictedLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    planner.load_bytes(Item(), saved({"step": 4, "lrs": [0.1, (0.9, 0.95)]}))
    assert planner.state_dict == {"train_state.step": {"step": 4, "lrs": [0.1, (0.9, 0.95)]}}
    with pytest.raises(RefusedCheckpointData) as caught:
        planner.load_bytes(Item(), saved(_System(f"touch {flag}")))
    assert str(caught.value.in_file("__0_0.distcp")) == (
        "the item 'train_state.step' in __0_0.distcp refers to posix.system, which a checkpoint may not load")
    assert not flag.exists()
    trusting = RestrictedLoadPlanner(flatten_state_dict=False, trust_folder=True)  # DCP's own behaviour
    trusting.state_dict = {}
    trusting.load_bytes(Item(), saved(_System(f"touch {flag}")))
    assert flag.exists()


def test_the_parity_reference_reads_a_checkpoint_restricted_too(tmp_path: Path) -> None:
    """``python -m torchtitan_spmd.parity`` loads ``checkpoint.initial_load_path`` through the reference."""
    from torchtitan_spmd.reference import checkpoint_weights

    flag = tmp_path / "flag"
    (tmp_path / "step-0").mkdir()
    (tmp_path / "step-0" / ".metadata").write_bytes(payload(flag))
    with pytest.raises(ValueError, match=f"step-0'?: .metadata {REFUSED}$"):
        checkpoint_weights(str(tmp_path / "step-0"), {"w": torch.zeros(2)})
    assert not flag.exists()


def test_no_torch_load_in_the_library_reads_with_weights_only_false() -> None:
    """Every ``torch.load`` of the package passes ``weights_only=True`` (or the trust flag)."""
    import ast

    import torchtitan_spmd

    root = Path(torchtitan_spmd.__file__).parent
    calls = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                weights_only = {k.arg: ast.unparse(k.value) for k in node.keywords}.get("weights_only")
                calls.append((path.relative_to(root).as_posix(), weights_only))
    # the shard reader's tensors (DCP's own call, now bounded) and the planner's non-tensor items
    assert sorted(calls) == [("checkpoint/safe_metadata.py", "True"),
                             ("checkpoint/safe_metadata.py", "not self.trust_folder")], calls


# ------------------------------------------------------------------ the trainer, 2 gloo ranks
def _marker(folder: Path) -> dict[str, Any]:
    return json.loads((folder / COMPLETE_MARKER).read_text())


def _rerecord(folder: Path, *names: str) -> None:
    """Update the marker's size and crc32 of ``names`` (what whoever wrote the folder can do)."""
    marker = _marker(folder)
    for name in names:
        data = (folder / name).read_bytes()
        marker["files"][name].update(size=len(data), crc32=f"{zlib.crc32(data):08x}")
    (folder / COMPLETE_MARKER).write_text(json.dumps(marker))


def _poison_metadata(folder: Path, flag: Path, *, legacy: bool = False) -> None:
    (folder / ".metadata").write_bytes(payload(flag))
    if legacy:  # a marker from before checksums: it loads unverified, with a warning
        marker = _marker(folder)
        del marker["files"], marker["hash"]
        (folder / COMPLETE_MARKER).write_text(json.dumps(marker))
    else:
        _rerecord(folder, ".metadata")


def _poison_item(folder: Path, flag: Path, fqn: str = "train_state.step") -> str:
    """Replace the non-tensor item ``fqn`` in its shard file with a ``torch.save`` of an
    ``os.system`` call, shift the later items, rewrite ``.metadata`` and the marker."""
    return _replace_item(folder, fqn, _System(f"touch {flag}"))


def _replace_item(folder: Path, fqn: str, obj: Any) -> str:
    """Replace the non-tensor item ``fqn`` in its shard file with a ``torch.save`` of ``obj``,
    shift the later items, rewrite ``.metadata`` and the marker; the shard file's name."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # our own test's file: plain pickle
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = (folder / info.relative_path).read_bytes()
    new = buf.getvalue()
    (folder / info.relative_path).write_bytes(data[:info.offset] + new + data[info.offset + info.length:])
    shift = len(new) - info.length
    for i, other in list(metadata.storage_data.items()):
        if other.relative_path == info.relative_path and other.offset > info.offset:
            metadata.storage_data[i] = _StorageInfo(other.relative_path, other.offset + shift, other.length,
                                                    other.transform_descriptors)
    metadata.storage_data[index] = _StorageInfo(info.relative_path, info.offset, len(new), info.transform_descriptors)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _rerecord(folder, ".metadata", info.relative_path)
    return info.relative_path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank FSDP 2 run of 4 steps saving full checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("trust")
    per_rank = run_starts([("run", "job", cfg(str(root), steps=4, keep_latest_k=0, last_save_model_only=False), [])])
    assert all(r["run"]["status"] == 0 for r in per_rank), per_rank
    return root / "checkpoint"


@pytest.mark.multiproc
def test_a_poisoned_checkpoint_runs_nothing_on_any_load_path(saved: Path, tmp_path: Path) -> None:
    """Every load path refuses it in one line on every rank; only the opt-out runs it; a clean copy
    loads with and without the opt-out."""
    cases, flags, files = [], {}, {}

    def case(name: str, poison: Any, *, initial: bool = False, **checkpoint: Any) -> None:
        flags[name] = tmp_path / f"{name}.flag"
        source = tmp_path / name / ("elsewhere" if initial else "checkpoint")
        for step in (2, 4):
            shutil.copytree(saved / f"step-{step}", source / f"step-{step}")
        files[name] = source / "step-4" / poison(source / "step-4", flags[name])
        if initial:  # a fresh run starting from another team's checkpoint
            checkpoint["initial_load_path"] = str(source / "step-4")
        cases.append((name, "job", cfg(str(tmp_path / name / ("run" if initial else "")), steps=4, **checkpoint), []))

    def metadata(folder: Path, flag: Path) -> str:
        _poison_metadata(folder, flag)
        return ".metadata"

    def legacy(folder: Path, flag: Path) -> str:
        _poison_metadata(folder, flag, legacy=True)
        return ".metadata"

    case("resume", metadata)  # the run's own newest checkpoint; checksums updated
    case("legacy", legacy)  # a marker without checksums
    case("initial", metadata, initial=True)
    case("load_step", metadata, load_step=4)
    case("item", _poison_item)  # a non-tensor item in a shard file
    case("trusted", metadata, trust_checkpoint_folder=True)  # the opt-out: the payload is live
    for name, trust in (("clean", False), ("clean_trusted", True)):  # an unpoisoned copy loads either way
        shutil.copytree(saved / "step-4", tmp_path / name / "checkpoint" / "step-4")
        cases.append((name, "start", cfg(str(tmp_path / name), steps=4, trust_checkpoint_folder=trust), []))
    per_rank = run_starts(cases)

    ran = [name for name in flags if flags[name].exists()]
    assert ran == ["trusted"], f"the payload ran in {ran}"  # only where the folder is trusted
    for name in ("resume", "legacy", "initial", "load_step"):
        for r in per_rank:
            assert r[name]["status"] == 2, (name, r[name])
            assert r[name]["stderr"] == [f"error: checkpoint step-4: .metadata {REFUSED} ({files[name]})"], r[name]
        assert not flags[name].exists(), name
    for r in per_rank:
        assert r["item"]["status"] == 2 and r["item"]["stderr"] == [
            f"error: checkpoint step-4: the item 'train_state.step' in {files['item'].name} refers to posix.system, "
            "which a checkpoint may not load; the newest checkpoint that verifies is step-2: load it with "
            f"--checkpoint.load_step 2 ({files['item']})"], r["item"]
    assert not flags["item"].exists()
    assert any("records no checksums" in m for m in per_rank[0]["legacy"]["log"])
    # trusted: the payload ran (then DCP's own read failed on what it returned), with the warning naming the folder
    assert flags["trusted"].exists()
    assert all(r["trusted"]["status"] == 2 for r in per_rank)
    warned = [m for m in per_rank[0]["trusted"]["log"] if "trust_checkpoint_folder is set" in m]
    assert len(warned) == 1 and str(files["trusted"].parent) in warned[0], per_rank[0]["trusted"]["log"]
    for r in per_rank:
        for name in ("clean", "clean_trusted"):
            assert r[name].get("loaded", {}).get("step") == 4 and r[name]["start_step"] == 4, r[name]
    assert not any("trust_checkpoint_folder" in m for m in per_rank[0]["clean"]["log"])
    assert any("trust_checkpoint_folder is set" in m for m in per_rank[0]["clean_trusted"]["log"])


@pytest.mark.multiproc
def test_a_hostile_folder_stops_every_rank_in_one_line(saved: Path, tmp_path: Path) -> None:
    """Issue 44's findings on 2 ranks (one process each: test_checkpoint_hostile.py): a shard
    file that is a link (an unverified marker, so DCP's own read meets it), a marker that is a
    FIFO, a learning-rate schedule with an unknown decay. Every rank stops with exit 2 and one
    line naming the file (rank 0's decision printed once, or every rank's own line); none
    hangs or loads."""
    cases, files = [], {}

    def case(name: str, poison: Any) -> None:
        folder = tmp_path / name / "checkpoint"
        for step in (2, 4):
            shutil.copytree(saved / f"step-{step}", folder / f"step-{step}")
        files[name] = poison(folder / "step-4")
        cases.append((name, "job", cfg(str(tmp_path / name), steps=6), []))

    def link(step: Path) -> Path:
        outside = step.parent.parent / "outside.distcp"
        (step / "__1_0.distcp").rename(outside)
        (step / "__1_0.distcp").symlink_to(outside)
        marker = _marker(step)
        del marker["files"], marker["hash"]
        (step / COMPLETE_MARKER).write_text(json.dumps(marker))
        return step / "__1_0.distcp"

    def fifo(step: Path) -> Path:
        (step / COMPLETE_MARKER).unlink()
        os.mkfifo(step / COMPLETE_MARKER)
        return step / COMPLETE_MARKER

    def decay(step: Path) -> Path:
        return step / _replace_item(step, "lr_scheduler.lr_lambdas.0.decay_type", "evil")

    case("link", link)
    case("fifo", fifo)
    case("decay", decay)
    per_rank = run_starts(cases)
    expect = {"link": "__1_0.distcp is a symbolic link", "fifo": "its .complete marker is a FIFO (named pipe)",
              "decay": "the item 'lr_scheduler.lr_lambdas.0.decay_type' holds decay_type 'evil'"}
    for name, needle in expect.items():
        lines = [line for r in per_rank for line in r[name]["stderr"]]
        assert all(r[name]["status"] == 2 for r in per_rank), (name, per_rank)
        assert lines and all(line.startswith("error: checkpoint step-4: ") and needle in line
                             and line.endswith(f"({files[name]})") for line in lines), (name, lines)
        assert all(len(r[name]["stderr"]) <= 1 for r in per_rank), (name, per_rank)
        assert not any("checkpoint: loaded" in m for r in per_rank for m in r[name]["log"]), name
