"""The restricted DCP reader on a given torch: what DCP pickles, and whether every checkpoint reads.

Runs on any torch the library supports (it needs only torch and
``torchtitan_spmd/checkpoint/safe_metadata.py``: no tyro, no process launcher), so it can be
run under another torch's interpreter with this tree on ``PYTHONPATH``::

    python bench/checkpoint_trust_versions.py write OUT    # DCP checkpoints by this torch
    python bench/checkpoint_trust_versions.py read DIR...  # every .metadata under DIR...

``write`` saves, with this torch's DCP: tensors of every dtype, non-tensor items (ints, floats,
strings, None, lists, tuples, dicts), a model's and AdamW's state through
``get_model_state_dict``/``get_optimizer_state_dict`` (flattened, as the trainer saves them),
a LambdaLR's state, sharded DTensors from 2 gloo ranks (``dcp.save``) and the same with
``dcp.async_save``. ``read`` reads each ``.metadata`` only through the trainer's restricted
path (``RestrictedReader``: a regular file of its folder, the restricted unpickler, the type
check; never plain pickle, so a hostile folder runs nothing here), loads every item through
``RestrictedReader`` and ``RestrictedLoadPlanner`` (one process), and prints each global the
files name, by how many files name it, and whether the allow-list has it. Exit 1 if any file
is refused. (That the restricted read equals plain pickle's on what DCP writes is
``tests/layer3_runtime/test_checkpoint_trust.py``'s test, on objects the test builds.)
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchtitan_spmd._safe_files import read_inside
from torchtitan_spmd.checkpoint.safe_metadata import (
    MAX_METADATA_BYTES,
    MetadataUnpickler,
    RefusedCheckpointData,
    RestrictedLoadPlanner,
    RestrictedReader,
    allowed_objects,
    check_metadata,
    check_pickle_bounds,
)


def _plain_state() -> dict[str, Any]:
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
              torch.uint8, torch.bool, torch.complex64]
    dtypes += [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d]
    state: dict[str, Any] = {f"t_{str(d).split('.')[-1]}": torch.ones(3, 4).to(d) for d in dtypes}
    state.update(step=7, lr=3e-4, name="x", nothing=None, betas=(0.9, 0.95), lst=[1, 2.5, "a"],
                 nested={"a": {"b": [1, 2]}, "c": torch.zeros(2)})
    return state


def _trainer_like_state() -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {**get_model_state_dict(model), "optimizer": flat, "lr_scheduler": sched.state_dict(),
            "train_state": {"step": 3}, "dataloader": {"step": 3, "samples": 12}}


def _sharded(rank: int, world: int, out: str, store: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        state = {"w": distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]),
                 "b": distribute_tensor(torch.randn(8).to(torch.bfloat16), mesh, [Shard(0)]),
                 "train_state": {"step": 5}}
        dcp.save(state, checkpoint_id=os.path.join(out, "sharded"))
        if hasattr(dcp, "async_save"):
            dcp.async_save(state, checkpoint_id=os.path.join(out, "sharded_async")).result()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write(out: str) -> None:
    """Write this torch's checkpoints under ``out``."""
    os.makedirs(out, exist_ok=True)
    dcp.save(_plain_state(), checkpoint_id=os.path.join(out, "plain"), no_dist=True)
    dcp.save(_trainer_like_state(), checkpoint_id=os.path.join(out, "trainer_like"), no_dist=True)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_sharded, args=(2, out, os.path.join(tmp, "store")), nprocs=2, start_method="fork")
    print(f"torch {torch.__version__}: wrote {sorted(os.listdir(out))} under {out}")


class _Recording(MetadataUnpickler):
    """The restricted unpickler, counting each global it is asked for (allowed or not)."""

    def __init__(self, f: Any, seen: Counter[tuple[str, str]]) -> None:
        super().__init__(f)
        self.seen = seen

    def find_class(self, module: str, name: str) -> Any:
        self.seen[(module, name)] += 1
        return super().find_class(module, name)


