"""DeepSeek-V3 experts on dim 1 (issue 41), as ``test_expert_dim1.py`` checks them for ``qwen3`` MoE.

``tiny_2e``: DeepSeek-V3 ``tiny`` (MLA, YaRN, sigmoid routing scaled by 2.5, a shared expert, a dense
first block) with 2 routed experts, top-1, no group limit and no score normalisation (registered here,
in the parent, so the forked ranks and the reference see it). On 4 real gloo ranks under ``default``,
one training run per placement, reused by the tests:

- **dim 1 under EP** (FSDP 4 x EP 2: efsdp 2 > the 1 expert a rank holds): each rank's expert shard is
  ``[1, rows / 2, ...]``; 3 steps against the independent float64 reference (loss and gradient norm at
  every step, every parameter's step-1 gradient norm, the expert weights' named, and the expert biases
  after every step); it saves every step.
- **dim 0** (HSDP 2 x 2 x EP 2: efsdp 1, one whole expert a rank) resumes its step 1 and saves;
- **dim 1 without EP** (FSDP 4: 2 experts over 4 ranks, ``[2, rows / 4, ...]``) resumes that step 2:
  every resumed step lies on the uninterrupted run's curve.

And the Hugging Face path (one launch, ``full_dtensor``): a random transformers ``DeepseekV3ForCausalLM``
with the same 2 experts, saved in bfloat16, loads into both dim-1 layouts and into the dim-0 layout
(the step-1 loss is transformers' own cross-entropy; an export right after the load is the source, bit
for bit), and the dim-1 layouts' exports after training equal the dim-0 layout's (bfloat16 rounding
of weights equal to about 1e-7).
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from deepseek_helpers import LOCAL_BATCH, check_hf_training, data_parallel, deepseek_config
from ep_helpers import checkpointed, records, run_many
from parity_helpers import NORM_TOL, TOL, max_rel
from version_helpers import requires_torch

from torchtitan_spmd.launcher import warm_worlds
from torchtitan_spmd.models import deepseek_v3

pytestmark = pytest.mark.multiproc

FLAVOR, STEPS = "tiny_2e", 3
#: tiny's sizes with 2 routed experts, top-1 (transformers' names for the HF source below)
OURS = {"num_experts": 2, "top_k": 1, "n_group": 1, "topk_group": 1, "route_norm": False}
THEIRS = {"n_routed_experts": 2, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": False}
#: the named expert weight whose step-1 gradient the parity test prints and checks by name
NAMED = "layers.1.moe.experts.w2"


@pytest.fixture(scope="module", autouse=True)
def _fresh_forks() -> Iterator[None]:
    """This module's launches run in fresh forks: they inherit the flavour registered here (a warm
    world's ranks were forked before it)."""
    with warm_worlds(False):
        yield


def _register() -> None:
    deepseek_v3.FLAVORS[FLAVOR] = dataclasses.replace(deepseek_v3.FLAVORS["tiny"], **OURS)


def _config(layout: str) -> Any:
    cfg = deepseek_config("default", layout, steps=STEPS)
    cfg.model.flavor = FLAVOR
    return cfg


