"""Run the cases of ``test_checkpoint_hostile.py`` in one fresh process (``python hostile_runner.py SPEC OUT``).

``SPEC`` is a JSON file ``{"cases": [...]}``; each case is ``{"name", "kind", ...}``:

- ``"job"``: ``run_job`` of the single-process tiny job (``checkpoint_helpers.ck_config``:
  default backend, one process) with ``"root"`` as its dump folder, ``"steps"`` and the
  ``"checkpoint"`` fields given;
- ``"bench_read"``: ``bench/checkpoint_trust_versions.py``'s ``read`` of ``"folder"`` (the
  documented command, called in this process).

Each case's result is written to ``OUT/<name>.json`` as soon as it ends: the exit status, the
``stderr`` lines, the library's log lines, ``stdout`` (bench), the seconds it took, how much
the process's peak RSS grew (MiB), whether an alarm had to stop it (``hung``; every case has
``"limit"`` seconds, 20 by default), and which of the process-wide objects a checkpoint's
pickle could reach (pathlib's classes, ``torch.serialization._get_layout``'s cache, DCP's
metadata classes) differ from before the case. ``OUT/progress`` lists each case as it starts,
so a case that kills the process (a crash) is known by name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import resource
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = str(HERE.parents[1])
sys.path.insert(0, str(HERE))


class _Hung(BaseException):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Hung()


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _process_state() -> dict[str, str]:
    """What a checkpoint's pickle could reach and change, as comparable text."""
    import pathlib

    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md
    import torch.serialization

    out = {}
    for cls in (pathlib.PurePath, pathlib.PurePosixPath, pathlib.PosixPath, pathlib.Path, pathlib.PureWindowsPath,
                md.Metadata, md.MetadataIndex, md.StorageMeta, md.TensorStorageMetadata, md.BytesStorageMetadata,
                md.ChunkStorageMetadata, md.TensorProperties, fs._StorageInfo):
        # (pickling an instance caches __slotnames__ on its class: a legitimate save does)
        out[f"{cls.__module__}.{cls.__qualname__}"] = repr(sorted((k, id(v)) for k, v in vars(cls).items()
                                                                  if k != "__slotnames__"))
    layout = torch.serialization._get_layout
    out["_get_layout.__dict__"] = repr(sorted((k, id(v)) for k, v in vars(layout).items()))
    try:
        out["_get_layout('torch.strided')"] = repr(layout("torch.strided"))
    except Exception as err:  # noqa: BLE001 - a cache replaced by a checkpoint
        out["_get_layout('torch.strided')"] = repr(err)
    for member in md._MEM_FORMAT_ENCODING:
        out[f"_MEM_FORMAT_ENCODING.{member.name}"] = repr(sorted(vars(member).items()))
    return out


def _job(case: dict[str, Any]) -> dict[str, Any]:
    from checkpoint_helpers import ck_config
    from integrity_helpers import captured

    from torchtitan_spmd.train import run_job

    config = ck_config("default", "single", case["root"], steps=case.get("steps", 4), **case.get("checkpoint", {}))
    with captured() as (err, log):
        status = run_job(config)
    return {"status": status, "stderr": err.getvalue().splitlines(), "log": list(log)}


def _bench_read(case: dict[str, Any]) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("checkpoint_trust_versions",
                                                  os.path.join(ROOT, "bench", "checkpoint_trust_versions.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = module.read([case["folder"]])
    return {"status": status, "stdout": out.getvalue().splitlines()}


def main(spec_path: str, out_dir: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    signal.signal(signal.SIGALRM, _alarm)
    import torchtitan_spmd.train  # noqa: F401  (the imports are not any case's time)

    # plain str paths from here on: a case that replaced pathlib's operators (a finding) must
    # not stop the runner from reporting it
    for case in spec["cases"]:
        name = case["name"]
        with open(os.path.join(out_dir, "progress"), "a") as f:
            f.write(name + "\n")
        before, rss = _process_state(), _peak_rss_mib()
        begin = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, case.get("limit", 20))
        try:
            result = {"bench_read": _bench_read, "job": _job}[case["kind"]](case)
            result["hung"] = False
        except _Hung:
            result = {"hung": True}
        except BaseException:  # noqa: BLE001 - a traceback is a finding too
            result = {"hung": False, "traceback": traceback.format_exc()[-3000:]}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        after = _process_state()
        result.update(seconds=time.monotonic() - begin, rss_growth_mib=_peak_rss_mib() - rss,
                      changed=sorted(k for k in before if before[k] != after.get(k)))
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            f.write(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
