"""The yes / no cells of the support tables say what the trainer's set-up accepts.

The README's "Support" table and the full one in docs/backends-and-typechecking.md have one row
per feature and one column per backend. :data:`PROBES` maps each row (by the start of its first
cell) to a config that uses the feature: the job, the fields set, the world size. For every row
and backend the test builds that config and runs the trainer's own set-up checks
(``validate_job``: ``check_supported``, the degrees, the backend's, CP's, EP's, compile's ...;
``comm.mode="local_tensor"`` adds ``check_local_tensor``). A cell that starts with "no" must be a
setup error (``ValueError``/``TypeError``); "yes" (and anything else: "warns", "build on meta,
validate", "same") must be accepted. "(torch ≥ X)" in a cell makes it "no" on an older torch.
The torch-versions table's column of the installed torch is checked the same way.

Static: no mesh, no model weights, no training; each probe is the set-up checks alone.
A new row with no probe fails :func:`test_every_row_is_probed`: add one to :data:`PROBES`, or to
:data:`NOT_PROBED` with the reason.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("default", "full_dtensor", "spmd_types")
TABLES = {  # page -> the heading its table is under
    "README.md": "## Support",
    "docs/backends-and-typechecking.md": "## Support",
}
TORCH = Version(torch.__version__.split("+")[0])


@dataclass(frozen=True)
class Probe:
    """A config that uses one row's feature."""

    fields: dict[str, Any]
    """Dotted field -> value, set on the job."""

    world_size: int = 1
    job: str = "llama3_tiny"
    """The registry job to start from (``family_config``)."""

    needs_torch: str | None = None
    """A torch the feature needs even where the cell does not say so (a "yes" is a "no" below it)."""

    needs: tuple[str, ...] = ()
    """Packages of an extra the feature imports: where one is missing, a "yes" must be the setup
    error naming the extra instead (no skip)."""



def _dp(shard: int, replicate: int = 1) -> dict[str, Any]:
    return {"parallelism.data_parallel_shard_degree": shard, "parallelism.data_parallel_replicate_degree": replicate}


TP2 = {"parallelism.tensor_parallel_degree": 2, "parallelism.data_parallel_shard_degree": 1}
PP2 = {"parallelism.pipeline_parallel_degree": 2, "parallelism.data_parallel_shard_degree": 1}
CP2 = {"parallelism.context_parallel_degree": 2, "parallelism.data_parallel_shard_degree": 1}
MOE = "qwen3_moe_tiny"

