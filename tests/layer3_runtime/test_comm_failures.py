"""A stalled or dead rank ends the job; the torchrun environment and single-process runs.

The stall and kill tests run the real CLI under torchrun on 4 gloo ranks (FSDP 2 x TP 2,
so the collectives that wait are on the sub-mesh groups, not only the world group), stop
or kill rank 1 once step 3 is logged, and require the job to end non-zero within
``comm.train_timeout_seconds`` plus a minute (the issue's bound), each surviving rank that
reports (torchrun ends the others once the first exits) in one line naming the collective.
``comm.init_timeout_seconds`` is set far above the bound, so a job that kept the init timeout after the first step, or left a
sub-mesh group on torch's 30-minute default, overruns it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtitan_spmd import train
from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.distributed import comm

TRAIN_TIMEOUT_S = 5
INIT_TIMEOUT_S = 600  # far past the bound: only the train timeout can end the job in time
BOUND_S = TRAIN_TIMEOUT_S + 60
WORLD = 4

_JOB = ["--module", "llama3", "--config", "llama3_debugmodel", "--model.flavor", "tiny",
        "--training.steps", "100000", "--training.local_batch_size", "2", "--training.seq_len", "32",
        "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1"]


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if os.path.exists(f"/proc/{pid}/cmdline") else b""
    if b"torchtitan_spmd.train" not in cmdline or b"torch.distributed.run" in cmdline:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _run_and_break(tmp_path: Path, sig: signal.Signals) -> tuple[int | None, float, str]:
    """Start the job, send ``sig`` to rank 1 after step 3; (exit code or None, seconds from the
    signal to the end, output)."""
    log = tmp_path / "out.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           "-m", "torchtitan_spmd.train", *_JOB, "--job.dump_folder", str(tmp_path / "dump"),
           "--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
           "--comm.init_timeout_seconds", str(INIT_TIMEOUT_S),
           "--comm.train_timeout_seconds", str(TRAIN_TIMEOUT_S)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while "step: 3 " not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the job did not reach step 3 (exit {proc.returncode}):\n"
                                     f"{log.read_text()[-3000:]}")
            time.sleep(0.2)
        victim = next(p for p in _children(proc.pid) if _rank_of(p) == 1)
        os.kill(victim, sig)
        sent = time.monotonic()
        try:
            rc: int | None = proc.wait(timeout=BOUND_S + 30)  # a little past the bound: to measure it
        except subprocess.TimeoutExpired:
            rc = None
        return rc, time.monotonic() - sent, log.read_text()
    finally:
        if proc.poll() is None:
            for pid in _children(proc.pid):
                for s in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, s)
                    except ProcessLookupError:
                        pass
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


_REPORT = re.compile(r"^error: rank (\d+): (.*)$", re.M)


def _check_reports(out: str, *what: str) -> None:
    """Each line comes from a surviving rank and names the collective, its caller and ``what``; at
    least one survivor reports. (Once the first rank exits, torchrun SIGTERMs the rest: a survivor
    still waiting out its own timeout then ends without a line, so not every one always prints.)"""
    reports = {int(r): line for r, line in _REPORT.findall(out)}
    assert reports and set(reports) <= {0, 2, 3}, out[-4000:]
    for line in reports.values():
        assert any(w in line for w in what) and "in step " in line, line
        # The collective, named from the flight recorder, and where in the project it was called.
        assert re.search(r"(allreduce|all_reduce|allgather|all_gather|reduce_scatter|broadcast|barrier)", line,
                         re.I), line
        assert "called from torchtitan_spmd/" in line, line


@pytest.mark.multiproc
def test_a_stalled_rank_ends_the_job_within_the_train_timeout(tmp_path: Path) -> None:
    rc, seconds, out = _run_and_break(tmp_path, signal.SIGSTOP)
    print(f"\nSIGSTOP: exit {rc} after {seconds:.1f} s", *(m.group(0) for m in _REPORT.finditer(out)), sep="\n")
    assert rc is not None and seconds <= BOUND_S, f"still running {seconds:.0f} s after SIGSTOP:\n{out[-3000:]}"
    assert rc != 0
    _check_reports(out, f"timed out after comm.train_timeout_seconds={TRAIN_TIMEOUT_S} s (a peer rank stalled")


@pytest.mark.multiproc
def test_a_killed_rank_ends_the_job_within_the_train_timeout(tmp_path: Path) -> None:
    rc, seconds, out = _run_and_break(tmp_path, signal.SIGKILL)
    print(f"\nSIGKILL: exit {rc} after {seconds:.1f} s", *(m.group(0) for m in _REPORT.finditer(out)), sep="\n")
    assert rc is not None and seconds <= BOUND_S, f"still running {seconds:.0f} s after SIGKILL:\n{out[-3000:]}"
    assert rc != 0
    _check_reports(out, "a peer rank closed the connection (it crashed or was killed) during ",
                   f"timed out after comm.train_timeout_seconds={TRAIN_TIMEOUT_S} s")


# ----------------------------------------------------------------------------- environment
@pytest.mark.parametrize(
    ("env", "missing"),
    [({"WORLD_SIZE": "2"}, "RANK, MASTER_ADDR, MASTER_PORT"),
     ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT")],
)
def test_a_half_set_torchrun_environment_is_one_line_naming_the_missing_variables(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], env: dict[str, str],
        missing: str) -> None:
    for name in comm.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert train.main(["--module", "llama3", "--config", "llama3_debugmodel", "--model.flavor", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: incomplete torchrun environment: ") and f"but {missing} not" in err, err


def test_a_malformed_torchrun_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"RANK='2' must be an integer in \[0, 1\]"):
        comm.init_default_process_group("gloo", __import__("datetime").timedelta(seconds=5))


@pytest.mark.multiproc
def test_single_process_runs_need_no_port_and_write_their_outputs_to_the_dump_folder(tmp_path: Path) -> None:
    """Two at once (the old fixed port failed the second with EADDRINUSE); each logs its
    ``job.description`` and writes its resolved config under its ``job.dump_folder``."""
    env = {k: v for k, v in os.environ.items() if k not in comm.TORCHRUN_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    extra = [[], ["--debug.save_config_file", "sub/again.json", "--debug.print_config"]]
    procs = [subprocess.Popen([sys.executable, "-m", "torchtitan_spmd.train", *_JOB, "--training.steps", "2",
                               "--job.dump_folder", str(tmp_path / f"run{i}"), "--job.description", f"run {i} of 2",
                               "--debug.seed", str(10 + i), *extra[i]],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, out[-3000:]
        assert "step: 2 " in out and f"job: run {i} of 2" in out, out[-3000:]
        saved = JobConfig.from_dict(json.loads((tmp_path / f"run{i}" / "job_config.json").read_text()))
        assert saved.job.description == f"run {i} of 2" and saved.debug.seed == 10 + i
        assert saved.job.dump_folder == str(tmp_path / f"run{i}") and saved.training.steps == 2
    again = tmp_path / "run1" / "sub" / "again.json"
    assert json.loads(again.read_text()) == json.loads((tmp_path / "run1" / "job_config.json").read_text())
    assert "Running with configs: {" in outs[1] and "Running with configs" not in outs[0]


def test_a_bad_omp_num_threads_is_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "0")
    assert train.main(["--module", "llama3", "--config", "llama3_debugmodel"]) == 2
    assert capsys.readouterr().err.strip() == "error: environment variable OMP_NUM_THREADS='0' must be an integer >= 1."
