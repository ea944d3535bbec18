"""Layer 3: upstream's learning-rate schedule, optimizer param groups and the non-finite guard.

- the schedule: the factor of every step against upstream's formula restated here (a third
  statement, sharing no code with ``tools/lr_scheduler.py`` or ``reference.py``), hand
  values of a warmup-stable-decay run, and the learning rate a real run logs at every step;
- ``optimizer.param_groups``: first match wins, per-group optimizer and kwargs, a pattern
  that matches nothing and a parameter no pattern claims are errors, the grouping goes into
  checkpoints and a changed one at resume is one line;
- a step whose loss is not finite stops before the optimizer: the parameters and the
  optimizer state are those of the step before, and no checkpoint is written.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from feature_helpers import tiny_job
from torch import nn

from torchtitan_spmd import reference
from torchtitan_spmd.config import JobConfig, LRSchedulerConfig, OptimizerConfig
from torchtitan_spmd.config.configs import ParamGroupConfig
from torchtitan_spmd.launcher import run_forked
from torchtitan_spmd.tools.lr_scheduler import WarmupStableDecay, build_lr_scheduler
from torchtitan_spmd.tools.optimizer import Optimizers, build_optimizer, check_same_grouping


# ------------------------------------------------------------------ the schedule, restated
def upstream_factor(step: int, warmup: int, total: int, decay_ratio: float | None, decay_type: str,
                    min_lr: float) -> float:
    """Upstream's ``linear_warmup_stable_decay`` (a0c831c49 lr_scheduler.py), as it reads there:
    the adjustments of ``build`` first, then the three branches with their ``+ 1``s."""
    warmup = min(warmup, total)
    if decay_ratio is not None:
        decay = round(total * decay_ratio)
        if warmup + decay > total:
            decay = total - warmup
    else:
        decay = total - warmup
    stable = total + 1 - warmup - decay
    if step < warmup:
        return float((step + 1) / warmup)
    if step < warmup + stable:
        return 1.0
    progress = float(step + 1 - (warmup + stable)) / decay
    if decay_type == "linear":
        adj = 1 - progress
    elif decay_type == "sqrt":
        adj = 1 - math.sqrt(progress)
    else:
        adj = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr + (1 - min_lr) * adj


GRID = [(w, t, r, d, m) for w in (0, 2, 5, 300) for t in (10, 17) for r in (None, 0.0, 0.3, 0.9)
        for d in ("linear", "sqrt", "cosine") for m in (0.0, 0.1)]


def test_every_step_of_every_schedule_is_upstreams_formula() -> None:
    for warmup, total, ratio, kind, min_lr in GRID:
        cfg = LRSchedulerConfig(warmup_steps=warmup, decay_ratio=ratio, decay_type=kind, min_lr_factor=min_lr)
        ours = WarmupStableDecay.from_config(cfg, total)
        for step in range(total):
            want = upstream_factor(step, warmup, total, ratio, kind, min_lr)
            ref = reference.lr_factor(step, warmup_steps=warmup, total_steps=total, min_lr_factor=min_lr,
                                      decay_ratio=ratio, decay_type=kind)
            assert ours(step) == pytest.approx(want, abs=1e-12), (warmup, total, ratio, kind, min_lr, step)
            assert ref == pytest.approx(want, abs=1e-12), ("reference", warmup, total, ratio, kind, min_lr, step)


def test_warmup_stable_decay_by_hand() -> None:
    # warmup 2 of 10 steps, the last 4 (decay_ratio 0.4) decay linearly to 0.1: the stable phase is
    # 10 + 1 - 2 - 4 = 5 steps (one virtual), so 0-based steps 2..6 are at 1 and 7, 8, 9 decay
    # at progress 1/4, 2/4, 3/4.
    cfg = LRSchedulerConfig(warmup_steps=2, decay_ratio=0.4, min_lr_factor=0.1)
    f = WarmupStableDecay.from_config(cfg, 10)
    hand = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.5, 0.1 + 0.9 * 0.25]
    assert [f(s) for s in range(10)] == pytest.approx(hand, abs=1e-12)
    # total_steps decouples the schedule from training.steps
    g = WarmupStableDecay.from_config(LRSchedulerConfig(warmup_steps=2, total_steps=4), 100)
    assert [g(s) for s in range(4)] == pytest.approx([0.5, 1.0, 1.0, 0.5], abs=1e-12)  # stable: the virtual step


def test_each_param_groups_lr_is_scaled_by_the_schedule() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    cfg = OptimizerConfig(param_groups=[
        ParamGroupConfig(pattern=r"^0\.", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-4}),
        ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})])
    opt = build_optimizer(model, cfg, whole_model=True)
    sched = build_lr_scheduler(opt, LRSchedulerConfig(warmup_steps=4), 8)
    for step in range(8):
        want = upstream_factor(step, 4, 8, None, "linear", 0.0)
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-4 * want, 1e-2 * want])
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()


# ------------------------------------------------------------------ config: defaults, errors
def test_lr_scheduler_and_optimizer_defaults_are_upstreams() -> None:
    # a0c831c49 LRSchedulersContainer.Config and OptimizersContainer.Config
    s = LRSchedulerConfig()
    assert (s.warmup_steps, s.total_steps, s.decay_ratio, s.decay_type, s.min_lr_factor) == (
        200, None, None, "linear", 0.0)
    o = OptimizerConfig()
    assert (o.param_groups, o.implementation, o.name) == ([], "fused", "AdamW")


@pytest.mark.parametrize(("section", "fields", "named"), [
    (LRSchedulerConfig, {"warmup_steps": -1}, "lr_scheduler.warmup_steps"),
    (LRSchedulerConfig, {"decay_ratio": 1.5}, "lr_scheduler.decay_ratio"),
    (LRSchedulerConfig, {"decay_type": "exp"}, "lr_scheduler.decay_type"),
    (LRSchedulerConfig, {"total_steps": 0}, "lr_scheduler.total_steps"),
    (LRSchedulerConfig, {"min_lr_factor": 2.0}, "lr_scheduler.min_lr_factor"),
    (OptimizerConfig, {"name": "SGD"}, "optimizer.name"),
    (OptimizerConfig, {"param_groups": [{"pattern": "(", "optimizer_name": "Adam",
                                         "optimizer_kwargs": {"lr": 1e-3}}]}, "optimizer.param_groups[0].pattern"),
    (OptimizerConfig, {"param_groups": [{"pattern": ".*", "optimizer_name": "Lion",
                                         "optimizer_kwargs": {"lr": 1e-3}}]}, "optimizer.param_groups[0].optimizer_name"),
    (OptimizerConfig, {"param_groups": [{"pattern": ".*", "optimizer_name": "Adam"}]},
     "optimizer.param_groups[0].optimizer_kwargs has no 'lr'"),
    (OptimizerConfig, {"param_groups": [{"pattern": ".*", "optimizer_name": "Adam", "lr": 1}]},
     "optimizer.param_groups[0]: unknown key 'lr'"),
])
def test_a_bad_value_is_one_line_naming_the_field(section: type, fields: dict[str, Any], named: str) -> None:
    with pytest.raises((ValueError, TypeError)) as err:
        section.from_dict(fields)
    assert named in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_param_groups_from_a_dict_round_trip() -> None:
    groups = [{"pattern": r"\.router\.gate\.", "optimizer_name": "Adam", "optimizer_kwargs": {"lr": 1e-4}},
              {"pattern": ".*", "optimizer_name": "AdamW", "optimizer_kwargs": {"lr": 8e-4}}]
    cfg = JobConfig.from_dict({"optimizer": {"param_groups": groups}})
    assert cfg.optimizer.param_groups[0] == ParamGroupConfig(**groups[0])
    assert JobConfig.from_dict(cfg.to_dict()).optimizer == cfg.optimizer


# ------------------------------------------------------------------ param groups
def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    m.router = nn.Module()
    m.router.gate = nn.Linear(8, 4, bias=False)
    m.body = nn.Linear(8, 8)
    return m


def test_first_match_wins_and_each_group_has_its_optimizer() -> None:
    model = _model()
    cfg = OptimizerConfig(param_groups=[
        ParamGroupConfig(pattern=r"router\.gate\.", optimizer_name="Adam",
                         optimizer_kwargs={"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8}),
        ParamGroupConfig(pattern=r"\.weight$", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.5}),
        ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.0}),
    ], implementation="for-loop")
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, Optimizers) and [type(o).__name__ for o in opt.optimizers] == ["Adam", "AdamW"]
    adam, adamw = opt.optimizers
    # the gate's weight also matches r"\.weight$": the first pattern claimed it
    assert adam.param_groups[0]["params"] == [model.router.gate.weight]
    assert adamw.param_groups[0]["params"] == [model.body.weight]
    assert adamw.param_groups[1]["params"] == [model.body.bias]
    # one step: each parameter moved as its own group's optimizer, written out here
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    opt.step()

    def first_step(p0: torch.Tensor, g: torch.Tensor, lr: float, wd: float, decoupled: bool) -> torch.Tensor:
        if not decoupled:
            g = g + wd * p0
        p = p0 * (1 - lr * wd) if decoupled else p0.clone()
        return p - lr * g / (g.abs() + 1e-8)  # Adam's first step: m_hat / sqrt(v_hat) = sign(g)

    want = {"router.gate.weight": first_step(start["router.gate.weight"], grads["router.gate.weight"], 1e-4, 0.0, False),
            "body.weight": first_step(start["body.weight"], grads["body.weight"], 1e-2, 0.5, True),
            "body.bias": first_step(start["body.bias"], grads["body.bias"], 1e-3, 0.0, True)}
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[n], rtol=1e-5, atol=1e-6, msg=n)


def test_a_pattern_matching_nothing_and_an_unclaimed_parameter_are_errors() -> None:
    with pytest.raises(ValueError, match=r"param_groups\[1\].pattern='expert' matches no trainable parameter"):
        build_optimizer(_model(), OptimizerConfig(param_groups=[
            ParamGroupConfig(pattern="gate", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-4}),
            ParamGroupConfig(pattern="expert", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})]))
    # a pattern shadowed by an earlier one claims nothing either
    with pytest.raises(ValueError, match=r"param_groups\[1\].pattern='gate' matches no"):
        build_optimizer(_model(), OptimizerConfig(param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
            ParamGroupConfig(pattern="gate", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-4})]))
    with pytest.raises(ValueError, match=r"no pattern claims the trainable parameter\(s\) body.weight, body.bias"):
        build_optimizer(_model(), OptimizerConfig(param_groups=[
            ParamGroupConfig(pattern="gate", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-4})]))
    # a pipeline stage's part may lack what a pattern is for (the whole model was checked at setup)
    build_optimizer(_model(), OptimizerConfig(param_groups=[
        ParamGroupConfig(pattern="expert", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
        ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})]), whole_model=False)


def test_a_changed_grouping_is_one_line() -> None:
    saved = {"a.weight": "Adam '\\\\.gate'", "b.weight": "AdamW '.*'"}
    check_same_grouping(saved, dict(saved), "checkpoint step-2")
    with pytest.raises(ValueError) as err:
        check_same_grouping(saved, {"a.weight": "AdamW '.*'", "b.weight": "AdamW '.*'"}, "checkpoint step-2")
    assert "\n" not in str(err.value) and "a.weight was in Adam" in str(err.value)


# ------------------------------------------------------------------ real runs (forked gloo ranks)
STEPS = 4


#: The schedule of these runs: warm-up 1, then cosine decay over the last half to 0.2 x lr.
_SCHEDULE = {"lr_scheduler__decay_ratio": 0.5, "lr_scheduler__decay_type": "cosine", "lr_scheduler__min_lr_factor": 0.2}


def _job(folder: str, **over: Any) -> JobConfig:
    return tiny_job(folder, steps=STEPS, **{**_SCHEDULE, **over})


def _lrs_and_groups(rank: int, world: int, cfg: JobConfig) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    try:
        records = trainer.run()
        return {"lr": [r.lr for r in records],
                "group_lrs": {g["pattern"]: g["lr"] for g in trainer.optimizer.param_groups}}
    finally:
        trainer.close()


def test_the_trainer_logs_upstreams_learning_rate_at_every_step(tmp_path: Any) -> None:
    out = run_forked(_lrs_and_groups, 2, _job(str(tmp_path)), timeout_s=300)[0]
    want = [1e-2 * upstream_factor(s, 1, STEPS, 0.5, "cosine", 0.2) for s in range(STEPS)]
    assert out["lr"] == pytest.approx(want, rel=1e-12)


ROUTER_GROUPS = [
    {"pattern": r"(?:tok_embeddings|output)\.", "optimizer_name": "AdamW",
     "optimizer_kwargs": {"lr": 8e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
    {"pattern": r"\.attention\.", "optimizer_name": "Adam", "optimizer_kwargs": {"lr": 1e-4}},
    {"pattern": ".*", "optimizer_name": "AdamW", "optimizer_kwargs": {"lr": 8e-4, "weight_decay": 0.1}},
]


def test_param_groups_train_checkpoint_and_a_changed_grouping_is_refused(tmp_path: Any) -> None:
    folder = str(tmp_path)
    cfg = _job(folder, optimizer__param_groups=ROUTER_GROUPS, checkpoint__enable=True,
               checkpoint__last_save_model_only=False, checkpoint__interval=2)
    out = run_forked(_lrs_and_groups, 2, cfg, timeout_s=300)[0]
    f = WarmupStableDecay.from_config(cfg.lr_scheduler, STEPS)(STEPS)
    assert out["group_lrs"] == pytest.approx({g["pattern"]: g["optimizer_kwargs"]["lr"] * f for g in ROUTER_GROUPS})
    # the same grouping resumes (nothing left to train: the run ends at once) ...
    run_forked(_lrs_and_groups, 2, _job(folder, optimizer__param_groups=ROUTER_GROUPS, checkpoint__enable=True,
                                        checkpoint__load_step=2, checkpoint__last_save_model_only=False,
                                        training__steps=STEPS, checkpoint__keep_latest_k=0), timeout_s=300)
    # ... another one is one line naming a parameter that moved
    moved = [ROUTER_GROUPS[0], {**ROUTER_GROUPS[1], "pattern": r"\.feed_forward\."}, ROUTER_GROUPS[2]]
    with pytest.raises(Exception) as err:
        run_forked(_lrs_and_groups, 2, _job(folder, optimizer__param_groups=moved, checkpoint__enable=True,
                                            checkpoint__last_save_model_only=False), timeout_s=300)
    assert "the optimizer's param groups changed since the save" in str(err.value), str(err.value)[-2000:]


def _poisoned(rank: int, world: int, cfg: JobConfig, bad_step: int) -> dict[str, Any]:
    from torchtitan_spmd.train import NonFiniteStepError, Trainer

    trainer = Trainer(cfg)
    model_step = trainer.model.forward

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:  # the planted inf: one rank's logits
        out = model_step(*args, **kwargs)
        if trainer._step_now == bad_step and rank == 1:
            out = out + float("inf")
        return out

    trainer.model.forward = forward
    before: dict[str, torch.Tensor] = {}
    try:
        for step in range(1, STEPS + 1):
            trainer._step_now = step
            if step == bad_step:
                before = {n: p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
                          for n, p in trainer.model.named_parameters()}
                opt_steps = [float(s["step"]) for s in trainer.optimizer.state.values()]
            trainer.step(step)
            trainer.checkpointer.save(step, last_step=step == STEPS)
        return {"raised": None}
    except NonFiniteStepError as err:
        after = {n: p.detach().to_local() if hasattr(p, "to_local") else p.detach()
                 for n, p in trainer.model.named_parameters()}
        trainer.checkpointer.wait()
        return {"raised": str(err), "unchanged": all(torch.equal(before[n], after[n]) for n in before),
                "opt_steps_unchanged": opt_steps == [float(s["step"]) for s in trainer.optimizer.state.values()],
                "agreed": getattr(err, "agreed", False)}
    finally:
        trainer.close()


def test_an_inf_loss_stops_before_the_optimizer_and_writes_no_checkpoint(tmp_path: Any) -> None:
    folder = str(tmp_path)
    cfg = _job(folder, checkpoint__enable=True, checkpoint__interval=1, checkpoint__last_save_model_only=False)
    per_rank = run_forked(_poisoned, 2, cfg, 3, timeout_s=300)
    for out in per_rank:  # every rank stops at the same step, before its optimizer steps
        assert out["raised"] is not None and out["raised"].startswith("step 3: the loss is "), out
        assert "not finite" in out["raised"] and "\n" not in out["raised"]
        assert out["unchanged"] and out["opt_steps_unchanged"] and out["agreed"], out
    saved = sorted(os.listdir(os.path.join(folder, "checkpoint")))
    assert saved == ["step-1", "step-2"], saved


# ------------------------------------------------------------------ dataloader.* (upstream's names)
def test_dataloader_section_and_the_old_training_spelling_warns(tmp_path: Any) -> None:
    from torchtitan_spmd.compat.legacy import LegacySpellingWarning
    from torchtitan_spmd.config import ConfigManager, DataloaderConfig
    from torchtitan_spmd.config.manager import LIBRARY_FIRST

    base = ["--module", "llama3", "--config", "llama3_debugmodel"]

    assert (DataloaderConfig().dataset, DataloaderConfig().dataset_path) == ("synthetic", None)
    path = str(tmp_path / "d.jsonl")
    with pytest.warns(LegacySpellingWarning, match=r"training.dataset is deprecated .* use dataloader.dataset"):
        cfg = JobConfig.from_dict({"training": {"dataset": "json", "dataset_path": path}})
    assert (cfg.dataloader.dataset, cfg.dataloader.dataset_path) == ("json", path)
    assert (cfg.training.dataset, cfg.training.dataset_path) == (None, None)
    with pytest.warns(LegacySpellingWarning, match="training.dataset_path is deprecated"):
        cli = ConfigManager(module_packages=LIBRARY_FIRST).parse_args([*base, "--training.dataset", "json", "--training.dataset_path", path])
    assert cli.dataloader == cfg.dataloader
    new = ConfigManager(module_packages=LIBRARY_FIRST).parse_args([*base, "--dataloader.dataset", "json", "--dataloader.dataset_path", path])
    assert new.dataloader == cfg.dataloader
    with pytest.raises(ValueError, match=r"conflicting settings training.dataset='c4_test' and "
                                         r"dataloader.dataset='json'"):
        JobConfig.from_dict({"training": {"dataset": "c4_test"}, "dataloader": {"dataset": "json",
                                                                               "dataset_path": path}})
    with pytest.raises(ValueError, match="dataloader.dataset='json' needs dataloader.dataset_path"):
        JobConfig.from_dict({"dataloader": {"dataset": "json"}})


# ------------------------------------------------------------------ the validator
VAL_STEPS = 2


def _validation(rank: int, world: int, cfg: JobConfig, masked: bool) -> dict[str, Any]:
    from torchtitan_spmd.techniques.loss import IGNORE_INDEX
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    seen: list[tuple[bool, bool]] = []
    hook = trainer.model.register_forward_pre_hook(
        lambda m, a: seen.append((m.training, torch.is_grad_enabled())))
    assert trainer.validator is not None
    if masked:  # batches with different numbers of ignored labels: only a token-weighted mean is right
        plain = trainer.validator.build_dataloader

        def masked_batches() -> Any:
            for i, (x, y) in enumerate(plain()):
                y = y.clone()
                y[:, : (1 + 13 * (i % 2))] = IGNORE_INDEX  # 1 then 14 of 16 labels ignored per row
                yield x, y

        trainer.validator.build_dataloader = masked_batches
    try:
        record = trainer.validator.validate(0)
        after = trainer.model.training
        hook.remove()
        return {"loss": record.loss, "tokens": record.tokens, "seen": seen, "train_mode_after": after}
    finally:
        trainer.close()


def _reference_validation_loss(cfg: JobConfig, masked: bool) -> tuple[float, int]:
    """The float64 reference: the initial weights, the global validation batches (the single-process
    loader at seed + 1, global batch = 2 ranks x local batch), the mean over every non-ignored token."""
    import torch.nn.functional as F

    from torchtitan_spmd.data import build_dataloader, build_tokenizer
    from torchtitan_spmd.models import get_model_spec

    vocab = build_tokenizer(None).model_vocab_size
    weights = {k: v.double() for k, v in reference.initial_weights("llama3", "tiny", 7, vocab).items()}
    arch = reference.architecture(cfg, get_model_spec("llama3").model_config("tiny", vocab_size=vocab))
    loader = build_dataloader(dp_rank=0, dp_degree=1, local_batch_size=2 * cfg.training.local_batch_size,
                              seq_len=cfg.training.seq_len, seed=8)
    total, count = 0.0, 0
    for i in range(VAL_STEPS):
        tokens, labels = next(loader)
        if masked:
            labels = labels.clone()
            labels[:, : (1 + 13 * (i % 2))] = -100
        logits = reference.forward(weights, tokens, arch)
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                       reduction="sum", ignore_index=-100))
        count += int((labels != -100).sum())
    return total / count, count


# The masked case's token weighting is backend-independent arithmetic: checked once, on default.
@pytest.mark.parametrize(("backend", "masked"), [("default", False), ("default", True), ("full_dtensor", False),
                                                 ("spmd_types", False)],
                         ids=["full-default", "masked-default", "full-full_dtensor", "full-spmd_types"])
def test_validation_loss_is_the_token_weighted_reference_loss_in_eval_mode(tmp_path: Any, backend: str,
                                                                           masked: bool) -> None:
    cfg = _job(str(tmp_path), validator__enable=True, validator__steps=VAL_STEPS,
               parallelism__spmd_backend=backend,
               parallelism__data_parallel_shard_degree=1 if backend == "full_dtensor" else 2,
               parallelism__data_parallel_replicate_degree=2 if backend == "full_dtensor" else 1,
               activation_checkpoint__mode="full")
    out = run_forked(_validation, 2, cfg, masked, timeout_s=300)
    want, tokens = _reference_validation_loss(cfg, masked)
    for rank_out in out:
        assert rank_out["loss"] == pytest.approx(want, rel=1e-5), (rank_out["loss"], want)
        assert rank_out["tokens"] == tokens
        assert rank_out["seen"] and all(s == (False, False) for s in rank_out["seen"]), rank_out["seen"]
        assert rank_out["train_mode_after"] is True


def test_validator_fields_defaults_and_errors() -> None:
    from torchtitan_spmd.config import ValidatorConfig

    v = ValidatorConfig()
    assert (v.enable, v.freq, v.steps) == (False, 10, -1)  # a0c831c49's Validator.Config
    for fields, named in (({"freq": 0}, "validator.freq"), ({"steps": 0}, "validator.steps"),
                          ({"enable": True}, "validator.steps=-1"),
                          ({"dataloader": {"dataset": "jsonl"}}, "dataloader.dataset")):
        with pytest.raises(ValueError, match=named):
            ValidatorConfig.from_dict(fields)


# ------------------------------------------------------------------ profiler, metrics, W&B
def _have_wandb() -> bool:
    try:
        import wandb  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise  # the dev extra installs it: in CI a missing wandb is a failure, not a skip
        return False
    return True


def _recipe_run(rank: int, world: int, cfg: JobConfig) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    try:
        records = trainer.run()
        return {"records": [(r.step, r.loss, r.mfu, r.tflops, r.data_loading_s) for r in records],
                "validations": [(v.step, v.loss) for v in trainer.validations],
                "traces": list(trainer.profiler.traces), "flops_per_token": trainer.flops_per_token}
    finally:
        trainer.close()


def test_profiler_traces_tensorboard_validation_mfu_and_wandb_offline(tmp_path: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import gzip
    import json

    from hf_data_helpers import read_scalars

    wandb = _have_wandb()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    folder = str(tmp_path)
    cfg = _job(folder, profiler__enable_profiling=True, profiler__profile_freq=2, profiler__profiler_warmup=0,
               profiler__profiler_active=1, validator__enable=True, validator__freq=2, validator__steps=1,
               metrics__enable_tensorboard=True, metrics__enable_wandb=wandb, metrics__cpu_peak_tflops=0.5)
    per_rank = run_forked(_recipe_run, 2, cfg, timeout_s=400)
    out = per_rank[0]
    # one Chrome trace per rank per window (steps 2 and 4), each parsing and holding the step's ops
    for rank, theirs in enumerate(per_rank):
        assert [os.path.relpath(t, folder) for t in theirs["traces"]] == [
            f"profiling/traces/iteration_{s}/rank{rank}_trace.json.gz" for s in (2, 4)]
        with gzip.open(theirs["traces"][0], "rt") as f:
            events = json.load(f)["traceEvents"]
        names = {e.get("name") for e in events}
        assert any(str(n).startswith("ProfilerStep#") for n in names), sorted(map(str, names))[:40]
        assert names & {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear"}, sorted(map(str, names))[:40]
        assert any(str(n).startswith("FSDP::all_gather") for n in names)  # the step's communication too
    # MFU from the configured peak: tflops = flops/token x this rank's tokens/s; mfu = tflops / 0.5 TFLOP/s
    for _, _, mfu, tflops, data_s in out["records"]:
        assert mfu == pytest.approx(100 * tflops / 0.5, rel=1e-9) and tflops > 0 and data_s >= 0
    assert [s for s, _ in out["validations"]] == [1, 2, 4]
    scalars = read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["validation_metrics/loss"]] == [1, 2, 4]
    assert [v for _, v in scalars["validation_metrics/loss"]] == pytest.approx([v for _, v in out["validations"]])
    assert [v for _, v in scalars["mfu(%)"]] == pytest.approx([r[2] for r in out["records"]], rel=1e-5)
    assert "time_metrics/data_loading(s)" in scalars
    if wandb:  # the offline run file holds every logged value: each a key and its JSON text
        (run_file,) = list((tmp_path / "wandb").rglob("run-*.wandb"))
        data = run_file.read_bytes()
        assert b"loss_metrics/global_avg_loss" in data and b"validation_metrics/loss" in data and b"mfu(%)" in data
        for _, loss, *_ in out["records"]:
            assert json.dumps(loss).encode() in data, loss
        for _, loss in out["validations"]:
            assert json.dumps(loss).encode() in data, loss


def test_profiler_and_metrics_defaults_are_upstreams() -> None:
    from torchtitan_spmd.config import MetricsConfig, ProfilerConfig

    p = ProfilerConfig()
    assert (p.enable_profiling, p.save_traces_folder, p.profile_freq, p.profiler_repeat, p.profiler_skip_first,
            p.profiler_skip_first_wait, p.profiler_active, p.profiler_warmup, p.enable_memory_snapshot,
            p.save_memory_snapshot_folder, p.memory_snapshot_max_entries) == (
        False, "profiling/traces", 10, None, None, None, 1, 3, False, "profiling/memory_snapshot", 1_000_000)
    m = MetricsConfig()
    assert (m.enable_wandb, m.save_for_all_ranks, m.disable_color_printing) == (False, False, False)
    with pytest.raises(ValueError, match=r"profiler.profile_freq must be >= profiler_warmup \+ profiler_active"):
        ProfilerConfig(profile_freq=2)
    with pytest.raises(ValueError, match="metrics.cpu_peak_tflops must be > 0"):
        MetricsConfig(cpu_peak_tflops=0.0)


@pytest.mark.parametrize(("memory_snapshot_freq", "profile_freq", "dumped"), [
    (None, 5, [5, 10, 15]),  # unset: upstream b5bcd76's default, profile_freq
    (3, 5, [3, 6, 9, 12, 15]),  # set: its own cadence, whatever the trace windows
    (1, 10, list(range(1, 16))),
])
def test_memory_snapshot_cadence_follows_memory_snapshot_freq(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                             memory_snapshot_freq: int | None, profile_freq: int,
                                                             dumped: list[int]) -> None:
    """``profiler.memory_snapshot_freq`` (b5bcd76, docs/debugging.md): a snapshot every N steps;
    unset, every ``profile_freq`` steps. The snapshot writer runs as on CUDA, the allocator's
    history stubbed (this machine has none); on CPU the profiler records none (one log line)."""
    from torchtitan_spmd.config import ProfilerConfig
    from torchtitan_spmd.tools.profiler import Profiler

    cfg = ProfilerConfig(enable_memory_snapshot=True, profile_freq=profile_freq, profiler_warmup=0,
                         memory_snapshot_freq=memory_snapshot_freq)
    assert cfg.memory_snapshot_freq == memory_snapshot_freq  # read back as written
    with Profiler(cfg, str(tmp_path), rank=0, device_type="cpu") as cpu:
        for _ in range(15):
            cpu.step()
    assert not (tmp_path / cfg.save_memory_snapshot_folder).exists()  # CPU: no allocator history
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": []})
    prof = Profiler(cfg, str(tmp_path), rank=0, device_type="cpu")
    prof._memory = True  # as after _record_memory_history on a CUDA device
    for _ in range(15):
        prof.step()
    folders = sorted((tmp_path / cfg.save_memory_snapshot_folder).iterdir())
    assert [int(f.name.removeprefix("step_")) for f in folders] == dumped
    with pytest.raises(ValueError, match="profiler.memory_snapshot_freq must be >= 1"):
        ProfilerConfig(memory_snapshot_freq=0)


def test_the_cpu_peak_is_measured_once_per_process_and_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MFU's CPU peak: a timed matmul, once per process and thread count (every later trainer,
    and every rank forked after it, reuses the figure); a configured peak times nothing."""
    from torchtitan_spmd.tools import flops

    flops._measured_cpu_peak.cache_clear()
    timings: list[float] = []
    clock = flops.time.perf_counter
    monkeypatch.setattr(flops.time, "perf_counter", lambda: timings.append(1.0) or clock())
    threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    first = flops.peak_flops("cpu", None)
    assert torch.equal(torch.get_rng_state(), rng)  # a run's random stream is not the measurement's to move
    assert first[0] > 0 and first[1] == f"measured (a 512x512 float32 matmul on {threads} thread(s))", first
    assert len(timings) == 10  # five timed matmuls, a start and an end each
    assert flops.peak_flops("cpu", None) == first and len(timings) == 10
    assert flops.peak_flops("cpu", 0.5) == (0.5e12, "configured (metrics.cpu_peak_tflops)") and len(timings) == 10
    torch.set_num_threads(threads + 1)
    try:
        other = flops.peak_flops("cpu", None)
    finally:
        torch.set_num_threads(threads)
    assert other[1] == f"measured (a 512x512 float32 matmul on {threads + 1} thread(s))" and len(timings) == 20


