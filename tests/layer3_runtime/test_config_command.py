"""``python -m torchtitan_spmd.config`` refuses what the trainer would: exit 2 and the trainer's own line."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from torchtitan_spmd.config import ConfigManager
from torchtitan_spmd.config.__main__ import main as config_main
from torchtitan_spmd.launcher import run_forked

_JOB = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.device", "cpu"]


def _trainer_lines(rank: int, world_size: int, argv: list[str]) -> tuple[int, list[str]]:
    """The trainer's exit status and stderr lines for ``argv`` on this rank (``run_job``, as the command runs it)."""
    from torchtitan_spmd.config.manager import LIBRARY_FIRST
    from torchtitan_spmd.train import run_job

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = run_job(ConfigManager(module_packages=LIBRARY_FIRST).parse_args(argv))
    return status, err.getvalue().splitlines()


def test_the_config_command_refuses_an_unknown_flavour_with_the_trainers_line() -> None:
    argv = [*_JOB, "--model.flavor", "8b"]
    done = subprocess.run([sys.executable, "-m", "torchtitan_spmd.config", *argv], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: unknown model.flavor '8b' for model.name='llama3'") and "8B" in line
    [(status, trainer)] = run_forked(_trainer_lines, 1, argv, timeout_s=120)
    assert (status, trainer) == (2, [line])


@pytest.mark.parametrize(("extra", "needle"), [
    (["--parallelism.tensor_parallel_degree", "3", "--world-size", "4"], "does not divide world_size (4)"),
    (["--training.global_batch_size", "6", "--world-size", "4"], "training.global_batch_size=6"),
    (["--world-size", "0"], "--world-size must be an integer >= 1"),
])
def test_degrees_against_a_world_size_and_recipe_errors_exit_2(capsys: pytest.CaptureFixture[str],
                                                               extra: list[str], needle: str) -> None:
    assert config_main([*_JOB, *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("error: ") and needle in err, err


def test_a_good_config_for_a_world_size_still_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert config_main([*_JOB, "--parallelism.tensor_parallel_degree", "2", "--world-size", "4"]) == 0
    out, err = capsys.readouterr()
    assert "tensor_parallel_degree = 2" in out and "error" not in err
