"""Fault tolerance with torchft (``[fault_tolerance]``): replica groups as real forked gloo process
trees, torchft's Lighthouse on loopback in this process.

- no failure: 2 groups x FSDP 2 train as plain HSDP 2 x 2 does (same losses, same parameters),
  and only the group of smallest live replica id saves checkpoints;
- a group SIGKILLed mid-run: the survivor goes on alone (its steps average over the live group
  only, and no step waits past the timeouts); the group restarted later heals from it, and its
  parameters, optimizer state, schedule and data position equal the survivor's bitwise;
- a SIGSTOPped group is dropped from the quorum, not waited on;
- DiLoCo's outer step against a restatement here (outer Nesterov SGD on the averaged
  pseudo-gradient);
- a bad field and a missing Lighthouse are one line.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import pytest
from parity_helpers import job_config, warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

torchft = pytest.importorskip("torchft", reason="torchft is the ft extra (pip install -e '.[ft]')")

from torchtitan_spmd.tools.ft_launch import ForkedGroup, start_lighthouse  # noqa: E402

pytestmark = pytest.mark.multiproc

#: Every torchft wait here: process group operations, manager RPCs (fault_tolerance.process_group_timeout_ms).
PG_TIMEOUT_MS = 2000
#: The Lighthouse drops a group silent for this long.
HEARTBEAT_MS = 1000
#: How long the Lighthouse waits for a group it knows (heartbeating) before a quorum goes without
#: it: longer than a step here, so that live groups share every quorum (shorter, a busy group
#: misses its quorum and trains alone for a step: torchft's fast quorum with min_replicas 1).
JOIN_MS = 2000
#: A named parameter whose shards the parity test compares.
NAMED = "layers.0.attention.wq.weight"


def _config(replica_id: int | None, *, ranks: int, steps: int, dump: str = "", **ft: Any) -> JobConfig:
    """The tiny Llama, FSDP over ``ranks`` in a group; AdamW with a large eps, so an update is
    about lr x gradient (AdamW alone hides a gradient's scale)."""
    parallelism: dict[str, Any] = {"data_parallel_shard_degree": ranks}
    if replica_id is None:  # the reference: plain HSDP over 2 x ranks in one launch
        parallelism["data_parallel_replicate_degree"] = 2
    cfg = job_config("default", parallelism, local_batch=2, steps=steps)
    cfg.optimizer.eps = 1.0
    cfg.comm.train_timeout_seconds = 20
    if dump:
        cfg.job.dump_folder = dump
    if replica_id is not None:
        cfg.fault_tolerance.enable = True
        cfg.fault_tolerance.group_size = 2
        cfg.fault_tolerance.replica_id = replica_id
        cfg.fault_tolerance.process_group_timeout_ms = PG_TIMEOUT_MS
        for key, value in ft.items():
            setattr(cfg.fault_tolerance, key, value)
    cfg.validate()
    return cfg


def _digest(tensors: list[Any]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def _state_of(trainer: Any) -> dict[str, Any]:
    """This rank's final state: parameter shards, optimizer state, schedule, data position (bitwise digests)."""
    from torch.distributed.tensor import DTensor

    def local(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    params = dict(trainer.model.named_parameters())
    opt = trainer.optimizer
    moments = [local(v) for p in params.values() for k, v in sorted(opt.state.get(p, {}).items()) if k != "step"]
    steps = [float(opt.state[p]["step"]) for p in params.values() if p in opt.state]
    return {
        "params": _digest([local(params[n]) for n in sorted(params)]),
        "moments": _digest(moments) if moments else None,
        "optim_steps": sorted(set(steps)),
        "lr_epoch": trainer.scheduler.last_epoch,
        "data": trainer.dataloader.state_dict(),
        "named": local(params[NAMED]).tolist(),
    }


def _train(rank: int, world: int, cfg: JobConfig, progress: str | None, step_sleep: float,
           stall_at: int | None = None, ready: str | None = None,
           gate: tuple[int, str] | None = None) -> dict[str, Any]:
    """One rank of a group (or of the reference): run the trainer; record each step's end time
    (and write the step to ``progress``). ``stall_at``: this process SIGSTOPs itself just before
    the ``stall_at``-th cross-group all-reduce it shares with another group, so its peer is
    inside its own (a hung host mid-step). ``ready``: a file written once the trainer (and its
    torchft manager) exists. ``gate``: after step ``gate[0]``, wait for the file ``gate[1]`` (so a
    restarted group is up before the survivor's last steps, whatever the machine's load)."""
    import signal

    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    if ready and rank == 0:
        with open(ready, "w") as f:
            f.write("up")
    if stall_at is not None:
        sync, calls = trainer.ft.sync_gradients, [0]

        def stalling_sync(model: Any, loss: float) -> float:
            calls[0] += trainer.ft.num_participants() == 2  # steps shared with the other group
            if calls[0] == stall_at:
                os.kill(os.getpid(), signal.SIGSTOP)
            return sync(model, loss)

        trainer.ft.sync_gradients = stalling_sync
    times: list[float] = []
    paused = [0.0]
    before: dict[int, tuple[str, str | None]] = {}  # step -> (params, moments) digests as it starts
    inner_step = trainer.step

    def step(n: int) -> Any:
        state = _state_of(trainer)
        before[n] = (state["params"], state["moments"])
        record = inner_step(n)
        times.append(time.monotonic() - paused[0])  # the gate's wait is the test's, not a step's
        if progress and rank == 0:
            with open(progress, "w") as f:
                f.write(str(n))
        time.sleep(step_sleep)
        if gate is not None and n == gate[0]:
            start = time.monotonic()
            _wait_for_file(gate[1])
            paused[0] += time.monotonic() - start
        return record

    trainer.step = step  # type: ignore[method-assign]
    try:
        records = trainer.run()
        ft = trainer.ft
        return {"records": [(r.step, r.loss, r.committed, r.replica_groups) for r in records], "times": times,
                "before": before,
                "heals": list(ft.heals) if ft else [], **_state_of(trainer)}
    finally:
        trainer.close()


def _wait_for_file(path: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} within {timeout_s:.0f} s")
        time.sleep(0.02)


def _wait_for_step(path: str, step: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                if int(f.read() or 0) >= step:
                    return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.02)
    raise TimeoutError(f"no step {step} in {path}")


# ---------------------------------------------------------------------------------------- no failure
STEPS = 3


@pytest.fixture(scope="module")
def no_failure(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 groups x 2 ranks (FSDP 2 inside), every group saving its last step if it is the
    writer; and the reference, HSDP 2 x 2 in one launch."""
    warm_parent()
    root = tmp_path_factory.mktemp("ft")
    lighthouse = start_lighthouse(2, heartbeat_timeout_ms=HEARTBEAT_MS)
    try:
        groups = []
        for i in range(2):
            cfg = _config(i, ranks=2, steps=STEPS, dump=str(root / f"group{i}"))
            cfg.checkpoint.enable, cfg.checkpoint.interval = True, STEPS
            groups.append(ForkedGroup(_train, 2, cfg, None, 0.0, lighthouse=lighthouse.address(), timeout_s=120))
        results = [g.result() for g in groups]
    finally:
        lighthouse.shutdown()
    reference = run_forked(_train, 4, _config(None, ranks=2, steps=STEPS), None, 0.0, timeout_s=120)
    return {"groups": results, "reference": reference, "root": root,
            "work_dirs": [g.work_dir for g in groups]}


def test_two_groups_train_as_hsdp(no_failure: dict[str, Any]) -> None:
    ref = no_failure["reference"]
    for group in no_failure["groups"]:
        for rank, out in enumerate(group):
            assert [r[3] for r in out["records"]] == [2] * STEPS and all(r[2] for r in out["records"])
            assert [r[0] for r in out["records"]] == list(range(1, STEPS + 1))
            ref_losses = [r[1] for r in ref[0]["records"]]
            assert [r[1] for r in out["records"]] == pytest.approx(ref_losses, rel=1e-5)
            # the named parameter's shard on this rank = the same shard in HSDP (rank = shard index)
            mine, theirs = out["named"], ref[rank]["named"]
            flat_m = [x for row in mine for x in row]
            flat_t = [x for row in theirs for x in row]
            assert max(abs(a - b) for a, b in zip(flat_m, flat_t, strict=True)) < 1e-6
    # and both groups hold the same weights
    assert no_failure["groups"][0][0]["params"] == no_failure["groups"][1][0]["params"]


def test_a_groups_folder_is_removed_once_it_ended(no_failure: dict[str, Any],
                                                 kill_and_heal: dict[str, Any]) -> None:
    """Each group's temporary folder goes once its result was read or it was killed (the killed
    group's too): a job of many groups leaves none behind."""
    dirs = no_failure["work_dirs"] + kill_and_heal["work_dirs"]
    assert len(dirs) == 5 and not [d for d in dirs if os.path.exists(d)], dirs


def test_only_the_first_live_group_saves_checkpoints(no_failure: dict[str, Any]) -> None:
    root = no_failure["root"]
    saved = {i: sorted(os.listdir(root / f"group{i}" / "checkpoint")) if (root / f"group{i}" / "checkpoint").exists()
             else [] for i in range(2)}
    assert saved[0] == [f"step-{STEPS}"], saved
    assert saved[1] == [], saved


# ---------------------------------------------------------------------------------------- kill and heal
KILL_STEPS, KILL_AT, RESTART_AT = 12, 3, 6


@pytest.fixture(scope="module")
def kill_and_heal(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 groups x 1 rank; group 1 SIGKILLed once group 0 finished step 3, restarted once it finished step 6."""
    warm_parent()
    root = tmp_path_factory.mktemp("ftkill")
    progress = str(root / "progress0")
    lighthouse = start_lighthouse(1, join_timeout_ms=JOIN_MS, heartbeat_timeout_ms=HEARTBEAT_MS)
    try:
        up = str(root / "returned_up")
        survivor = ForkedGroup(_train, 1, _config(0, ranks=1, steps=KILL_STEPS), progress, 0.15, None, None,
                               (RESTART_AT, up), lighthouse=lighthouse.address(), timeout_s=120)
        victim = ForkedGroup(_train, 1, _config(1, ranks=1, steps=KILL_STEPS), None, 0.15,
                             lighthouse=lighthouse.address(), timeout_s=120)
        _wait_for_step(progress, KILL_AT)
        victim.kill()
        _wait_for_step(progress, RESTART_AT)  # the survivor then waits for the returned group's manager
        returned = ForkedGroup(_train, 1, _config(1, ranks=1, steps=KILL_STEPS), None, 0.0, None, up,
                               lighthouse=lighthouse.address(), timeout_s=120)
        out = {"survivor": survivor.result()[0], "returned": returned.result()[0],
               "work_dirs": [g.work_dir for g in (survivor, victim, returned)]}
    finally:
        lighthouse.shutdown()
    return out


def test_survivor_trains_on_alone_without_long_waits(kill_and_heal: dict[str, Any]) -> None:
    survivor = kill_and_heal["survivor"]
    committed = [r[0] for r in survivor["records"] if r[2]]
    # every step committed once, in order (from 1, or after healing if the other group started first)
    assert committed == list(range(committed[0], KILL_STEPS + 1)) and committed[0] <= KILL_AT, committed
    assert any(r[3] == 1 for r in survivor["records"])  # it did train alone
    gaps = [b - a for a, b in zip(survivor["times"], survivor["times"][1:], strict=False)]
    assert max(gaps) < 0.15 + (PG_TIMEOUT_MS + HEARTBEAT_MS) / 1000 + 1.0, gaps


def test_alone_the_step_averages_over_the_live_group_only(kill_and_heal: dict[str, Any]) -> None:
    records = kill_and_heal["survivor"]["records"]
    together = [r[1] for r in records if r[2] and r[3] == 2]
    alone = [r[1] for r in records if r[2] and r[3] == 1]
    assert together and alone
    # averaged over both groups (one of them dead), the loss would be about half
    assert min(alone) > 0.8 * min(together), (alone, together)


def test_the_returned_group_heals_bitwise(kill_and_heal: dict[str, Any]) -> None:
    survivor, returned = kill_and_heal["survivor"], kill_and_heal["returned"]
    assert returned["heals"] and RESTART_AT <= returned["heals"][0] < KILL_STEPS
    first = returned["records"][0][0]
    assert first == returned["heals"][0] + 1  # it resumed after the peer's step
    # at its first step back: the survivor's parameters and optimizer moments as that step began
    assert returned["before"][first] == survivor["before"][first]
    for key in ("params", "moments", "optim_steps", "lr_epoch", "data"):
        assert returned[key] == survivor[key], key


# ---------------------------------------------------------------------------------------- a stall
def test_a_stopped_group_is_dropped_from_the_quorum(tmp_path: Any) -> None:
    """Group 1 stops itself in its second step shared with group 0, before its all-reduce:
    group 0's all-reduce gives up after process_group_timeout_ms, the step is not committed,
    and the next quorum goes on without group 1."""
    warm_parent()
    progress = str(tmp_path / "progress0")
    steps, stall_at = 10, 2
    lighthouse = start_lighthouse(1, join_timeout_ms=JOIN_MS, heartbeat_timeout_ms=HEARTBEAT_MS)
    try:
        live = ForkedGroup(_train, 1, _config(0, ranks=1, steps=steps), progress, 0.15,
                           lighthouse=lighthouse.address(), timeout_s=90)
        stalled = ForkedGroup(_train, 1, _config(1, ranks=1, steps=steps), None, 0.15, stall_at,
                              lighthouse=lighthouse.address(), timeout_s=90)
        try:
            out = live.result()[0]
        finally:
            stalled.kill()
    finally:
        lighthouse.shutdown()
    committed = [r[0] for r in out["records"] if r[2]]
    assert committed == list(range(committed[0], steps + 1))  # (a group that starts late heals first)
    # the step that waited on the stalled group, then the same step alone
    failed = [i for i, r in enumerate(out["records"]) if not r[2]]
    # (retried with both groups until the Lighthouse's heartbeat timeout drops the stalled one)
    step = out["records"][failed[0]][0] if failed else None
    assert failed and all(out["records"][i][0::3] == (step, 2) for i in failed), out["records"]
    assert out["records"][failed[-1] + 1][0::3] == (step, 1), out["records"]
    assert out["times"][failed[0]] - out["times"][failed[0] - 1] >= PG_TIMEOUT_MS / 1000  # it did wait
    assert out["records"][-1][3] == 1
    gaps = [b - a for a, b in zip(out["times"], out["times"][1:], strict=False)]
    assert max(gaps) < 0.1 + (PG_TIMEOUT_MS + HEARTBEAT_MS) / 1000 + 1.0, gaps


# ---------------------------------------------------------------------------------------- DiLoCo
def _diloco(rank: int, world: int, cfg: JobConfig) -> dict[str, Any]:
    """Run ``sync_steps`` inner steps; return the parameters at the start, just before torchft's
    sync (an optimizer post-hook registered before DiLoCo's runs first) and after it."""
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    params = dict(trainer.model.named_parameters())
    start = {n: p.detach().clone().tolist() for n, p in params.items()}
    before: dict[str, Any] = {}

    def capture(*_: Any) -> None:
        before.clear()
        before.update({n: p.detach().clone().tolist() for n, p in params.items()})

    trainer.optimizer.register_step_post_hook(capture)
    try:
        trainer.run()
        return {"start": start, "before": before,
                "after": {n: p.detach().tolist() for n, p in params.items()}}
    finally:
        trainer.close()


def test_diloco_outer_step_is_nesterov_sgd_on_the_mean_pseudo_gradient() -> None:
    import torch

    warm_parent()
    sync = 2
    lighthouse = start_lighthouse(2, heartbeat_timeout_ms=HEARTBEAT_MS)
    try:
        groups = [ForkedGroup(_diloco, 1, _config(i, ranks=1, steps=sync, semi_sync_method="diloco", sync_steps=sync),
                              lighthouse=lighthouse.address(), timeout_s=90) for i in range(2)]
        outs = [g.result()[0] for g in groups]
    finally:
        lighthouse.shutdown()
    for name in (NAMED, "output.weight"):
        start = torch.tensor(outs[0]["start"][name])
        assert torch.equal(start, torch.tensor(outs[1]["start"][name]))
        local = [torch.tensor(o["before"][name]) for o in outs]
        assert not torch.equal(local[0], local[1])  # the groups trained on different data
        # the restatement: pseudo-gradient = start - mean(local); SGD(lr 0.7, momentum 0.9,
        # nesterov) from an empty momentum buffer steps by lr * (1 + momentum) * pseudo-gradient
        pseudo = start - (local[0] + local[1]) / 2
        expected = start - 0.7 * (1 + 0.9) * pseudo
        for o in outs:
            assert torch.allclose(torch.tensor(o["after"][name]), expected, atol=1e-6), name


# ---------------------------------------------------------------------------------------- setup errors
def test_bad_field_is_one_line() -> None:
    with pytest.raises(ValueError) as err:
        JobConfig.from_dict({"fault_tolerance": {"semi_sync_method": "dilocco"}})
    assert str(err.value).count("\n") == 0 and "fault_tolerance.semi_sync_method" in str(err.value)
    assert "Did you mean 'diloco'?" in str(err.value)
    with pytest.raises(ValueError, match=r"^\[fault_tolerance\]: unknown key 'enabled'.*Did you mean 'enable'"):
        JobConfig.from_dict({"fault_tolerance": {"enabled": True}})


def test_in_launch_replicate_degree_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan_spmd.train import validate_job

    cfg = _config(0, ranks=1, steps=1)
    cfg.parallelism.data_parallel_replicate_degree = 2
    with pytest.raises(ValueError, match=r"^fault_tolerance.enable: parallelism.data_parallel_replicate_degree "
                                         r"must be 1 \(got 2\)") as err:
        validate_job(cfg, 2, "cpu")
    assert "\n" not in str(err.value)


def test_missing_torchft_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from torchtitan_spmd.train import validate_job

    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft -> ImportError
    with pytest.raises(ImportError, match=r"fault_tolerance.enable needs the 'torchft' package.*\.\[ft\]") as err:
        validate_job(_config(0, ranks=1, steps=1), 1, "cpu")
    assert "\n" not in str(err.value)


def test_launcher_bad_arguments_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from torchtitan_spmd.tools.ft_launch import main

    for argv, says in ((["--groups", "2", "--kill-group", "2", "--kill-at-step", "3"], "--kill-group must be in [0, 2)"),
                       (["--kill-group", "1"], "--kill-group and --kill-at-step go together")):
        with pytest.raises(SystemExit) as err:
            main(argv)
        assert err.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(says)