#: The start of a row's first cell -> the config its cells are about.
PROBES: dict[str, Probe] = {
    # both tables
    "FSDP, HSDP": Probe(_dp(2, 2), world_size=4),
    "SPMD type checking": Probe({"debug.spmd_typechecking": True}),
    "context parallelism": Probe(CP2, world_size=2),
    "mixture of experts": Probe({}, job=MOE),
    "DeepSeek-V3": Probe({}, job="deepseek_v3_tiny"),
    "mixed precision": Probe({"training.mixed_precision_param": "bfloat16"}),
    # "dry run": the dry run accepts it (a real CPU run refuses it: tests/layer3_runtime/test_async_tp.py)
    "async TP": Probe({**TP2, "parallelism.enable_async_tensor_parallel": True, "compile.enable": True,
                       "comm.mode": "fake_backend"}, world_size=2),
    # README
    "TP + sequence parallel, loss parallel": Probe({**TP2, "parallelism.enable_sequence_parallel": True}, world_size=2),
    "pipeline parallelism, all seven": Probe({**PP2, "parallelism.pipeline_parallel_schedule": "Interleaved1F1B",
                                              "parallelism.pipeline_parallel_layers_per_stage": 1},
                                             world_size=2, job="llama3_debugmodel"),
    "expert parallelism": Probe({"parallelism.expert_parallel_degree": 2, **_dp(2)}, world_size=2, job=MOE),
    "mixed precision, activation checkpointing": Probe({"training.mixed_precision_param": "bfloat16",
                                                        "activation_checkpoint.mode": "selective",
                                                        "training.global_batch_size": 4,
                                                        "training.local_batch_size": 2}),
    "`torch.compile` of blocks and loss": Probe({"compile.enable": True, **TP2, "parallelism.enable_sequence_parallel": True},
                                                world_size=2),
    "checkpoints (DCP)": Probe({"checkpoint.enable": True, "checkpoint.async_mode": "async"}),
    "Hugging Face weights in and out": Probe({"checkpoint.enable": True, "checkpoint.last_save_in_hf": True,
                                              "hf_assets_path": str(ROOT / "tests/assets/tokenizer")},
                                             needs_torch="2.14", needs=("safetensors", "tokenizers")),
    "TensorBoard scalars": Probe({"metrics.enable_tensorboard": True}, needs=("tensorboard",)),
    "RoPE scaling": Probe({}, job="llama3_8b"),
    "tied embeddings": Probe({}, job="qwen3_0_6b"),
    "upstream's flavours and recipes": Probe({"model.flavor": "405B"}, job="llama3_debugmodel"),
    "`block_causal` packed documents": Probe({}, job="llama3_debugmodel_flex_attn"),
    "upstream's June (a0c831c49) and August": Probe({"training.max_context_length": 64,
                                                      "training.num_tokens_per_microbatch_per_dp_rank": 128}),
    "validator": Probe({"validator.enable": True, "validator.steps": 2, "metrics.enable_wandb": True,
                        "lr_scheduler.decay_type": "linear", "lr_scheduler.decay_ratio": 0.5}, needs=("wandb",)),
    "multi-node launch": Probe(_dp(4), world_size=4),
    "fault tolerance": Probe({"fault_tolerance.enable": True, "fault_tolerance.group_size": 2, **_dp(2)},
                             world_size=2, needs=("torchft",)),
    "dry run `comm.mode=fake_backend`": Probe({"comm.mode": "fake_backend", **_dp(4)}, world_size=4),
    "`comm.mode=local_tensor`": Probe({"comm.mode": "local_tensor", **TP2}, world_size=2),
    "loading a hostile checkpoint folder": Probe({"checkpoint.enable": True}),
    "model converters": Probe({}, job="llama3_debugmodel_float8_emulate_lora", needs=("torchao",)),
    "memory-budget AC, FSDP CPU offload": Probe({"activation_checkpoint.mode": "memory_budget"}),
    "experts on dim 1": Probe({"parallelism.expert_parallel_degree": 2, **_dp(4)}, world_size=4, job=MOE),
    # docs/backends-and-typechecking.md
    "TP + sequence parallel": Probe({**TP2, "parallelism.enable_sequence_parallel": True}, world_size=2),
    "loss parallel": Probe({**TP2, "parallelism.disable_loss_parallel": False}, world_size=2),
    "pipeline parallelism (torch's pipelining": Probe(
        {**PP2, "parallelism.pipeline_parallel_schedule": "ZBVZeroBubble",
         "parallelism.pipeline_parallel_layers_per_stage": 2, "activation_checkpoint.mode": "full"},
        world_size=2, job="llama3_debugmodel"),
    "CSV pipeline schedules": Probe({**PP2, "parallelism.pipeline_parallel_schedule_csv":
                                     str(ROOT / "tests/assets/pp_schedules/pp2_1f1b.csv"),
                                     "parallelism.pipeline_parallel_schedule": "1F1B"}, world_size=2),
    "expert parallelism (MoE experts": Probe({"parallelism.expert_parallel_degree": 2, **_dp(2)},
                                             world_size=2, job=MOE),
    "MoE × TP": Probe(TP2, world_size=2, job=MOE),
    "MoE × CP": Probe(CP2, world_size=2, job=MOE),
    "MoE × `torch.compile`": Probe({"compile.enable": True}, job=MOE),
    "MoE × PP": Probe(PP2, world_size=2, job=MOE),
    "activation checkpointing: `none`": Probe({"activation_checkpoint.mode": "full"}),
    "memory-budget activation checkpointing": Probe({"activation_checkpoint.mode": "memory_budget"}),
    "`torch.compile` of each block": Probe({"compile.enable": True}),
    "gradient accumulation": Probe({"training.global_batch_size": 4, "training.local_batch_size": 2}),
    "optimizer kernel": Probe({"optimizer.implementation": "foreach"}),
    "FSDP CPU offload": Probe({"training.enable_cpu_offload": True}),
    "full bf16 training": Probe({"training.dtype": "bfloat16"}),
    "scheduled GC": Probe({"training.gc_freq": 5, "training.gc_debug": True}),
    "checkpointing (torch DCP)": Probe({"checkpoint.enable": True, "checkpoint.async_mode": "async"}),
    "checkpoints through pinned shared memory": Probe({"checkpoint.async_mode": "async_with_pinned_mem"}),
    "Hugging Face safetensors weights": Probe({"checkpoint.enable": True, "checkpoint.last_save_in_hf": True},
                                              needs_torch="2.14", needs=("safetensors",)),
    "quantized Hugging Face checkpoints": Probe({"checkpoint.initial_load_in_hf_quantized": True}),
    "Hugging Face tokenizer": Probe({"hf_assets_path": str(ROOT / "tests/assets/tokenizer")}, needs=("tokenizers",)),
    "local datasets": Probe({"dataloader.dataset": "c4_test",
                             "dataloader.dataset_path": str(ROOT / "tests/assets/c4_test")}, needs=("datasets",)),
    "TensorBoard scalars and W&B values": Probe({"metrics.enable_tensorboard": True, "metrics.enable_wandb": True,
                                                 "metrics.save_for_all_ranks": True}, needs=("tensorboard", "wandb")),
    "communication timeouts": Probe({"comm.init_timeout_seconds": 100, "comm.train_timeout_seconds": 50}),
    "run outputs": Probe({"debug.print_config": True, "job.description": "x"}),
    "communication through torchcomms": Probe({"comm.mode": "torchcomms"}),
    "debug extras": Probe({"debug.detect_anomaly": True}),
}

