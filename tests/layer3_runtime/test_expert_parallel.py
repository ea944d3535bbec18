"""Layer 3: expert parallelism (``parallelism.expert_parallel_degree``) on real forked gloo ranks.

- the token exchange alone (:class:`AllToAllDispatcher` over ``ep`` 4 and ``ep`` 2 groups of 4
  ranks): each rank's MoE output, its input gradient and the experts' gradients equal those of
  every expert on every rank;
- each backend on FSDP 4 x EP 4 and FSDP 4 x EP 2 (``moe_tiny``, 6 steps) against the
  independent float64 reference (loss 1e-5, grad norm 1e-4), each rank holding ``E / ep`` experts
  (``Shard(0)`` on ``ep``, FSDP over ``efsdp``) of global shape ``E``;
- checkpoints: FSDP 4 x EP 4 saves at step 2, FSDP 4 x EP 2 resumes it and saves at step 4, no
  EP resumes that: every resumed step on the uninterrupted run's curve (the expert bias included);
- the setup errors.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ep_helpers import EP_LAYOUTS, WORLD, checkpointed, ep_config, records, run_many
from moe_helpers import check_moe_parity
from parity_helpers import max_rel, skip_full_dtensor_on_old_torch

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

BACKENDS = ("default", "full_dtensor", "spmd_types")
E, DIM, HIDDEN, TOP_K, TOKENS = 8, 6, 5, 2, 24


def _skip_old_torch(backend: str) -> None:
    skip_full_dtensor_on_old_torch(backend, "fsdp4")
    if backend == "spmd_types":
        from torchtitan_spmd.distributed.representation import torch_at_least

        if not torch_at_least("2.14"):
            pytest.skip("spmd_types with FSDP needs torch >= 2.14")


# ------------------------------------------------------------------------------ the exchange
def _exchange_matches_local(rank: int, world: int, ep: int) -> list[float]:
    import torch.distributed as dist

    from torchtitan_spmd.models.moe import GroupedExperts
    from torchtitan_spmd.techniques.expert_parallel import AllToAllDispatcher, ExpertExchange

    groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, world, ep)]
    group = groups[rank // ep]
    torch.manual_seed(0)  # the same full experts on every rank
    full = GroupedExperts(DIM, HIDDEN, E)
    for w in (full.w1, full.w2, full.w3):
        torch.nn.init.normal_(w, std=0.3)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens, skewed routing
    x = torch.randn(TOKENS, DIM, generator=gen, requires_grad=True)
    logits = torch.randn(TOKENS, E, generator=gen) + torch.linspace(0, 2, E)
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :TOP_K]
    weights = torch.rand(TOKENS, TOP_K, generator=gen)
    counts = torch.bincount(ids.reshape(-1), minlength=E)

    want = full(x, weights, ids, counts)
    (want * torch.arange(DIM)).sum().backward()
    want_dx = x.grad.clone()
    x.grad = None

    n, me = E // ep, rank % ep
    sharded = GroupedExperts(DIM, HIDDEN, E)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(sharded, name).data = getattr(full, name)[me * n:(me + 1) * n].clone()
    sharded.dispatcher = AllToAllDispatcher(ExpertExchange(group), E)
    got = sharded(x, weights, ids, counts)
    (got * torch.arange(DIM)).sum().backward()
    diffs = [float((got - want).abs().max()), float((x.grad - want_dx).abs().max())]
    for name in ("w1", "w2", "w3"):  # the experts' gradients: every rank's tokens of the group
        g = getattr(full, name).grad.clone()
        dist.all_reduce(g, group=group)
        diffs.append(float((getattr(sharded, name).grad - g[me * n:(me + 1) * n]).abs().max()))
    # every row routed to this rank's experts by any rank of the group arrived here
    routed = torch.bincount(ids.reshape(-1), minlength=E).float()
    dist.all_reduce(routed, group=group)
    rows, local_counts, _ = sharded.dispatcher.dispatch(torch.zeros(int(counts.sum()), DIM), counts)
    diffs.append(float((local_counts.float() - routed[me * n:(me + 1) * n]).abs().max()))
    diffs.append(float(rows.shape[0] - routed[me * n:(me + 1) * n].sum()))
    return diffs


@pytest.mark.multiproc
def test_the_token_exchange_equals_every_expert_on_every_rank() -> None:
    def both(rank: int, world: int) -> list[list[float]]:
        return [_exchange_matches_local(rank, world, ep) for ep in (4, 2)]

    for rank, per_ep in enumerate(run_forked(both, WORLD, timeout_s=120)):
        for ep, diffs in zip((4, 2), per_ep, strict=True):
            assert max(abs(d) for d in diffs) < 1e-5, (rank, ep, diffs)


# ------------------------------------------------------------------------------ parity
@pytest.mark.multiproc
@pytest.mark.parametrize("backend", BACKENDS)
def test_ep_parity_with_the_reference(backend: str) -> None:
    _skip_old_torch(backend)
    cells = list(EP_LAYOUTS.items())
    results = run_many([ep_config(backend, ep) for _, ep in cells])
    for (layout, ep), per_rank in zip(cells, results, strict=True):
        steps = per_rank[0]["steps"]
        for rank, res in enumerate(per_rank):
            assert res["steps"] == steps, (layout, rank)  # every rank logs the same
            efsdp = WORLD // ep
            for fqn, local, global_shape, sharded_over in res["shards"]:
                assert global_shape[0] == 8, (fqn, global_shape)  # moe_tiny's 8 experts
                assert "ep" in sharded_over, (layout, fqn, sharded_over)
                assert torch.Size(local).numel() * ep * efsdp == torch.Size(global_shape).numel(), (
                    layout, fqn, local, global_shape)
        loss_diff, norm_diff = check_moe_parity(records(per_rank[0]), "fsdp4")
        print(f"\nEP {backend} {layout}: max rel diff loss {loss_diff:.1e} grad_norm {norm_diff:.1e}")


@pytest.mark.multiproc
def test_ep_composes_with_hsdp_accumulation_and_ac() -> None:
    """``default`` HSDP 2 x 2 x EP 2 (``efsdp`` 1 within each replica), two accumulation microbatches,
    selective activation checkpointing: on the reference's curve."""
    from moe_helpers import moe_config

    cfg = moe_config("default", "hsdp_accum_ac")
    cfg.parallelism.expert_parallel_degree = 2
    (per_rank,) = run_many([cfg])
    check_moe_parity(records(per_rank[0]), "hsdp_accum_ac")