def _load_all(folder: Path, metadata: Any) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    state: dict[str, Any] = {}
    declared = 0
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            shape = tuple(entry.size)
            declared += torch.Size(shape).numel() * torch.empty((), dtype=entry.properties.dtype).element_size()
            state[key] = shape, entry.properties.dtype
        else:
            state[key] = None
    stored = sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and not p.is_symlink())
    if declared > 4 * stored + (1 << 20):  # a folder declaring more tensor bytes than it holds: not allocated
        raise ValueError(f"declares {declared} tensor bytes in {stored} bytes of files")
    state = {k: torch.empty(v[0], dtype=v[1]) if v is not None else None for k, v in state.items()}
    dcp.load(state, storage_reader=RestrictedReader(str(folder)), planner=RestrictedLoadPlanner(), no_dist=True)


def read(folders: list[str]) -> int:
    """Read every ``.metadata`` under ``folders`` through the trainer's restricted path; the table
    of globals; 1 if any was refused (the allow-list missed a global) or none was found.

    Nothing here runs a file's code: each ``.metadata`` is opened as a regular file of its
    folder (no link followed) and read only by the restricted unpickler (counting the globals
    it is asked for, allowed or not), then by ``RestrictedReader`` as the trainer reads it,
    and its items are loaded through ``RestrictedReader`` and ``RestrictedLoadPlanner``. A
    file that is not a pickle at all (a test's deliberately damaged checkpoint) is counted as
    damaged; a folder whose items fail to load after its metadata read (a test's truncated
    shard file) is listed, not failed.
    """
    seen: Counter[tuple[str, str]] = Counter()
    files, ok, damaged, refused, unloadable = 0, 0, [], [], []
    for root in folders:
        for path in sorted(Path(root).rglob(".metadata")):
            if path.is_symlink() or not path.is_file():
                damaged.append(f"{path}: not a regular file")
                continue
            files += 1
            local: Counter[tuple[str, str]] = Counter()
            try:
                data = read_inside(path.parent, path.name, MAX_METADATA_BYTES)
                check_pickle_bounds(data, path.name, path.name)
                check_metadata(_Recording(io.BytesIO(data), local).load(), path.name)
                mine = RestrictedReader(str(path.parent)).read_metadata()  # the trainer's own read
            except RefusedCheckpointData as err:
                seen.update(set(local))
                (refused if err.refused else damaged).append(f"{path}: {err}")
                continue
            except Exception as err:  # noqa: BLE001 - a damaged file
                damaged.append(f"{path}: {type(err).__name__}: {err}")
                continue
            seen.update(set(local))  # files naming each, not occurrences
            ok += 1
            try:
                _load_all(path.parent, mine)
            except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                if isinstance(err, KeyboardInterrupt):
                    raise
                unloadable.append(f"{path.parent}: {type(err).__name__}")
    allowed = allowed_objects()
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}: {files} .metadata files: {ok} read by the "
          f"restricted reader, {len(refused)} refused (a global the allow-list lacks), {len(damaged)} damaged or "
          f"malformed; items loaded through RestrictedLoadPlanner in {ok - len(unloadable)} of {ok}")
    print("| global | files naming it | allowed |")
    print("|---|---|---|")
    for (module, name), count in sorted(seen.items()):
        print(f"| `{module}.{name}` | {count} | {'yes' if (module, name) in allowed else 'NO'} |")
    for line in refused:
        print("REFUSED", line)
    for line in damaged:
        print("damaged", line)
    for line in unloadable:
        print("items not loaded", line)
    return 1 if refused or not files else 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "write":
        write(sys.argv[2])
    elif len(sys.argv) >= 3 and sys.argv[1] == "read":
        sys.exit(read(sys.argv[2:]))
    else:
        sys.exit(__doc__)
