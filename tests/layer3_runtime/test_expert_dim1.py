"""Experts sharded on dim 1 (issue 41): when the ranks sharding the grouped expert weights (FSDP's
``fsdp`` without EP, ``efsdp`` with it) outnumber the experts a rank holds, FSDP2 shards them on
dim 1 instead of padding dim 0 to one expert a rank (upstream b5bcd76, ``shard_placement_fn``).

A 2-expert ``moe_tiny`` (registered here, in the parent, so the forked ranks and the reference see
it) on 4 real gloo ranks, every backend (``spmd_types`` type-checked), 3 steps against the
independent float64 reference: loss and gradient norm every step, every parameter's step-1
gradient norm, the expert biases; each rank's expert shard is ``[E/ep, rows/efsdp, ...]``, no
padding. FSDP 4 (2 experts over 4 ranks) and FSDP 4 x EP 2 (1 expert a rank over efsdp 2).
Checkpoints: saved under dim 1 (FSDP 4) resume under dim 0 (FSDP 2) and back, on the same curve.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
from ep_helpers import checkpointed, ep_config, records, run_many
from moe_helpers import check_moe_trace
from parity_helpers import NORM_TOL, TOL, max_rel, skip_full_dtensor_on_old_torch

from torchtitan_spmd.launcher import warm_worlds
from torchtitan_spmd.models import qwen3

pytestmark = pytest.mark.multiproc

FLAVOR, EXPERTS, STEPS, WORLD = "moe_tiny_2e", 2, 3, 4
BACKENDS = ("default", "full_dtensor", "spmd_types")


@pytest.fixture(autouse=True)
def _two_experts():  # noqa: ANN202 - moe_tiny with 2 experts (top-2), for this module's runs only
    qwen3.FLAVORS[FLAVOR] = dataclasses.replace(qwen3.FLAVORS["moe_tiny"], num_experts=EXPERTS)
    with warm_worlds(False):  # launches in fresh forks, which inherit the flavour
        yield
    del qwen3.FLAVORS[FLAVOR]


def _config(backend: str, ep: int, **debug: Any) -> Any:
    cfg = ep_config(backend, ep, **debug)
    cfg.model.flavor, cfg.training.steps = FLAVOR, STEPS
    return cfg


def _reference() -> tuple[Any, Any]:
    from moe_helpers import GLOBAL_BATCH, moe_config

    from torchtitan_spmd.reference import ReferenceTrace, run_reference

    cfg = moe_config("default", "single")
    cfg.model.flavor, cfg.training.steps = FLAVOR, STEPS
    trace = ReferenceTrace()
    return run_reference(cfg, global_batch=GLOBAL_BATCH["fsdp4"], trace=trace), trace


def _skip_old_torch(backend: str) -> None:
    skip_full_dtensor_on_old_torch(backend, "fsdp4")
    if backend == "spmd_types":
        from torchtitan_spmd.distributed.representation import torch_at_least

        if not torch_at_least("2.14"):
            pytest.skip("spmd_types with FSDP needs torch >= 2.14")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dim1_experts_parity_with_the_reference(backend: str) -> None:
    _skip_old_torch(backend)
    typed = {"spmd_typechecking": True} if backend == "spmd_types" else {}
    cells = [1, 2]  # EP 1 (fsdp 4 > 2 experts), EP 2 (efsdp 2 > 1 expert a rank)
    results = run_many([_config(backend, ep, **typed) for ep in cells])
    ref, ref_trace = _reference()
    for ep, per_rank in zip(cells, results, strict=True):
        shard_ranks = WORLD // ep
        for rank, res in enumerate(per_rank):
            assert res["steps"] == per_rank[0]["steps"], (ep, rank)
            for fqn, local, global_shape, over in res["shards"]:
                # E/ep experts whole on dim 0, dim 1 split evenly over the shard ranks: no padding
                assert local == [EXPERTS // ep, global_shape[1] // shard_ranks, global_shape[2]], (
                    backend, ep, fqn, local, global_shape, over)
        run = records(per_rank[0])
        check_moe_trace(run, ref_trace, f"dim-1 experts {backend} ep {ep}")
        loss, norm = [g[0] for g in run], [g[1] for g in run]
        assert max_rel(loss, [r[0] for r in ref]) < TOL, (backend, ep, loss, ref)
        assert max_rel(norm, [r[1] for r in ref]) < NORM_TOL, (backend, ep, norm, ref)


def _copy_step(src: Path, step: int, dst: Path) -> None:
    shutil.copytree(src / "checkpoint" / f"step-{step}", dst / "checkpoint" / f"step-{step}")


@pytest.mark.parametrize("backend", ["default", "spmd_types"])
def test_checkpoints_resume_across_the_two_expert_placements(backend: str, tmp_path: Path) -> None:
    """FSDP 4 x EP 2 (dim 1: efsdp 2 > 1 expert a rank) saves at steps 1, 2, 3 -> HSDP 2 x 2 x EP 2
    (efsdp 1: dim 0, one whole expert a rank) resumes its step 1 and saves at step 2 -> FSDP 4 x EP 2
    (dim 1) resumes that: every resumed step on the uninterrupted run's curve."""
    _skip_old_torch(backend)
    a, b, c = tmp_path / "dim1", tmp_path / "dim0", tmp_path / "dim1_again"
    (full,) = run_many([checkpointed(_config(backend, 2), a, interval=1)])
    _copy_step(a, 1, b)
    dim0 = _config(backend, 2)
    dim0.parallelism.data_parallel_replicate_degree, dim0.parallelism.data_parallel_shard_degree = 2, 2
    (mid,) = run_many([checkpointed(dim0, b, interval=1)])
    _copy_step(b, 2, c)
    (last,) = run_many([checkpointed(_config(backend, 2), c, interval=1)])
    assert [r["start_step"] for r in (full[0], mid[0], last[0])] == [0, 1, 2]
    # the placements: dim 1 under efsdp 2, dim 0 (one whole expert a rank) under efsdp 1
    assert full[0]["shards"][0][1] == [1, 32, 64] and mid[0]["shards"][0][1] == [1, 64, 64], (
        full[0]["shards"][0], mid[0]["shards"][0])
    curve = {s[0]: s[1:] for s in full[0]["steps"]}
    for run in (mid[0], last[0]):
        for step, loss, norm in run["steps"]:
            assert loss == pytest.approx(curve[step][0], rel=1e-5) and norm == pytest.approx(curve[step][1], rel=1e-4), (
                step, run["steps"], full[0]["steps"])