def _copy_step(src: Path, step: int, dst: Path) -> None:
    shutil.copytree(src / "checkpoint" / f"step-{step}", dst / "checkpoint" / f"step-{step}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The three runs (dim 1 under EP, saving; dim 0 resuming its step 1; dim 1 without EP resuming
    the dim-0 run's step 2): placement name -> rank 0's result (``ep_helpers.run_many``)."""
    _register()
    root = tmp_path_factory.mktemp("deepseek_dim1")
    a, b, c = root / "dim1_ep", root / "dim0", root / "dim1"
    try:
        (dim1_ep,) = run_many([checkpointed(_config("fsdp4_ep2"), a, interval=1)])
        _copy_step(a, 1, b)
        (dim0,) = run_many([checkpointed(_config("hsdp2x2_ep2"), b, interval=1)])
        _copy_step(b, 2, c)
        (dim1,) = run_many([checkpointed(_config("fsdp4"), c, interval=1)])
    finally:
        del deepseek_v3.FLAVORS[FLAVOR]
    for per_rank in (dim1_ep, dim0, dim1):
        assert all(r["steps"] == per_rank[0]["steps"] for r in per_rank), [r["steps"] for r in per_rank]
    return {"dim1_ep": dim1_ep, "dim0": dim0, "dim1": dim1}


def _reference() -> tuple[Any, Any]:
    from torchtitan_spmd.reference import ReferenceTrace, run_reference

    _register()
    try:
        cfg = _config("fsdp4")
        cfg.parallelism.data_parallel_shard_degree = 1
        cfg.training.local_batch_size = LOCAL_BATCH * data_parallel("fsdp4_ep2")
        trace = ReferenceTrace()
        steps = run_reference(cfg, global_batch=cfg.training.local_batch_size, trace=trace)
    finally:
        del deepseek_v3.FLAVORS[FLAVOR]
    return steps, trace


def test_dim1_experts_parity_with_the_reference(runs: dict[str, Any]) -> None:
    from grad_probe import compare_expert_bias, compare_grad_norms

    per_rank = runs["dim1_ep"]
    for rank, res in enumerate(per_rank):
        for fqn, local, global_shape, over in res["shards"]:
            # one whole expert on dim 0 (EP 2), its rows split over efsdp 2: no padding
            assert global_shape[0] == 2 and local == [1, global_shape[1] // 2, global_shape[2]], (
                rank, fqn, local, global_shape, over)
    run = records(per_rank[0])
    ref, trace = _reference()
    got = run.trace.grad_norms
    assert got[NAMED] == pytest.approx(trace.grad_norms[NAMED], rel=1e-5), (
        f"the step-1 gradient norm of {NAMED} is {got[NAMED]!r}, the reference's {trace.grad_norms[NAMED]!r}")
    worst = compare_grad_norms(got, trace.grad_norms, what="deepseek_v3 dim-1 experts")
    compare_expert_bias(run.trace.expert_bias, trace.expert_bias, what="deepseek_v3 dim-1 experts")
    loss, norm = [g[0] for g in run], [g[1] for g in run]
    assert max_rel(loss, [r[0] for r in ref]) < TOL, (loss, ref)
    assert max_rel(norm, [r[1] for r in ref]) < NORM_TOL, (norm, ref)
    print(f"\ndeepseek_v3 dim-1 experts (FSDP 4 x EP 2): {NAMED} step-1 gradient norm {got[NAMED]:.6g}, "
          f"the reference's {trace.grad_norms[NAMED]:.6g}; worst of {len(got)} tensors {worst:.1e}")


def test_checkpoints_resume_across_the_two_expert_placements(runs: dict[str, Any]) -> None:
    full, mid, last = runs["dim1_ep"][0], runs["dim0"][0], runs["dim1"][0]
    assert [r["start_step"] for r in (full, mid, last)] == [0, 1, 2]
    shapes = {name: r["shards"][0][1] for name, r in (("dim1_ep", full), ("dim0", mid), ("dim1", last))}
    # the first expert weight (w1: [experts, moe_hidden_dim 32, dim 64]) under each placement
    assert shapes == {"dim1_ep": [1, 16, 64], "dim0": [1, 32, 64], "dim1": [2, 8, 64]}, shapes
    curve = {s[0]: s[1:] for s in full["steps"]}
    for run in (mid, last):
        for step, loss, norm in run["steps"]:
            assert loss == pytest.approx(curve[step][0], rel=1e-5), (step, run["steps"], full["steps"])
            assert norm == pytest.approx(curve[step][1], rel=1e-4), (step, run["steps"], full["steps"])


@requires_torch("2.14", "Hugging Face checkpoints (DCP's CheckpointableTensor)")
def test_hf_load_and_export_under_dim1_experts(tmp_path: Path) -> None:
    import torch
    from hf_helpers import STEPS as HF_STEPS
    from hf_helpers import read_safetensors

    pytest.importorskip("transformers")
    layouts = ("fsdp4", "fsdp4_ep2", "hsdp2x2_ep2")  # dim 1, dim 1 under EP, dim 0
    check_hf_training("full_dtensor", layouts, tmp_path, **THEIRS)
    exports = {lay: read_safetensors(tmp_path / lay / "checkpoint" / f"step-{HF_STEPS}") for lay in layouts}
    assert any(".mlp.experts.1." in key for key in exports["fsdp4"]), sorted(exports["fsdp4"])[:8]
    for lay in ("fsdp4", "fsdp4_ep2"):
        assert sorted(exports[lay]) == sorted(exports["hsdp2x2_ep2"]), lay
        for key, want in exports["hsdp2x2_ep2"].items():
            # trained weights equal to ~1e-7 may round to neighbouring bfloat16 values
            torch.testing.assert_close(exports[lay][key].float(), want.float(), rtol=2**-7, atol=1e-6,
                                       msg=lambda m, lay=lay, key=key: f"{lay} {key}: {m}")