#: Rows whose cells no set-up check can decide, with the reason.
NOT_PROBED: dict[str, str] = {
    "MoE × Hugging Face weights": "needs a transformers checkpoint folder (tests/layer3_runtime/test_hf_*)",
}


@dataclass
class Row:
    page: str
    line: int
    feature: str
    cells: dict[str, str]

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line} ({self.feature[:60]})"


def _split(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table_rows(page: str, heading: str) -> list[Row]:
    """The rows of the first table under ``heading`` whose columns name the three backends."""
    lines = (ROOT / page).read_text().splitlines()
    start = lines.index(heading)
    rows: list[Row] = []
    header: list[str] | None = None
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if line.startswith("## "):
            break
        if not line.startswith("|"):
            if header is not None and rows:
                break
            continue
        cells = _split(line)
        if header is None:
            if all(f"`{b}`" in cells for b in BACKENDS):
                header = cells
            continue
        if set(line.replace("|", "").strip()) <= set("-: "):
            continue
        assert len(cells) == len(header), f"{page}:{i + 1}: {len(cells)} cells, the header has {len(header)}"
        by = dict(zip(header, cells, strict=True))
        rows.append(Row(page, i + 1, cells[0], {b: by[f"`{b}`"] for b in BACKENDS}))
    assert rows, f"{page}: no support table under {heading!r}"
    return rows


ROWS = [row for page, heading in TABLES.items() for row in table_rows(page, heading)]


def _key(row: Row) -> str | None:
    """The longest key of PROBES / NOT_PROBED that starts the row's first cell."""
    keys = [k for k in (*PROBES, *NOT_PROBED) if row.feature.startswith(k)]
    return max(keys, key=len) if keys else None


def expected_accepted(cell: str, probe: Probe) -> bool:
    """What a cell says of the probe: True for accepted, False for a setup error."""
    text = cell.strip()
    accepted = not (text.startswith("no") and not text.startswith("no effect"))
    for needed in re.findall(r"torch ≥ (\d+\.\d+)", text) + ([probe.needs_torch] if probe.needs_torch else []):
        if TORCH < Version(needed):
            accepted = False
    return accepted


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # sys.modules[package] is None: blocked
        return False


def _set(obj: Any, dotted: str, value: Any) -> None:
    *path, name = dotted.split(".")
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, name, value)


def _job(name: str) -> Any:
    family = "deepseek_v3" if name.startswith("deepseek_v3") else name.split("_")[0]
    return getattr(importlib.import_module(f"torchtitan_spmd.models.{family}.config_registry"), name)()


def accepted(probe: Probe, backend: str) -> tuple[bool, str]:
    """Run the trainer's set-up checks on the probe's config; (accepted, the error's last line)."""
    from torchtitan_spmd import train
    from torchtitan_spmd.dry_run import check_local_tensor

    job = _job(probe.job)
    job.parallelism.spmd_backend = backend
    for dotted, value in probe.fields.items():
        _set(job, dotted, value)
    check: Callable[..., Any] = train.validate_job
    if job.comm.mode == "local_tensor":
        def check(config: Any, world: int, device: str) -> Any:
            return check_local_tensor(config, world, train.SETUP_PHASES)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check(job, probe.world_size, "cpu")
    except (ValueError, TypeError) as exc:
        return False, str(exc).strip().splitlines()[-1]
    return True, ""


