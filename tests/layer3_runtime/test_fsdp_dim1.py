"""Dense parameters on dim 1 (issue 41): when dim 0 of a rank's (tensor-parallel) shard does not
divide evenly over the FSDP ranks and dim 1 does, FSDP shards dim 1 instead of padding dim 0
(llama3 405B's TP-8 ``wk``/``wv`` and ``w1``/``w3`` over FSDP 2,048: 1.28x the share before).

llama3 ``tiny`` with a 170-wide SwiGLU (``multiple_of=2``; registered here, in the parent, so the
forked ranks and the reference see it) on FSDP 4: ``w1``/``w3`` (170 x 64) go on dim 1, everything
else stays on dim 0; every backend (``spmd_types`` type-checked) against the float64 reference,
every step's loss and every parameter's step-1 gradient norm; the dry run's bytes equal the real
run's on every rank (the layout is now even).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grad_probe
import pytest
from parity_helpers import (
    LOCAL_BATCH,
    TOL,
    job_config,
    max_rel,
    skip_full_dtensor_on_old_torch,
    warm_parent,
)

from torchtitan_spmd.launcher import run_forked, run_isolated, warm_worlds
from torchtitan_spmd.models import llama3

pytestmark = pytest.mark.multiproc

FLAVOR, WORLD, STEPS = "tiny_ffn170", 4, 3


@pytest.fixture(autouse=True)
def _flavour():  # noqa: ANN202
    llama3.FLAVORS[FLAVOR] = dataclasses.replace(llama3.FLAVORS["tiny"], multiple_of=2)
    with warm_worlds(False):  # launches in fresh forks, which inherit the flavour
        yield
    del llama3.FLAVORS[FLAVOR]


def _config(backend: str, **debug: Any) -> Any:
    cfg = job_config(backend, {"data_parallel_shard_degree": WORLD}, steps=STEPS, **debug)
    cfg.model.flavor = FLAVOR
    return cfg


def _train(rank: int, world: int, cfg: Any) -> tuple[list[tuple[float, float]], dict[str, list[int]]]:
    from torch.distributed.tensor import DTensor

    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    shapes = {n.replace("_checkpoint_wrapped_module.", ""): list((p.to_local() if isinstance(p, DTensor) else p).shape)
              for n, p in trainer.model.named_parameters() if "layers.0." in n}
    records = [(r.loss, r.grad_norm) for r in trainer.run()]
    trainer.close()
    return records, shapes


@pytest.mark.parametrize("backend", ["default", "full_dtensor", "spmd_types"])
def test_dim1_dense_parity_with_the_reference(backend: str) -> None:
    from torchtitan_spmd.reference import ReferenceTrace, run_reference

    skip_full_dtensor_on_old_torch(backend, "fsdp4")
    if backend == "spmd_types":
        from torchtitan_spmd.distributed.representation import torch_at_least

        if not torch_at_least("2.14"):
            pytest.skip("spmd_types with FSDP needs torch >= 2.14")
    warm_parent()
    typed = {"spmd_typechecking": True} if backend == "spmd_types" else {}
    results = run_forked(grad_probe.probed(_train), WORLD, _config(backend, **typed), timeout_s=300)
    (records, shapes), _ = results[0]
    (trace,) = grad_probe.merge([t for _, t in results])
    assert all(r[0] == (records, shapes) for r in results)
    assert shapes["layers.0.feed_forward.w1.weight"] == [170, 16] == shapes["layers.0.feed_forward.w3.weight"], shapes
    assert shapes["layers.0.feed_forward.w2.weight"] == [16, 170] and shapes["layers.0.attention.wk.weight"] == [8, 64]
    ref_cfg = job_config("default", {"data_parallel_shard_degree": 1}, local_batch=LOCAL_BATCH * WORLD, steps=STEPS)
    ref_cfg.model.flavor = FLAVOR
    ref_trace = ReferenceTrace()
    ref = run_reference(ref_cfg, global_batch=LOCAL_BATCH * WORLD, trace=ref_trace)
    grad_probe.compare_grad_norms(trace.grad_norms, ref_trace.grad_norms, what=f"dim-1 dense {backend}")
    assert max_rel([r[0] for r in records], [r[0] for r in ref]) < TOL, (records, ref)


def _dry_run(cfg: Any, world: int) -> Any:  # in run_isolated's child: register the flavour there
    from torchtitan_spmd.train import dry_run

    llama3.FLAVORS[FLAVOR] = dataclasses.replace(llama3.FLAVORS["tiny"], multiple_of=2)
    return dry_run(cfg, world)


@pytest.mark.backend("default")
def test_the_dry_runs_bytes_equal_the_real_runs() -> None:
    from dry_run_helpers import measure

    cfg = _config("default")
    cfg.training.steps, cfg.comm.mode = 1, "fake_backend"
    (role,) = run_isolated(_dry_run, cfg, WORLD, timeout_s=600).roles
    cfg.comm.mode = "default"
    for rank in measure(cfg, WORLD):
        assert (role.param_bytes, role.grad_bytes, role.optimizer_bytes) == (
            rank["param_bytes"], rank["grad_bytes"], rank["optimizer_bytes"]), (rank, role)
