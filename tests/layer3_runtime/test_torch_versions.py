"""Layer 3 on the torch versions users have (2.11 on the GPU machines, 2.13, 2.14.1).

What needs a newer torch fails at setup with a ValueError naming the version; what
does not, trains. On an old torch the error paths below are the real ones; on a new
torch they are simulated by switching the runtime's feature off, and
``test_no_feature_is_off_on_a_torch_that_has_it`` makes sure a new torch never takes
the old path (which would also turn the version skips elsewhere into silent gaps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from parity_helpers import check_parity, job_config, run_config
from version_helpers import torch_at_least, torch_release

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.distributed import _mesh_compat
from torchtitan_spmd.distributed import representation as rep_mod
from torchtitan_spmd.distributed.parallel_dims import ParallelDims
from torchtitan_spmd.distributed.representations import full_dtensor as fd
from torchtitan_spmd.launcher import run_forked


def _cfg(backend: str, **parallelism: Any) -> JobConfig:
    return JobConfig.from_dict(
        {
            "model": {"flavor": "tiny"},
            "training": {"steps": 1, "local_batch_size": 1, "seq_len": 16, "device": "cpu"},
            "parallelism": {"spmd_backend": backend, **parallelism},
        }
    )


def test_no_feature_is_off_on_a_torch_that_has_it() -> None:
    """The feature flags agree with the torch version, parsed here independently."""
    new = torch_release() >= (2, 13)
    assert _mesh_compat.HAS_FLAT_LAYOUT is new
    assert (fd.DataParallelMeshDims is not None) is new
    major, minor = torch_release()
    assert torch_at_least("2.11") and torch_at_least(f"{major}.{minor}")
    assert not torch_at_least(f"{major}.{minor + 1}")


def test_runtime_version_check_matches_an_independent_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime's check pins the running release exactly (a parse of 2.1 for 2.14.1
    passes a substring test, not this one); pre-releases and dev builds count as the release."""
    major, minor = torch_release()
    assert rep_mod.torch_at_least(f"{major}.{minor}")
    assert not rep_mod.torch_at_least(f"{major}.{minor + 1}")
    for version, at_least_2_14 in [("2.14.1+cu130", True), ("2.14.0a0+git1234", True),
                                   ("2.14.0.dev20260601", True), ("2.13.9", False), ("2.1.4", False),
                                   ("3.0.0", True)]:
        monkeypatch.setattr(torch, "__version__", version)
        assert rep_mod.torch_at_least("2.14") is at_least_2_14, version


def _dims(world: int, **degrees: int) -> ParallelDims:
    d = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, **degrees}
    pd = ParallelDims(**d, world_size=world, spmd_backend="full_dtensor", device_type="cpu")
    pd.build_mesh()
    return pd


@pytest.mark.backend("full_dtensor")
def test_full_dtensor_data_parallel_without_dp_mesh_dims_fails_at_setup(
    fake_pg: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchtitan_spmd.train import Trainer

    fake_pg(4)
    monkeypatch.setattr(fd, "DataParallelMeshDims", None)  # what torch 2.11 has
    with pytest.raises(ValueError) as err:
        Trainer(_cfg("full_dtensor", data_parallel_shard_degree=2, tensor_parallel_degree=2))
    msg = str(err.value)
    assert "spmd_backend='full_dtensor'" in msg and "dp_shard=2" in msg, msg
    assert "torch >= 2.13" in msg and f"torch {torch.__version__}" in msg, msg
    assert "spmd_backend='default'" in msg, msg
    # The backstop: fsdp_spec() refuses too, even when validate() was skipped.
    with pytest.raises(ValueError, match="needs torch >= 2.13"):
        fd.REPRESENTATION(_dims(4, dp_shard=2, tp=2)).fsdp_spec()
    # Without data parallelism there is no fully_shard(dp_mesh_dims=...): fine.
    tp_only = fd.REPRESENTATION(_dims(4, tp=4))
    tp_only.validate(_cfg("full_dtensor", data_parallel_shard_degree=1, tensor_parallel_degree=4))
    assert tp_only.fsdp_spec() is None


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_tp_without_loss_parallel_matches_the_reference(backend: str) -> None:
    """TP 2 + SP with the vocab gathered. (With it sharded, ``test_parity``'s tp2_sp runs on
    every supported torch: the vocab-parallel loss works on local shards, so full_dtensor
    does not need torch 2.13's multi-axis ``loss_parallel()``.)"""
    par = {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2, "disable_loss_parallel": True}
    got = run_config(job_config(backend, par), 2)
    check_parity(got, "tp2_sp")


def _grads_after_clip(rank: int, world: int) -> dict[str, tuple[bool, bool, bool]]:
    from torch.distributed.tensor import DTensor

    from torchtitan_spmd.distributed.inputs import prepare_inputs
    from torchtitan_spmd.techniques.grad_norm import clip_grad_norm_
    from torchtitan_spmd.techniques.loss import cross_entropy_loss
    from torchtitan_spmd.train import Trainer

    cfg = job_config("default", {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2})
    trainer = Trainer(cfg)
    rep = trainer.representation
    tokens, labels = next(trainer.dataloader)
    inputs, targets = prepare_inputs(tokens, labels, rep)
    with trainer.train_context():
        logits = trainer.model(inputs)
        cross_entropy_loss(logits, targets, rep, logits_layout=trainer.plan.output_layout()).backward()
    before = {n: p.grad for n, p in trainer.model.named_parameters()
              if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)}
    summed = {n: g.full_tensor() for n, g in before.items()}
    clip_grad_norm_(trainer.model.parameters(), 0.0, rep)  # norm only, no scaling
    out = {}
    for name, p in trainer.model.named_parameters():
        if name in summed:
            after = p.grad
            out[name] = (
                any(pl.is_partial() for pl in after.placements),
                all(pl.is_replicate() for pl in after.placements),
                bool(torch.equal(after.to_local(), summed[name])),
            )
    return out


@pytest.mark.multiproc
@pytest.mark.backend("default")
def test_optimizer_never_sees_a_partial_gradient() -> None:
    """Replicated parameters under SP (the norms) get Partial gradients; they are reduced
    before the optimizer, whose DTensor AdamW on torch 2.11 mis-updates from a Partial one."""
    for per_rank in run_forked(_grads_after_clip, 2):
        assert per_rank, "expected Partial gradients on the replicated norm weights"
        assert any("norm" in name for name in per_rank)
        for name, (partial, replicate, equal) in per_rank.items():
            assert not partial and replicate and equal, name
