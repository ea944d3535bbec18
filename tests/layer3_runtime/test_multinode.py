"""Layer 3: a multi-node launch, as docs/multi-node.md shows it, run as two nodes on one machine.

Two torchrun agents (``--nnodes 2``, node ranks 0 and 1, one rank each) meet through c10d
rendezvous on localhost; their run's losses equal one agent's run with the same two ranks.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

_STEP = re.compile(r"^step: (\d+)\s+loss: ([0-9.]+)", re.M)
_JOB = ["-m", "torchtitan_spmd.train", "--module", "llama3", "--config", "llama3_debugmodel",
        "--model.flavor", "tiny", "--training.steps", "3", "--training.local_batch_size", "2",
        "--training.seq_len", "16", "--training.device", "cpu", "--training.mixed_precision_param", "float32",
        "--activation_checkpoint.mode", "none", "--lr_scheduler.warmup_steps", "1", "--debug.seed", "3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _losses(output: str) -> list[float]:
    return [float(loss) for _, loss in _STEP.findall(output)]


def test_two_agents_on_localhost_train_as_one(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "torch.distributed.run"]
    single = subprocess.run([*run, "--standalone", "--nproc-per-node", "2", *_JOB, "--job.dump_folder",
                             str(tmp_path / "one")], capture_output=True, text=True, timeout=300, env=env)
    assert single.returncode == 0, single.stderr[-3000:]
    port = _free_port()
    agents = [subprocess.Popen(
        [*run, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "i35", *_JOB,
         "--job.dump_folder", str(tmp_path / "two")],  # one config on every rank
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for node in (0, 1)]
    outputs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=300)
            outputs.append(out)
            assert agent.returncode == 0, out[-3000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    want = _losses(single.stdout + single.stderr)
    got = [_losses(out) for out in outputs]
    assert len(want) == 3
    # rank 0 logs: it is on one of the two agents (c10d may give node 0 either global rank)
    logged = [g for g in got if g]
    assert len(logged) == 1 and logged[0] == want, (got, want)
    assert "torchtitan_spmd: 2 rank(s) on cpu" in "".join(outputs)
