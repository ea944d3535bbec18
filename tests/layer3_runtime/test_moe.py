"""Layer 3: the mixture-of-experts blocks (qwen3 ``moe_tiny`` / ``debugmodel_moe``), on one process.

- the MoE module against the reference's dense restatement (float64, no shared code): the
  dispatch, the expert ids, the combine weights, every token;
- routing: ties go to the lower expert index; forced balance is round-robin;
- ``torch._grouped_mm`` and the loop over experts agree;
- setup errors: top-k above the number of experts, PP under MoE (EP's: test_expert_parallel.py),
  forced balance on a dense model;
- the step log's tokens per expert, exactly equal under ``debug.moe_force_load_balance``;
- the expert bias is in checkpoints, and a resumed run continues the same curve.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import load_full, resume_folder
from checkpoint_helpers import run as run_checkpointed
from parity_helpers import job_config

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.models.moe import MoE, top_k_by_index
from torchtitan_spmd.models.qwen3 import FLAVORS, MOE_FLAVORS, Qwen3Config, build_model
from torchtitan_spmd.reference import MoEArchitecture, _moe

TINY = FLAVORS["moe_tiny"]


def _arch(config: Qwen3Config, *, force: bool = False) -> MoEArchitecture:
    return MoEArchitecture(num_experts=config.num_experts, top_k=config.top_k, score_func=config.score_func,
                           route_norm=config.route_norm, route_scale=config.route_scale,
                           load_balance_coeff=config.load_balance_coeff, force_load_balance=force)


def _moe_module(seed: int = 0) -> tuple[MoE, dict[str, torch.Tensor]]:
    """Layer 0's MoE of ``moe_tiny`` in float64, a random expert bias, and its weights by the reference's names."""
    moe = build_model("moe_tiny", seed=seed).layers["0"].moe.double()
    assert moe.expert_bias is not None
    with torch.no_grad():
        moe.expert_bias.copy_(torch.randn(TINY.num_experts, generator=torch.Generator().manual_seed(seed)) * 0.02)
    weights = {f"moe.{k}": v.detach() for k, v in moe.state_dict().items()}
    return moe, weights


@pytest.mark.parametrize("force", [False, True], ids=["routed", "forced-balance"])
def test_the_moe_module_matches_the_dense_reference(force: bool) -> None:
    """Output (every token, every choice, every gate) and tokens per expert (float64 but the router's scores)."""
    moe, weights = _moe_module()
    moe.router.force_load_balance = force
    x = torch.randn(3, 16, TINY.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = moe(x)
    want, counts = _moe(x, weights, "moe.", _arch(TINY, force=force), weights["moe.expert_bias"])
    # the router scores in float32, as upstream; the rest is float64
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    assert moe.tokens_per_expert.tolist() == counts.to(torch.float64).tolist()
    assert int(counts.sum()) == x.shape[0] * x.shape[1] * TINY.top_k
    if force:
        assert counts.min() == counts.max()  # exactly equal loads


def test_the_expert_bias_moves_the_choice_but_not_the_gates() -> None:
    moe, weights = _moe_module()
    x = torch.randn(2, 8, TINY.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    base = moe(x)
    with torch.no_grad():
        moe.expert_bias.zero_()
        moe.expert_bias[3] = 10.0  # every token chooses expert 3
    biased = moe(x)
    assert not torch.allclose(base, biased)
    want, counts = _moe(x, weights, "moe.", _arch(TINY), moe.expert_bias.detach())
    torch.testing.assert_close(biased, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    assert counts[3] == 16


def test_ties_go_to_the_lower_expert_index() -> None:
    scores = torch.tensor([[0.1, 0.3, 0.3, 0.3, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    assert top_k_by_index(scores, 2).tolist() == [[1, 2], [0, 1]]
    assert top_k_by_index(scores, 4).tolist() == [[1, 2, 3, 0], [0, 1, 2, 3]]


def test_grouped_mm_and_the_loop_over_experts_agree() -> None:
    experts = build_model("moe_tiny", seed=3).layers["1"].moe.experts
    counts = torch.tensor([5, 0, 3, 7, 1, 0, 4, 4])  # empty experts included
    x = torch.randn(int(counts.sum()), TINY.dim, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        loop = experts.expert_outputs(x, counts, grouped=False)
        grouped = experts.expert_outputs(x, counts, grouped=True)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)
    assert loop.abs().max() > 1e-4


def test_top_k_larger_than_the_experts_is_named() -> None:
    with pytest.raises(ValueError, match=r"top_k=9 is larger than num_experts=8; valid: 1 \.\. 8"):
        dataclasses.replace(TINY, top_k=9)


def test_the_moe_flavours() -> None:
    assert MOE_FLAVORS == ("debugmodel_moe", "moe_tiny", "30B-A3B")  # upstream's 30B-A3B: meta-only here
    debug = FLAVORS["debugmodel_moe"]  # upstream's sizes
    assert (debug.dim, debug.n_layers, debug.n_heads, debug.n_kv_heads, debug.head_dim) == (256, 8, 16, 8, 128)
    assert (debug.num_experts, debug.top_k, debug.moe_hidden_dim, debug.score_func) == (64, 8, 768, "softmax")


def _moe_cfg(backend: str = "default", **overrides: dict) -> JobConfig:
    data = job_config(backend, {"data_parallel_shard_degree": 4}, model="qwen3", steps=1).to_dict()
    data["model"]["flavor"] = "moe_tiny"
    for section, fields in overrides.items():
        data[section].update(fields)
    return JobConfig.from_dict(data)


def test_forced_balance_on_a_dense_model_names_the_moe_flavours(fake_pg: Callable[[int], None]) -> None:
    from torchtitan_spmd.train import Trainer

    fake_pg(4)
    cfg = _moe_cfg(debug={"moe_force_load_balance": True})
    cfg.model.flavor = "tiny"
    with pytest.raises(ValueError, match="moe_force_load_balance=True needs a mixture-of-experts model.*moe_tiny"):
        Trainer(cfg)


# ------------------------------------------------------------------ trainer: step log, checkpoints
def _run_one(rank: int, world: int, cfg: JobConfig) -> list[str]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    try:
        return [r.log_line() for r in trainer.run()]
    finally:
        trainer.close()


@pytest.mark.multiproc
def test_the_step_log_has_tokens_per_expert_exactly_equal_when_forced() -> None:
    from torchtitan_spmd.launcher import run_forked

    cfg = _moe_cfg(parallelism={"data_parallel_shard_degree": 1}, training={"steps": 2},
                   debug={"moe_force_load_balance": True})
    lines = run_forked(_run_one, 1, cfg, timeout_s=120)[0]
    # 2 x 32 tokens x top-2 over 8 experts: 16 each, in both blocks
    assert [line.split("tokens/expert: ")[1] for line in lines] == ["16-16", "16-16"]
    cfg.debug.moe_force_load_balance = False
    routed = run_forked(_run_one, 1, cfg, timeout_s=120)[0]
    lo, hi = map(int, routed[0].split("tokens/expert: ")[1].split("-"))
    assert lo < 16 < hi


@pytest.mark.multiproc
def test_the_expert_bias_is_checkpointed_and_resumed(tmp_path: Path) -> None:
    """FSDP 2, 8 steps, saves at 4 and 8: the saved biases are the run's (non-zero, per layer), and
    a run resumed from step 4 prints the uninterrupted run's steps 5-8 bit for bit."""
    from checkpoint_helpers import ck_config

    base = tmp_path / "base"
    full = run_checkpointed(ck_config("default", "fsdp2", base, model="qwen3", flavor="moe_tiny"), 2)
    saved = load_full(base / "checkpoint" / "step-4")
    biases = {k: v for k, v in saved.items() if k.endswith("moe.expert_bias")}
    assert sorted(biases) == ["layers.0.moe.expert_bias", "layers.1.moe.expert_bias"], sorted(saved)[:8]
    for bias in biases.values():  # 4 updates of +-1e-3, centred
        assert bias.abs().max() > 5e-4 and abs(float(bias.sum())) < 1e-6
    resumed = run_checkpointed(ck_config("default", "fsdp2", resume_folder(base, tmp_path / "resumed"),
                                         model="qwen3", flavor="moe_tiny"), 2)
    assert resumed["start_step"] == 4
    assert resumed["log_lines"] == full["log_lines"][4:]


def test_activation_checkpointing_recomputes_without_counting_twice() -> None:
    """The recompute in backward (inside autograd's graph task) adds nothing to ``tokens_per_expert``."""
    from torch.utils.checkpoint import checkpoint

    moe, weights = _moe_module()
    x = torch.randn(2, 8, TINY.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(5),
                    requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    _, counts = _moe(x.detach(), weights, "moe.", _arch(TINY), weights["moe.expert_bias"])
    assert moe.tokens_per_expert.tolist() == counts.to(torch.float64).tolist()
    assert x.grad is not None and moe.experts.w1.grad is not None
