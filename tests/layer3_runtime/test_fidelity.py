"""Layer 3: upstream's validator, optimizer groups as torch takes them, and the non-finite guard's paths.

- every validation reads the same batches (a fresh loader each time, as upstream's
  ``validate()``), and ``validator.steps = -1`` is one pass over a file dataset;
- a ``param_groups`` group with ``lr = 0`` (torch accepts it) keeps its parameters bit-identical
  while the others train; torch's refusal of a group's kwargs is one line naming the group;
- a non-finite step stops before the optimizer on each path: a non-finite gradient norm with a
  finite loss, and under pipeline parallelism a non-finite loss on the last stage and a
  non-finite gradient on the first (the loss path without PP: ``test_run_features.py``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from feature_helpers import tiny_job
from torch import nn

from torchtitan_spmd.config import JobConfig, OptimizerConfig, ValidatorConfig
from torchtitan_spmd.data import PackedTextIterator, Tokenizer, build_dataloader, load_documents
from torchtitan_spmd.launcher import run_forked
from torchtitan_spmd.tools.optimizer import build_optimizer


def _job(folder: str, **over: Any) -> JobConfig:
    return tiny_job(folder, **over)


def _run(rank: int, world: int, cfg: JobConfig) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    try:
        records = trainer.run()
        return {"losses": [r.loss for r in records],
                "validations": [(v.step, v.loss, v.tokens, v.steps) for v in trainer.validations]}
    finally:
        trainer.close()


# ------------------------------------------------------------------ the validator
def test_every_validation_reads_the_same_batches(tmp_path: Path) -> None:
    # lr 1e-12: the weights do not move (in fp32), so the same batches give the same loss
    cfg = _job(str(tmp_path), training__steps=4, optimizer__lr=1e-12, validator__enable=True,
               validator__freq=2, validator__steps=2)
    out = run_forked(_run, 2, cfg, timeout_s=120)
    for rank_out in out:
        validations = rank_out["validations"]
        assert [v[0] for v in validations] == [1, 2, 4], validations
        assert all(v[2:] == (2 * 2 * 2 * 16, 2) for v in validations), validations  # 2 batches of 2 ranks x 2 x 16
        losses = [v[1] for v in validations]
        assert losses[1] == pytest.approx(losses[0], rel=1e-7, abs=0) and losses[2] == pytest.approx(
            losses[0], rel=1e-7, abs=0), losses


#: 10 documents of 35 bytes: 37 tokens each (BOS + bytes + EOS), 370 in all; a global batch of
#: 2 ranks x 2 rows x 17 tokens is 68: 5 whole batches (340 tokens), 30 left over.
_DOCS = [f"document {i:02d} of the validation set!" + "." for i in range(10)]


def _write_set(folder: Path) -> str:
    assert all(len(d.encode()) == 35 for d in _DOCS)
    path = folder / "val.txt"
    path.write_text("\n".join(_DOCS) + "\n")
    return str(path)


def test_one_pass_reads_every_whole_global_batch_and_stops() -> None:
    tok = Tokenizer()

    def count(docs: list[str], rank: int) -> int:
        it = PackedTextIterator(docs, tok, dp_rank=rank, dp_degree=2, local_batch_size=2, seq_len=16, infinite=False)
        return sum(1 for _ in it)

    assert [count(_DOCS, r) for r in (0, 1)] == [5, 5]  # 370 tokens: 5 batches of 68, 30 not read
    # a pass that ends exactly on a batch's edge (2 documents of 68 tokens): 2 batches, then the end
    exact = ["x" * 66, "y" * 66]
    assert count(exact, 0) == 2
    assert count(exact[:1], 0) == 1
    assert count(["short"], 0) == 0
    endless = PackedTextIterator(exact, tok, dp_rank=0, dp_degree=2, local_batch_size=2, seq_len=16)
    assert sum(1 for _, _ in zip(range(7), endless, strict=False)) == 7
    with pytest.raises(ValueError, match="dataloader.dataset='synthetic'.*endless stream"):
        build_dataloader(dp_rank=0, dp_degree=1, local_batch_size=1, seq_len=8, seed=0, infinite=False)


def test_steps_minus_one_needs_a_finite_dataset_and_names_why(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"validator.steps=-1 .* validator.dataloader.dataset='synthetic' "
                                         "is an endless stream") as err:
        ValidatorConfig.from_dict({"enable": True})
    assert "\n" not in str(err.value)
    path = _write_set(tmp_path)
    assert ValidatorConfig.from_dict({"enable": True, "dataloader": {"dataset": "text", "dataset_path": path}}).steps == -1


def test_steps_minus_one_validates_one_pass_of_a_five_batch_file(tmp_path: Path) -> None:
    path = _write_set(tmp_path)
    cfg = _job(str(tmp_path / "run"), validator__enable=True, validator__freq=1,
               validator__dataloader={"dataset": "text", "dataset_path": path})
    assert cfg.validator.steps == -1
    assert len(load_documents("text", path)) == 10  # (and ``datasets`` imported once, before the ranks fork)
    out = run_forked(_run, 2, cfg, timeout_s=60)  # an endless pass would end in the launcher's timeout
    for rank_out in out:
        validations = rank_out["validations"]
        assert [(v[0], v[2], v[3]) for v in validations] == [(1, 5 * 4 * 16, 5), (2, 5 * 4 * 16, 5)], validations
        assert all(math.isfinite(v[1]) for v in validations)


def test_a_set_shorter_than_one_global_batch_is_a_setup_error(tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text("too short\n")
    cfg = _job(str(tmp_path / "run"), validator__enable=True, parallelism__data_parallel_shard_degree=1,
               validator__dataloader={"dataset": "text", "dataset_path": str(tmp_path / "tiny.txt")})
    load_documents("text", str(tmp_path / "tiny.txt"))
    with pytest.raises(Exception) as err:
        run_forked(_run, 1, cfg, timeout_s=60)
    assert "holds fewer tokens than one global validation batch" in str(err.value), str(err.value)[-2000:]


# ------------------------------------------------------------------ optimizer groups as torch takes them
FROZEN = [
    {"pattern": r"tok_embeddings\.", "optimizer_name": "AdamW", "optimizer_kwargs": {"lr": 0.0}},
    {"pattern": ".*", "optimizer_name": "AdamW", "optimizer_kwargs": {"lr": 1e-2}},
]


def _params_before_and_after(rank: int, world: int, cfg: JobConfig) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)

    def local() -> dict[str, torch.Tensor]:
        return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                for n, p in trainer.model.named_parameters()}

    try:
        before = local()
        trainer.run()
        after = local()
        return {n: torch.equal(before[n], after[n]) for n in before}
    finally:
        trainer.close()


def test_a_group_at_lr_zero_keeps_its_parameters_bit_identical(tmp_path: Path) -> None:
    cfg = _job(str(tmp_path), optimizer__param_groups=FROZEN)
    for unchanged in run_forked(_params_before_and_after, 2, cfg, timeout_s=120):
        frozen = {n: same for n, same in unchanged.items() if "tok_embeddings" in n}
        trained = {n: same for n, same in unchanged.items() if "tok_embeddings" not in n}
        assert frozen and all(frozen.values()), frozen
        assert trained and not any(trained.values()), trained


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"lr": -1.0}, "Invalid learning rate: -1.0"),
    ({"lr": 1e-3, "momentum": 0.9}, "unexpected keyword argument 'momentum'"),
    ({"lr": 1e-3, "betas": (1.5, 0.9)}, "Invalid beta parameter at index 0"),
])
def test_torchs_refusal_of_a_group_is_one_line_naming_it(kwargs: dict[str, Any], says: str) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    config = OptimizerConfig.from_dict({"param_groups": [
        {"pattern": "^0\\.", "optimizer_name": "Adam", "optimizer_kwargs": {"lr": 0.0}},
        {"pattern": ".*", "optimizer_name": "AdamW", "optimizer_kwargs": kwargs}]})
    with pytest.raises(ValueError) as err:
        build_optimizer(model, config)
    message = str(err.value)
    assert message.startswith("optimizer.param_groups[1] (pattern '.*'): torch.optim.AdamW refuses"), message
    assert says in message and "\n" not in message, message


# ------------------------------------------------------------------ the non-finite guard's paths
class _InfGradient(torch.autograd.Function):
    """The identity forward; an infinite gradient backward (a finite loss, a non-finite norm)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad + float("inf")


