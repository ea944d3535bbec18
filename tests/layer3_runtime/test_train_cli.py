"""Layer 3: the trainer end to end, as users run it: torchrun + the CLI."""

from __future__ import annotations

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


def test_torchrun_cli_rejects_bad_config_on_every_rank(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text("[training]\nsteps = 1\n")
    proc = _torchrun(tmp_path, "--job.config_file", str(config), "--parallelism.spmd_backend", "full_dtensr")
    assert proc.returncode != 0
    assert "Did you mean 'full_dtensor'?" in " ".join(proc.stderr.replace("│", " ").split())  # tyro's box


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