def test_every_row_is_probed() -> None:
    missing = [row.where for row in ROWS if _key(row) is None]
    assert not missing, ("support-table rows with no probe (add one to PROBES in "
                         f"tests/docs/test_support_tables.py, or to NOT_PROBED with why): {missing}")
    unused = [k for k in (*PROBES, *NOT_PROBED) if not any(_key(row) == k for row in ROWS)]
    assert not unused, f"probes that start no table row (renamed or removed rows?): {unused}"


@pytest.mark.parametrize("row", [r for r in ROWS if _key(r) in PROBES], ids=lambda r: f"{r.page}:{r.line}")
def test_cells_say_what_the_setup_accepts(row: Row) -> None:
    probe = PROBES[_key(row)]  # type: ignore[index]
    # Without an extra's package, a "yes" is the setup error naming the extra (the README's promise).
    missing = [package for package in probe.needs if not _installed(package)]
    wrong = []
    for backend, cell in row.cells.items():
        want = expected_accepted(cell, probe)
        got, error = accepted(probe, backend)
        if want and missing:
            if got or 'pip install -e ".[' not in error:
                wrong.append(f"{backend}: {missing} not installed, but the set-up "
                             + ("accepts it" if got else f"does not name the extra: {error}"))
            continue
        if got != want:
            wrong.append(f"{backend}: the table says {cell[:50]!r}, but the set-up "
                         + ("accepts it" if got else f"refuses it: {error}"))
    assert not wrong, f"{row.where}, probed with {probe.fields} on {probe.job}:\n  " + "\n  ".join(wrong)


#: The torch-versions table of docs/backends-and-typechecking.md: the start of a row -> (backend, probe).
TORCH_PROBES: dict[str, tuple[str, Probe]] = {
    "`default` (FSDP, HSDP, TP + SP + loss parallel)": ("default", Probe({**_dp(2, 2), "parallelism.tensor_parallel_degree": 2,
                                                                        "parallelism.enable_sequence_parallel": True},
                                                                       world_size=8)),
    "`full_dtensor` with data parallelism": ("full_dtensor", Probe(_dp(2), world_size=2)),
    "`full_dtensor` TP + SP": ("full_dtensor", Probe({**TP2, "parallelism.enable_sequence_parallel": True}, world_size=2)),
    "`spmd_types` without data parallelism": ("spmd_types", Probe(TP2, world_size=2)),
    "`spmd_types` with FSDP": ("spmd_types", Probe(_dp(2), world_size=2)),
    "`spmd_types` type checking with activation checkpointing": ("spmd_types", Probe(
        {"debug.spmd_typechecking": True, "activation_checkpoint.mode": "full"})),
    "Hugging Face weights": ("default", Probe({"checkpoint.enable": True, "checkpoint.last_save_in_hf": True},
                                              needs=("safetensors",))),
}


def torch_table() -> tuple[str | None, list[tuple[int, str, str]]]:
    """(the header of the installed torch's column or None, [(line, row, that column's cell)])."""
    lines = (ROOT / "docs/backends-and-typechecking.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| | torch "))
    header = _split(lines[start])
    mine = [h for h in header if h.startswith("torch ")
            and Version(h.split()[1]).release[:2] == TORCH.release[:2]]
    rows = []
    for i in range(start + 2, len(lines)):
        if not lines[i].startswith("|"):
            break
        cells = _split(lines[i])
        assert len(cells) == len(header), f"docs/backends-and-typechecking.md:{i + 1}: wrong number of cells"
        rows.append((i + 1, cells[0], cells[header.index(mine[0])] if mine else ""))
    return (mine[0] if mine else None), rows


def test_torch_versions_table_says_what_this_torch_accepts() -> None:
    """The torch-versions table's column of the installed torch, row by row, against the set-up."""
    column, rows = torch_table()
    keys = {row: [k for k in TORCH_PROBES if row.startswith(k)] for _, row, _ in rows}
    assert all(keys.values()), f"torch-table rows with no probe in TORCH_PROBES: {[r for r, k in keys.items() if not k]}"
    if column is None:
        pytest.skip(f"the table has no column for torch {TORCH}")
    wrong = []
    for line, row, cell in rows:
        backend, probe = TORCH_PROBES[max(keys[row], key=len)]
        if not all(_installed(package) for package in probe.needs):
            continue  # an extra's package is missing: the main table's test checks its error
        got, error = accepted(probe, backend)
        if got != (not cell.startswith("no")):
            wrong.append(f"docs/backends-and-typechecking.md:{line} ({row[:50]}): the {column} column says {cell!r}, "
                         "but the set-up " + ("accepts it" if got else f"refuses it: {error}"))
    assert not wrong, "\n".join(wrong)