BAD_STEP = 2


def _guarded(rank: int, world: int, cfg: JobConfig, module: str, plant: str, poisoned_rank: int) -> dict[str, Any]:
    """Train to :data:`BAD_STEP`, whose forward of ``module`` on ``poisoned_rank`` is planted
    (``loss``: its output + inf; ``grad``: an infinite gradient through it)."""
    from torchtitan_spmd.train import NonFiniteStepError, Trainer

    trainer = Trainer(cfg)
    now = {"step": 0}

    def hook(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        if now["step"] != BAD_STEP or rank != poisoned_rank:
            return out
        return out + float("inf") if plant == "loss" else _InfGradient.apply(out)

    hooked = [m.register_forward_hook(hook) for part in trainer.model_parts for name, m in part.named_modules()
              if name.split(".")[-1] == module]

    def local() -> dict[str, torch.Tensor]:
        return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                for part in trainer.model_parts for n, p in part.named_parameters()}

    def opt_steps() -> list[float]:
        return [float(s["step"]) for s in trainer.optimizer.state.values()]

    try:
        before: dict[str, torch.Tensor] = {}
        counts: list[float] = []
        for step in range(1, BAD_STEP + 1):
            now["step"] = step
            if step == BAD_STEP:
                before, counts = local(), opt_steps()
            trainer.step(step)
        return {"raised": None, "hooked": len(hooked)}
    except NonFiniteStepError as err:
        after = local()
        return {"raised": str(err), "loss": err.loss, "grad_norm": err.grad_norm, "hooked": len(hooked),
                "agreed": getattr(err, "agreed", False), "opt_steps_unchanged": counts == opt_steps(),
                "unchanged": bool(before) and all(torch.equal(before[n], after[n]) for n in before)}
    finally:
        trainer.close()


