"""The train command prints each line once per job, not once per rank, and no profiler noise on CPU.

One 4-rank run of ``torchtitan_spmd.train.main`` (PP 2 x FSDP 2, the profiler on, a warm-up longer
than the run, a setting that warns, a checkpoint each step), every rank's stdout and stderr captured
at the file descriptors (Kineto writes from C++), then counted together. Then a second model size
started on the same folder (4 ranks, stopped by the load): its one error line.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

import pytest

from torchtitan_spmd.launcher import run_forked

_ARGV = ["--module", "llama3", "--config", "llama3_tiny", "--training.steps", "2", "--training.seq_len", "32",
         "--training.local_batch_size", "2", "--training.device", "cpu",
         "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
         "--lr_scheduler.warmup_steps", "5", "--debug.spmd_typechecking",
         "--profiler.enable_profiling", "--profiler.profile_freq", "2", "--profiler.profiler_warmup", "0",
         "--profiler.profiler_active", "1", "--checkpoint.enable", "--checkpoint.interval", "1"]


def _as_a_process(rank: int, world_size: int, folder: str, extra: tuple[str, ...] = (),
                  name: str = "rank") -> tuple[int, str]:
    """``main`` on this rank as ``python -m torchtitan_spmd.train`` would run it: its own stdout and
    stderr (file descriptors too), Python's default warning filters, no pytest logging handlers."""
    from torchtitan_spmd.train import main

    path = os.path.join(folder, f"{name}{rank}.txt")
    out = open(path, "a", buffering=1)  # noqa: SIM115 - the process's streams until it ends
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    logging.getLogger("torchtitan_spmd").setLevel(logging.NOTSET)
    warnings.resetwarnings()
    for action, category in (("ignore", DeprecationWarning), ("ignore", PendingDeprecationWarning),
                             ("ignore", ImportWarning), ("ignore", ResourceWarning)):
        warnings.filterwarnings(action, category=category)
    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: out.write(
        warnings.formatwarning(message, category, filename, lineno, line))
    os.environ.pop("KINETO_LOG_LEVEL", None)
    status = main([*_ARGV, "--job.dump_folder", os.path.join(folder, "out"), *extra])
    out.flush()
    return status, Path(path).read_text()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("once"))


@pytest.fixture(scope="module")
def run(folder: str) -> list[tuple[int, str]]:
    return run_forked(_as_a_process, 4, folder, timeout_s=240)


def test_another_model_on_the_folder_is_one_error_line(run: list[tuple[int, str]], folder: str) -> None:
    """``debugmodel`` (dim 256) started on the folder ``tiny`` saved into (its newest save the
    model-only last one): one ``error:`` line in the 4 ranks' output, naming the shapes, the model
    the marker recorded and how to start afresh; exit 2 on every rank."""
    again = run_forked(_as_a_process, 4, folder, ("--model.flavor", "debugmodel"), "again", timeout_s=240)
    assert [status for status, _ in again] == [2, 2, 2, 2], _lines(again)
    errors = [line for line in _lines(again) if "error" in line.lower()]
    assert len(errors) == 1 and errors[0] == again[0][1].splitlines()[-1], errors
    assert errors[0].startswith("error: checkpoint step-2: saved from another model: 'tok_embeddings.weight' "
                                "has shape (320, 64) there and (320, 256) in this model; its marker records the "
                                "model 'llama3/tiny', this run's is 'llama3/debugmodel'; to start afresh, give "
                                "another --job.dump_folder or remove "), errors


def _lines(run: list[tuple[int, str]]) -> list[str]:
    return [line for _, text in run for line in text.splitlines()]


def test_every_rank_finishes(run: list[tuple[int, str]]) -> None:
    assert [status for status, _ in run] == [0, 0, 0, 0], _lines(run)


@pytest.mark.parametrize("needle", ["job: ", "torchtitan_spmd: 4 rank(s) on cpu", "MFU: ",
                                    "lr_scheduler.warmup_steps=5 exceeds the 2 steps",
                                    "saved the resolved config", "profiling: traces", "done: loss",
                                    "debug.spmd_typechecking=True has no effect", "step: 1 ", "step: 2 ",
                                    "checkpoint/step-1 (full)", "checkpoint/step-2 (model only)"])
def test_each_line_is_printed_once_per_job(run: list[tuple[int, str]], needle: str) -> None:
    found = [line for line in _lines(run) if needle in line]
    assert len(found) == 1, found


def test_each_pipeline_stage_line_names_the_ranks_it_covers(run: list[tuple[int, str]]) -> None:
    stages = sorted(line for line in _lines(run) if line.startswith("pipeline: "))
    assert len(stages) == 2, stages
    assert stages[0].startswith("pipeline: stages [0] of 2 on ranks 0, 1 hold [['tok_embeddings', 'layers.0']]")
    assert stages[1].startswith("pipeline: stages [1] of 2 on ranks 2, 3 hold [['layers.1', 'norm', 'output']]")


@pytest.mark.parametrize("noise", ["USDT", "gpuGetDeviceCount", "Profiler won't be using warmup",
                                   "Profiler clears events", "Completed Stage", "<frozen"])
def test_no_profiler_or_kineto_noise_on_cpu(run: list[tuple[int, str]], noise: str) -> None:
    assert not [line for line in _lines(run) if noise in line]


def test_the_job_header_comes_first(run: list[tuple[int, str]]) -> None:
    lines = [line for line in run[0][1].splitlines()  # the parser's warnings of the config come before
             if not line.startswith(("pipeline: ", "  ")) and "Warning: " not in line]
    assert lines[0] == "job: torchtitan_spmd job", lines[:4]
    assert lines[1].startswith("torchtitan_spmd: 4 rank(s)"), lines[:4]
    first = {key: next(i for i, line in enumerate(lines) if key in line) for key in ("MFU: ", "step: 1 ")}
    assert 1 < first["MFU: "] < first["step: 1 "]


def test_nothing_but_errors_on_other_ranks(run: list[tuple[int, str]]) -> None:
    """Ranks 1 and 3 hold no first line of a stage group: they print nothing at all."""
    assert run[1][1] == "" and run[3][1] == "", (run[1][1], run[3][1])
    assert run[2][1].splitlines() == [line for line in run[2][1].splitlines() if line.startswith("pipeline: ")]


def test_kineto_is_left_alone_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan_spmd.tools import profiler

    monkeypatch.setenv("KINETO_LOG_LEVEL", "0")
    profiler.quiet_kineto()
    assert os.environ["KINETO_LOG_LEVEL"] == "0"
    monkeypatch.delenv("KINETO_LOG_LEVEL")
    profiler.quiet_kineto()
    assert os.environ["KINETO_LOG_LEVEL"] == profiler._KINETO_QUIET