# ------------------------------------------------------------------------------ type checking
@pytest.mark.multiproc
def test_ep_type_checked_parity_with_the_reference() -> None:
    """spmd_types FSDP 4 x EP 2 with ``--debug.spmd_typechecking``: every step checked, on the curve."""
    _skip_old_torch("spmd_types")
    (per_rank,) = run_many([ep_config("spmd_types", 2, spmd_typechecking=True)])
    loss_diff, norm_diff = check_moe_parity(records(per_rank[0]), "fsdp4")
    print(f"\nEP spmd_types fsdp4_ep2 type-checked: max rel diff loss {loss_diff:.1e} grad_norm {norm_diff:.1e}")


def _train_without_the_combine(rank: int, world: int, cfg: JobConfig) -> list[float]:
    """The combine's all-to-all left out (planted): the experts' rows stay where they were computed."""
    from torchtitan_spmd.techniques.expert_parallel import AllToAllDispatcher
    from torchtitan_spmd.train import Trainer

    def combine(self: AllToAllDispatcher, out: torch.Tensor, state: Any) -> torch.Tensor:
        return self.exchange.expert_output(out[torch.argsort(state.perm)])

    AllToAllDispatcher.combine = combine  # type: ignore[method-assign]  # this forked rank only
    trainer = Trainer(cfg)
    try:
        return [r.loss for r in trainer.run()]
    finally:
        trainer.close()


@pytest.mark.multiproc
@pytest.mark.fresh_world(reason="the type error names the axes as spmd_types first registered their groups in "
                                "the process (a warm rank's default group keeps an earlier launch's name)")
def test_the_checker_catches_a_missing_combine() -> None:
    """With ``debug.moe_force_load_balance`` every rank sends and gets as many rows, so leaving the
    combine out changes no shape: unchecked it trains, off the curve; checked, the experts' pending
    sum (``P@ep``) reaching the block's ``dp``-typed arithmetic is an ``SpmdTypeError``."""
    from parity_helpers import warm_parent

    from torchtitan_spmd.launcher import WorkerError

    _skip_old_torch("spmd_types")
    warm_parent()
    unchecked = run_forked(_train_without_the_combine, WORLD,
                           ep_config("spmd_types", 2, moe_force_load_balance=True), timeout_s=300)[0]
    good = run_many([ep_config("spmd_types", 2, moe_force_load_balance=True)])[0][0]["steps"]
    assert max_rel(unchecked, [s[1] for s in good]) > 1e-5  # silently wrong without the checker
    # The pending sum's axis is named as spmd_types first registered its group in the process
    # ("mesh_ep", or "default_pg[2:1]" after other tests in the same worker): the type is what counts.
    with pytest.raises(WorkerError, match=r"SpmdTypeError: .*has type P"):
        run_forked(_train_without_the_combine, WORLD,
                   ep_config("spmd_types", 2, moe_force_load_balance=True, spmd_typechecking=True), timeout_s=300)