def _dry_run_two_experts(cfg: Any, world: int) -> Any:  # in run_isolated's child: register the flavour there
    from torchtitan_spmd.train import dry_run

    qwen3.FLAVORS[FLAVOR] = dataclasses.replace(qwen3.FLAVORS["moe_tiny"], num_experts=EXPERTS)
    return dry_run(cfg, world)


@pytest.mark.backend("default")
@pytest.mark.parametrize("ep", [1, 2])
def test_the_dry_runs_bytes_equal_the_real_runs(ep: int) -> None:
    """The dry run (fake ranks, meta) of the two dim-1 layouts: rank 0's parameter, gradient and
    optimizer bytes equal the real run's rank 0 to the byte, and it holds no padded expert: at most
    1.05 x the model's parameters / 4 (dim 0 would pad 2 experts to 4 rows: about 1.4x here)."""
    from dry_run_helpers import measure

    from torchtitan_spmd.launcher import run_isolated

    cfg = _config("default", ep)
    cfg.training.steps, cfg.comm.mode = 1, "fake_backend"
    report = run_isolated(_dry_run_two_experts, cfg, WORLD, timeout_s=600)
    cfg.comm.mode = "default"
    real = measure(cfg, WORLD)
    (role,) = report.roles
    assert role.rank == 0
    assert (role.param_bytes, role.grad_bytes, role.optimizer_bytes) == (
        real[0]["param_bytes"], real[0]["grad_bytes"], real[0]["optimizer_bytes"]), (ep, real[0], role)
    assert role.param_numel <= 1.05 * report.total_params / WORLD, (role.param_numel, report.total_params)
