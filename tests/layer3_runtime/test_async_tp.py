"""Async tensor parallelism (issue 41; upstream #4045): ``parallelism.enable_async_tensor_parallel``.

- A real CPU run refuses it at setup in one line naming the field and why (no symmetric memory).
- June's field needs the blocks compiled (upstream's ``maybe_enable_async_tp`` check), one line.
- The dry run (``comm.mode="fake_backend"``) accepts it, with the same bytes as without it.
- On CUDA (``nox -s gpu_tests``): wired as upstream (symmetric memory on the TP group, inductor's
  micro-pipeline TP); with 2 GPUs, TP 2 trains on the curve of the same run without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan_spmd.config import JobConfig


def _job(tp: int = 2, *, compile_model: bool = True) -> JobConfig:
    cfg = JobConfig.from_dict({
        "model": {"name": "llama3", "flavor": "tiny"},
        "training": {"steps": 1, "local_batch_size": 2, "seq_len": 32, "mixed_precision_param": "float32"},
        "parallelism": {"data_parallel_shard_degree": 1, "tensor_parallel_degree": tp,
                        "enable_async_tensor_parallel": True},
        "compile": {"enable": compile_model},
    })
    cfg.validate()
    return cfg


def test_a_cpu_run_refuses_async_tp_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_spmd.train", "--module", "llama3", "--config", "llama3_tiny",
         "--parallelism.enable_async_tensor_parallel", "--compile.enable", "--job.dump_folder", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
        # not a flight-recorder path an earlier in-process trainer of this worker left in os.environ
        env={**{k: v for k, v in os.environ.items() if not k.startswith("TORCH_FR_")}, "CUDA_VISIBLE_DEVICES": ""})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "parallelism.enable_async_tensor_parallel=True needs CUDA" in lines[0], lines
    assert "symmetric memory" in lines[0] and "--parallelism.no-enable-async-tensor-parallel" in lines[0], lines


def test_augusts_field_is_refused_on_cpu_and_accepted_by_the_dry_run() -> None:
    """b5bcd76's ``compile.enable_async_tensor_parallel`` (its own "requires compile" check is in
    ``CompileConfig``): the same set-up decision as June's field."""
    from torchtitan_spmd.train import validate_job

    cfg = _job()
    cfg.parallelism.enable_async_tensor_parallel = False
    cfg.compile.components = ["model"]
    cfg.compile.enable_async_tensor_parallel = True
    with pytest.raises(ValueError, match=r"^compile.enable_async_tensor_parallel=True needs CUDA"):
        validate_job(cfg, 2, "cpu")
    cfg.comm.mode = "fake_backend"
    validate_job(cfg, 2, "cpu")


def test_junes_field_needs_the_blocks_compiled() -> None:
    from torchtitan_spmd.train import validate_job

    cfg = _job(compile_model=False)
    cfg.comm.mode = "fake_backend"  # even a dry run: upstream's own check
    with pytest.raises(ValueError, match=r"^parallelism.enable_async_tensor_parallel=True requires compile.enable"):
        validate_job(cfg, 2, "cpu")


def _dry_run_bytes(cfg: JobConfig, world: int) -> list[tuple[int, int, int, dict[str, int]]]:
    from torchtitan_spmd.train import dry_run

    return [(r.param_bytes, r.grad_bytes, r.optimizer_bytes, r.comm_bytes_per_step) for r in dry_run(cfg, world).roles]


@pytest.mark.backend("default")
def test_the_dry_run_accepts_async_tp() -> None:
    from torchtitan_spmd.launcher import run_isolated

    cfg = _job()
    cfg.comm.mode = "fake_backend"
    with_async = run_isolated(_dry_run_bytes, cfg, 2, timeout_s=600)
    cfg.parallelism.enable_async_tensor_parallel = False
    assert with_async == run_isolated(_dry_run_bytes, cfg, 2, timeout_s=600)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (nox -s gpu_tests)")
def test_async_tp_on_cuda_is_wired_as_upstream(tmp_path: Path) -> None:
    """One GPU: TP 1 leaves it off, as upstream (only a TP mesh turns it on). Two GPUs: TP 2 under
    torchrun with the blocks compiled trains 3 steps on the losses of the same run without async TP
    (written without a GPU to run it on; the CPU tests cover the refusal and the dry run)."""
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims
    from torchtitan_spmd.techniques.compile import maybe_enable_async_tp

    single = ParallelDims.from_config(_job(tp=1).parallelism, 1, device_type="cuda")
    assert maybe_enable_async_tp(_job(tp=1), single, "cuda") is False
    if torch.cuda.device_count() < 2:
        pytest.skip("TP 2 with async TP needs 2 CUDA devices")

    def losses(*extra: str) -> list[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "-m", "torchtitan_spmd.train", "--module", "llama3", "--config", "llama3_debugmodel",
             "--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--training.steps", "3",
             "--training.device", "cuda", "--debug.seed", "0", "--debug.deterministic",
             "--job.dump_folder", str(tmp_path / str(len(extra))), *extra],
            capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [line.split("loss:")[1].split()[0] for line in proc.stdout.splitlines() if "loss:" in line]

    plain, overlapped = losses(), losses("--parallelism.enable_async_tensor_parallel")
    assert len(plain) == 3 and [float(x) for x in overlapped] == pytest.approx([float(x) for x in plain], rel=1e-3)
