"""Layer 3: the trainer end to end, as users run it: torchrun + the CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

_STEP = re.compile(r"^step: (\d+)\s+loss: ([0-9.]+)\s+grad_norm: ([0-9.]+)", re.M)


def _torchrun(tmp_path: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         "-m", "torchtitan_spmd.train", "--job.dump_folder", str(tmp_path), *args],
        capture_output=True, text=True, timeout=300, env=env,
    )


@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_torchrun_cli_trains(tmp_path: Path, backend: str) -> None:
    config = tmp_path / "job.toml"
    config.write_text(
        "[model]\nflavor = \"tiny\"\n\n[training]\nsteps = 4\nlocal_batch_size = 2\nseq_len = 32\n"
        "\n[optimizer]\nlr = 3e-3\n"
    )
    proc = _torchrun(
        tmp_path, "--job.config_file", str(config), "--parallelism.spmd_backend", backend,
        "--parallelism.tensor-parallel-degree", "2", "--debug.seed", "7", "--debug.deterministic",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = _STEP.findall(proc.stdout + proc.stderr)
    assert [int(s) for s, _, _ in steps] == [1, 2, 3, 4], proc.stdout + proc.stderr
    losses = [float(loss) for _, loss, _ in steps]
    assert losses[-1] < losses[0]
    assert f"spmd_backend={backend}" in proc.stdout + proc.stderr
    assert "degrees dp_replicate=1 dp_shard=1 cp=1 tp=2 pp=1 ep=1" in proc.stdout + proc.stderr


def test_torchrun_cli_rejects_bad_config_on_every_rank(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text("[training]\nsteps = 1\n")
    proc = _torchrun(tmp_path, "--job.config_file", str(config), "--parallelism.spmd_backend", "full_dtensr")
    assert proc.returncode != 0
    assert "Did you mean 'full_dtensor'?" in " ".join(proc.stderr.replace("│", " ").split())  # tyro's box
    assert proc.stderr.count("Value error") == 1, proc.stderr  # rank 0's box only


def test_torchrun_setup_error_is_printed_once(tmp_path: Path) -> None:
    """A setup error every rank has (degrees against the world size) is one ``error:`` line,
    not one per rank; each rank still exits 2 (torchrun reports 1)."""
    proc = _torchrun(tmp_path, "--module", "llama3", "--config", "llama3_tiny",
                     "--parallelism.tensor_parallel_degree", "4")
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert lines == ["error: ParallelDims: cannot infer dp_shard (-1): dp_replicate (1) * cp (1) * tp (4) * pp (1) "
                     "= 4 does not divide world_size (2)."], proc.stderr
    assert "exitcode  : 2" in proc.stderr, proc.stderr  # torchrun's summary names the first rank to exit


@pytest.mark.backend("default")
def test_torchrun_cli_resumes_under_another_backend(tmp_path: Path) -> None:
    """The README's cross-backend resume: 4 steps saving at 2 under default, then from step 2
    under full_dtensor, printing the same losses to the digits shown (within 1e-5)."""
    job = ["--module", "llama3", "--config", "llama3_tiny", "--training.steps", "4", "--debug.deterministic",
           "--parallelism.tensor_parallel_degree", "2", "--checkpoint.enable", "--checkpoint.interval", "2"]
    first = _torchrun(tmp_path, *job)
    assert first.returncode == 0, first.stderr[-3000:]
    other = _torchrun(tmp_path, *job, "--checkpoint.load_step", "2", "--checkpoint.load_only",
                      "--parallelism.spmd_backend", "full_dtensor")
    assert other.returncode == 0, other.stderr[-3000:]
    assert "checkpoint: loaded" in other.stdout + other.stderr
    steps = [[(int(s), float(loss)) for s, loss, _ in _STEP.findall(p.stdout + p.stderr)] for p in (first, other)]
    assert [s for s, _ in steps[0]] == [1, 2, 3, 4] and [s for s, _ in steps[1]] == [3, 4]
    assert all(abs(a - b) <= 1e-5 * b for (_, a), (_, b) in zip(steps[1], steps[0][2:], strict=True))


def test_torchrun_rerun_of_a_finished_run_is_one_error_line(tmp_path: Path) -> None:
    """Running a finished job again (its last save model-only) is one ``error:`` line naming how to
    start afresh, printed by rank 0 alone (every rank has the same decision, rank 0's)."""
    job = ["--module", "llama3", "--config", "llama3_tiny", "--training.steps", "2", "--checkpoint.enable",
           "--checkpoint.interval", "1", "--checkpoint.last_save_model_only"]
    first = _torchrun(tmp_path, *job)
    assert first.returncode == 0, first.stderr[-3000:]
    again = _torchrun(tmp_path, *job)
    assert again.returncode == 1
    lines = [line for line in again.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, again.stderr
    assert "holds only the model" in lines[0] and "give another --job.dump_folder or remove" in lines[0]


@pytest.mark.backend("spmd_types")
def test_torchrun_deepseek_v3_debugmodel_trains(tmp_path: Path) -> None:
    """``--module deepseek_v3 --config deepseek_v3_debugmodel`` as a new user runs it, shrunk to 2 steps
    of 1 x 32 tokens (CI time): FSDP 2 x EP 2 on 2 ranks under spmd_types, with the recipe's selective
    activation checkpointing (the separately sharded routed experts beside DeepSeek's shared experts:
    the recompute once failed with "invocation index 2 encountered during backward but not found in
    storage"); the loss goes down."""
    from torchtitan_spmd.distributed.representation import torch_at_least

    if not torch_at_least("2.14"):
        pytest.skip("FSDP over spmd_types-annotated tensors needs torch >= 2.14")
    proc = _torchrun(tmp_path, "--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel",
                     "--training.steps", "2", "--training.seq_len", "32", "--training.local_batch_size", "1",
                     "--parallelism.spmd_backend", "spmd_types", "--parallelism.data_parallel_shard_degree", "2",
                     "--parallelism.expert_parallel_degree", "2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model=deepseek_v3/debugmodel, degrees dp_replicate=1 dp_shard=2 cp=1 tp=1 pp=1 ep=2" in out, out
    saved = json.loads((tmp_path / "job_config.json").read_text())
    assert saved["activation_checkpoint"]["mode"] == "selective", saved["activation_checkpoint"]
    steps = _STEP.findall(out)
    assert [int(s) for s, _, _ in steps] == [1, 2], out
    losses = [float(loss) for _, loss, _ in steps]
    assert losses[1] < losses[0] - 0.1, losses


_EXIT_SCRIPT = """
import atexit, sys
from datetime import timedelta
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torchtitan_spmd import train

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD).wait()  # the collectives DTensor and FSDP2 run
dist.destroy_process_group()

class Finalized:
    def __del__(self):
        print("finalization ran", flush=True)

KEEP = Finalized()  # a module global: freed only by the interpreter's finalization
atexit.register(lambda: print("atexit ran", flush=True))
sys.stdout.write("unflushed line\\n")  # a pipe buffers it
train._exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize(("status", "atexit_runs"), [(0, True), (2, True), (1, False)])
def test_the_cli_exit_skips_the_finalization_that_meets_gloo_threads(status: int, atexit_runs: bool) -> None:
    """``python -m torchtitan_spmd.train`` ends through ``train._exit``: every ``atexit`` handler
    runs (not after a communication failure, status 1), buffered output is written, and the
    interpreter's finalization, which met gloo's threads left alive after ``destroy_process_group``
    and aborted a rank now and then (exit -6), does not run."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(status)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == status, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "unflushed line" in lines, proc.stdout
    assert ("atexit ran" in lines) is atexit_runs, proc.stdout
    assert "finalization ran" not in lines, proc.stdout