_PP = {"parallelism__pipeline_parallel_degree": 2, "parallelism__data_parallel_shard_degree": 1,
       "parallelism__pipeline_parallel_schedule": "1F1B", "parallelism__pipeline_parallel_microbatch_size": 1}


@pytest.mark.parametrize(("over", "module", "plant", "poisoned_rank", "finite_loss"), [
    ({}, "tok_embeddings", "grad", 1, True),  # a finite loss, an infinite gradient norm
    (_PP, "output", "loss", 1, False),  # PP: the loss is non-finite on the last stage only
    (_PP, "tok_embeddings", "grad", 0, True),  # PP: an infinite gradient on the first stage only
], ids=["grad-norm", "pp-loss-on-the-last-stage", "pp-grad-norm-on-the-first-stage"])
def test_a_non_finite_step_stops_before_the_optimizer_on_each_path(
        tmp_path: Path, over: dict[str, Any], module: str, plant: str, poisoned_rank: int, finite_loss: bool) -> None:
    cfg = _job(str(tmp_path), **over)
    per_rank = run_forked(_guarded, 2, cfg, module, plant, poisoned_rank, timeout_s=120)
    assert per_rank[poisoned_rank]["hooked"] >= 1, per_rank
    for rank, out in enumerate(per_rank):
        assert out["raised"] is not None, (rank, out)  # every rank stops, also those that saw nothing
        assert out["raised"].startswith(f"step {BAD_STEP}: the loss is ") and "\n" not in out["raised"], out
        assert math.isfinite(out["loss"]) is finite_loss and not math.isfinite(out["grad_norm"]), (rank, out)
        assert out["unchanged"] and out["opt_steps_unchanged"] and out["agreed"], (rank, out)


# ------------------------------------------------------------------ where a fork imports validate_cp_backend
def test_validate_cp_backend_where_upstream_has_it() -> None:
    """b5bcd76's ``torchtitan.distributed.context_parallel.validate_cp_backend``: CP needs a
    backend that runs it (here also ``full_dtensor``); without CP every backend passes."""
    from torchtitan_spmd.config import ParallelismConfig
    from torchtitan_spmd.distributed.context_parallel import validate_cp_backend
    from torchtitan_spmd.techniques import context_parallel

    assert context_parallel.validate_cp_backend is validate_cp_backend  # one check, two import paths
    partial = ParallelismConfig(spmd_backend="partial_dtensor", context_parallel_degree=2)
    with pytest.raises(ValueError, match=r"spmd_backend='spmd_types', got 'partial_dtensor'") as err:
        validate_cp_backend(partial)
    assert "\n" not in str(err.value)
    validate_cp_backend(ParallelismConfig(spmd_backend="spmd_types", context_parallel_degree=2))
    validate_cp_backend(ParallelismConfig(spmd_backend="default", context_parallel_degree=1))
