"""Layer 3 on the torch versions users have (2.11 on the GPU machines, 2.13, 2.14.1).

What needs a newer torch fails at setup with a ValueError naming the version; what
does not, trains. On an old torch the error paths below are the real ones; on a new
torch they are simulated by switching the runtime's feature flag off, and
``test_no_feature_is_off_on_a_torch_that_has_it`` makes sure a new torch never takes
the old path (which would also turn the version skips elsewhere into silent gaps).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from parity_helpers import LOCAL_BATCH, job_config, max_rel, reference, run_config

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.distributed import _mesh_compat
from torchtitan_spmd.distributed import full_dtensor as fd
from torchtitan_spmd.testing.multiprocess import run_forked
from torchtitan_spmd.testing.versions import torch_at_least, torch_release


@pytest.fixture
def fake_world() -> Iterator[None]:
    """A 4-rank fake process group: setup-time checks only."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"

    dist.init_process_group("fake", rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


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
    assert fd._MULTI_DIM_LOSS_PARALLEL is new
    assert torch_at_least("2.11") and torch_at_least(f"{torch_release()[0]}.{torch_release()[1]}")
    assert not torch_at_least(f"{torch_release()[0]}.{torch_release()[1] + 1}")


@pytest.mark.backend("full_dtensor")
def test_full_dtensor_data_parallel_without_dp_mesh_dims_fails_at_setup(
    fake_world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchtitan_spmd.train import Trainer

    monkeypatch.setattr(fd, "DataParallelMeshDims", None)  # what torch 2.11 has
    with pytest.raises(ValueError) as err:
        Trainer(_cfg("full_dtensor", data_parallel_shard_degree=2, tensor_parallel_degree=2,
                     disable_loss_parallel=True))
    msg = str(err.value)
    assert "spmd_backend='full_dtensor'" in msg and "dp_shard=2" in msg, msg
    assert "torch >= 2.13" in msg and f"torch {torch.__version__}" in msg, msg
    assert "spmd_backend='default'" in msg, msg
    # Without data parallelism there is no fully_shard(dp_mesh_dims=...): fine.
    fd.validate_config(_cfg("full_dtensor", data_parallel_shard_degree=1, tensor_parallel_degree=4,
                            disable_loss_parallel=True), _dims(tp=4))


@pytest.mark.backend("full_dtensor")
def test_full_dtensor_loss_parallel_on_a_1d_only_torch_fails_at_setup(
    fake_world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchtitan_spmd.train import Trainer

    monkeypatch.setattr(fd, "_MULTI_DIM_LOSS_PARALLEL", False)  # torch 2.11's loss_parallel()
    with pytest.raises(ValueError) as err:
        Trainer(_cfg("full_dtensor", data_parallel_shard_degree=1, tensor_parallel_degree=4))
    msg = str(err.value)
    assert "loss parallel" in msg and "tensor_parallel_degree=4" in msg, msg
    assert "torch >= 2.13" in msg and f"torch {torch.__version__}" in msg, msg
    assert "parallelism.disable_loss_parallel=True" in msg, msg
    fd.validate_config(_cfg("full_dtensor", data_parallel_shard_degree=1, tensor_parallel_degree=4,
                            disable_loss_parallel=True), _dims(tp=4))
    # default's loss parallel is on the 1-D tp mesh: every supported torch has it.
    from torchtitan_spmd.distributed.backends import get_backend

    get_backend("default").validate_config(
        _cfg("default", data_parallel_shard_degree=1, tensor_parallel_degree=4), _dims(tp=4))


def _dims(**degrees: int) -> Any:
    from torchtitan_spmd.distributed import ParallelDims

    d = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, **degrees}
    return ParallelDims(**d, world_size=d["dp_replicate"] * d["dp_shard"] * d["tp"],
                        spmd_backend="full_dtensor", device_type="cpu")


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_tp_without_loss_parallel_matches_single_process(backend: str) -> None:
    """TP 2 + SP with the vocab gathered: the full_dtensor configuration torch 2.11 can run."""
    par = {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2, "disable_loss_parallel": True}
    got = run_config(job_config(backend, par), 2)
    ref = reference(LOCAL_BATCH)
    assert max_rel([g[0] for g in got], [r[0] for r in ref]) < 1e-5, (got, ref)
    assert max_rel([g[1] for g in got], [r[1] for r in ref]) < 1e-5, (got, ref)
    assert got[-1][0] < got[0][0] - 0.1


def _grads_after_clip(rank: int, world: int) -> dict[str, tuple[bool, bool, bool]]:
    from torch.distributed.tensor import DTensor

    from torchtitan_spmd.train import Trainer

    cfg = job_config("default", {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2})
    trainer = Trainer(cfg)
    tokens, labels = next(trainer.dataloader)
    inputs, targets = trainer.backend.prepare_inputs(tokens, labels, trainer.parallel_dims)
    with trainer.train_context():
        trainer.backend.compute_loss(trainer.model(inputs), targets).backward()
    before = {n: p.grad for n, p in trainer.model.named_parameters()
              if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)}
    summed = {n: g.full_tensor() for n, g in before.items()}
    trainer.backend.clip_grad_norm_(trainer.model, 0.0, trainer.parallel_dims)  # norm only, no scaling
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