# ------------------------------------------------------------------------------ checkpoints
def _copy_step(src: Path, step: int, dst: Path) -> None:
    shutil.copytree(src / "checkpoint" / f"step-{step}", dst / "checkpoint" / f"step-{step}")


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoints_reshard_across_ep_degrees(backend: str, tmp_path: Path) -> None:
    """FSDP 4 x EP 4 (saves at 2, 4, 6) -> FSDP 2 x TP 2 x EP 2 from its step 2 (saves at 4) -> FSDP 4,
    no EP, from that step 4: the issue's chain, at the same global batch, on the same curve."""
    _skip_old_torch(backend)
    a, b, c = tmp_path / "ep4", tmp_path / "ep2_tp2", tmp_path / "noep"
    (full,) = run_many([checkpointed(ep_config(backend, 4), a)])
    _copy_step(a, 2, b)
    ep2_tp2 = ep_config(backend, 2)
    ep2_tp2.parallelism.data_parallel_shard_degree, ep2_tp2.parallelism.tensor_parallel_degree = 2, 2
    ep2_tp2.training.local_batch_size *= 2  # half the data ranks: the same global batch
    (ep2,) = run_many([checkpointed(ep2_tp2, b)])
    _copy_step(b, 4, c)
    (noep,) = run_many([checkpointed(ep_config(backend, 1), c)])
    curve = full[0]["steps"]
    assert [r["start_step"] for r in (full[0], ep2[0], noep[0])] == [0, 2, 4]
    for run, first in ((ep2, 3), (noep, 5)):
        got = run[0]["steps"]
        assert [s[0] for s in got] == list(range(first, 7))
        assert max_rel([s[1] for s in got], [s[1] for s in curve[first - 1:]]) < 1e-5, (got, curve)
    from checkpoint_helpers import load_full

    saved = load_full(b / "checkpoint" / "step-4")
    assert tuple(saved["layers.0.moe.experts.w1"].shape) == (8, 64, 64)  # the global shape
    bias = saved["layers.0.moe.expert_bias"]
    assert bias.abs().max() > 1e-4  # the bias moved, and was saved


# ------------------------------------------------------------------------------ setup errors
def _moe_cfg(backend: str = "default", flavor: str = "moe_tiny", model: str = "qwen3", **parallelism: Any) -> JobConfig:
    return JobConfig.from_dict({
        "model": {"name": model, "flavor": flavor},
        "training": {"steps": 1, "local_batch_size": 1, "seq_len": 16, "device": "cpu"},
        "parallelism": {"spmd_backend": backend, **parallelism},
    })


@pytest.mark.parametrize(("world", "cfg", "needles"), [
    (4, _moe_cfg(data_parallel_shard_degree=4, expert_parallel_degree=3),
     ["ep (3) must divide dp_shard * cp * tp"]),
    (4, _moe_cfg(model="llama3", flavor="tiny", data_parallel_shard_degree=4, expert_parallel_degree=2),
     ["parallelism.expert_parallel_degree=2", "dense", "qwen3 'moe_tiny'", "qwen3 'debugmodel_moe'"]),
    (4, _moe_cfg(data_parallel_shard_degree=4, expert_tensor_parallel_degree=2),
     ["parallelism.expert_tensor_parallel_degree=2", "must be 1"]),
    (4, _moe_cfg(data_parallel_shard_degree=2, tensor_parallel_degree=2, expert_tensor_parallel_degree=2),
     ["parallelism.expert_tensor_parallel_degree=2", "not implemented yet", "set it to 1"]),
], ids=["ep-not-dividing", "dense-model", "etp-not-1-or-tp",
        "etp-equal-tp"])
def test_expert_parallel_setup_errors(fake_pg: Callable[[int], None], world: int, cfg: JobConfig,
                                      needles: list[str]) -> None:
    from torchtitan_spmd.train import Trainer

    fake_pg(world)
    with pytest.raises(ValueError) as err:
        Trainer(cfg)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_type_checked_ep_with_selective_ac_is_a_setup_error(fake_pg: Callable[[int], None]) -> None:
    """The typed exchange and selective AC's recompute do not mix (measured: a RuntimeError in the
    backward): a setup error naming the fields, not a failure at step 1."""
    from torchtitan_spmd.distributed.representation import torch_at_least
    from torchtitan_spmd.train import Trainer

    if not torch_at_least("2.14"):
        pytest.skip("spmd_types with FSDP needs torch >= 2.14")
    cfg = _moe_cfg("spmd_types", data_parallel_shard_degree=4, expert_parallel_degree=2)
    cfg.debug.spmd_typechecking, cfg.activation_checkpoint.mode = True, "selective"
    fake_pg(4)
    with pytest.raises(ValueError, match=r"expert_parallel_degree=2 with debug.spmd_typechecking=True and "
                                         r"activation_checkpoint.mode='selective'.*'full' or 'none'"):
        Trainer(cfg)


def test_experts_not_divisible_by_ep(fake_pg: Callable[[int], None]) -> None:
    """moe_tiny's 8 experts over ep 3 (3 ranks of dp_shard): the degrees that divide 8 are named."""
    from torchtitan_spmd.train import Trainer

    fake_pg(3)
    with pytest.raises(ValueError, match=r"num_experts=8 is not divisible.*\[1, 2, 4, 8\]"):
        Trainer(_moe_cfg(data_parallel_shard_degree=3, expert_parallel_degree=3))
