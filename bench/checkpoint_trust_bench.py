"""What the restricted reader costs: reading ``.metadata`` of the debug model's full checkpoint
with :class:`~torchtitan_spmd.checkpoint.safe_metadata.MetadataUnpickler` (then its shape
check) against plain ``pickle`` (DCP's ``read_metadata``), and the non-tensor items with
``weights_only=True`` against ``False``.

    python bench/checkpoint_trust_bench.py                 # llama3 debugmodel, one process
    python bench/checkpoint_trust_bench.py --rounds 200 --folder /tmp/trustbench

One process trains 1 step of ``--model``/``--flavor`` and saves a full checkpoint (model,
AdamW, scheduler, data position, step, RNG); then, from the bytes in memory (no disk in the
timing), each reader parses ``.metadata`` ``--rounds`` times, interleaved, and the table gives
the median and the ratio. The items line: every non-tensor item of the checkpoint through
``torch.load`` both ways, per round (restricted: with the zip and depth checks first).

The plain ``pickle`` and ``weights_only=False`` reads are DCP's own, timed as the baseline on
the bytes this script has just written in its own temporary folder; every other read goes
through the restricted path (``RestrictedReader``, ``open_inside``).
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from torchtitan_spmd._safe_files import open_inside  # noqa: E402
from torchtitan_spmd.checkpoint.safe_metadata import (  # noqa: E402
    RestrictedReader,
    check_torch_item,
    read_metadata_bytes,
)
from torchtitan_spmd.config import JobConfig  # noqa: E402


def _save(folder: str, model: str, flavor: str) -> Path:
    from torchtitan_spmd.train import run_job

    config = JobConfig.from_dict({
        "job": {"dump_folder": folder},
        "model": {"name": model, "flavor": flavor},
        "training": {"steps": 1, "local_batch_size": 1, "seq_len": 64, "device": "cpu"},
        "parallelism": {"data_parallel_shard_degree": 1},
        "checkpoint": {"enable": True, "interval": 1, "last_save_model_only": False},
        "debug": {"seed": 0},
    })
    if run_job(config) != 0:
        raise SystemExit("the training run failed")
    return Path(folder) / "checkpoint" / "step-1"


def _items(step: Path) -> list[bytes]:
    """The bytes of every non-tensor item, found through the restricted reader (as the trainer)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = RestrictedReader(str(step)).read_metadata()
    out = []
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            with open_inside(step, info.relative_path) as f:
                f.seek(info.offset)
                out.append(f.read(info.length))
    return out


def _restricted_item(item: bytes) -> object:
    """What :class:`RestrictedLoadPlanner` does per item: the zip and depth checks, then
    ``torch.load(weights_only=True)``."""
    stream = io.BytesIO(item)
    check_torch_item(stream, "item")
    return torch.load(stream, weights_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--folder", default=None, help="where to save (default: a temporary folder, removed)")
    args = parser.parse_args()
    folder = args.folder or tempfile.mkdtemp(prefix="trustbench-")
    try:
        step = _save(folder, args.model, args.flavor)
        data = (step / ".metadata").read_bytes()
        items = _items(step)
        assert read_metadata_bytes(data).state_dict_metadata == pickle.loads(data).state_dict_metadata
        times: dict[str, list[float]] = {"pickle": [], "restricted": [], "items False": [], "items True": []}
        for _ in range(args.rounds):
            for name in ("pickle", "restricted"):
                start = time.perf_counter()
                # DCP's read_metadata: pickle.load on the file's stream
                pickle.load(io.BytesIO(data)) if name == "pickle" else read_metadata_bytes(data)
                times[name].append(time.perf_counter() - start)
            for weights_only in (False, True):
                start = time.perf_counter()
                for item in items:  # DCP's load_bytes, or the restricted planner's
                    _restricted_item(item) if weights_only else torch.load(io.BytesIO(item), weights_only=False)
                times[f"items {weights_only}"].append(time.perf_counter() - start)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        low = {k: min(v) * 1e3 for k, v in times.items()}
        n_keys = len(read_metadata_bytes(data).state_dict_metadata)
        print(f"torch {torch.__version__}; {args.model}/{args.flavor}: .metadata {len(data):,} bytes, {n_keys} keys, "
              f"{len(items)} non-tensor items; {args.rounds} rounds, interleaved")
        print("| read | plain: median / min (ms) | restricted: median / min (ms) | ratio of medians |")
        print("|---|---|---|---|")
        for label, plain, restricted in ((".metadata", "pickle", "restricted"),
                                         (f"the {len(items)} non-tensor items (torch.load)", "items False",
                                          "items True")):
            print(f"| {label} | {med[plain]:.2f} / {low[plain]:.2f} | {med[restricted]:.2f} / {low[restricted]:.2f} "
                  f"| {med[restricted] / med[plain]:.2f} |")
    finally:
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