def _peak_in_a_rank(rank: int, world: int) -> tuple[int, tuple[float, str], int]:
    from torchtitan_spmd.tools import flops

    before = flops._measured_cpu_peak.cache_info().misses
    peak = flops.peak_flops("cpu", None)
    return before, peak, flops._measured_cpu_peak.cache_info().misses


def test_a_forked_rank_inherits_the_cpu_peak_measured_before_the_fork() -> None:
    """The ranks of ``run_forked`` (one thread each) reuse a one-thread peak measured in their
    parent: the tests measure it once per worker (parity_helpers.warm_parent), not once per rank."""
    from torchtitan_spmd.tools import flops

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measured = flops.peak_flops("cpu", None)
    finally:
        torch.set_num_threads(threads)
    [(before, peak, after)] = run_forked(_peak_in_a_rank, 1)
    assert peak == measured and before == after, (peak, measured, before, after)


def test_flops_per_token_is_upstreams_count() -> None:
    from torchtitan_spmd.models import get_model_spec
    from torchtitan_spmd.tools.flops import flops_per_token

    spec = get_model_spec("llama3")
    mc = spec.model_config("tiny", vocab_size=320)
    with torch.device("meta"):
        model = spec.build(mc)
    params = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel()
    head_dim = mc.dim // mc.n_heads
    # 6 x (parameters - embedding) + 6 x layers x heads x (q/k + v head dims) x seq_len
    assert flops_per_token(model, mc, 64) == 6 * (params - embedding) + 6 * mc.n_layers * mc.n_heads * 2 * head_dim * 64
