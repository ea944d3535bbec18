"""What the validator tests under PP and CP share (``test_validation_parallel.py``, and layer 4's
``test_validation_spmd.py``): the job, the forked rank's validation, and the float64 reference.

The labels are masked unevenly (a different number of ignored labels per row and per batch),
and a few weights are scaled alike in the trainer and the reference, so a mean of
per-microbatch or per-batch means, a rank's tokens counted twice or not at all, or RoPE at
the wrong positions, is off by far more than the tolerance.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from torchtitan_spmd import reference
from torchtitan_spmd.config import JobConfig

VAL_STEPS = 2
SEED = 7
#: Ignored labels at the start of each row: row ``r`` of validation batch ``i`` ignores
#: ``_IGNORED[(r + 2 * i) % 4]`` of its 16 (so every microbatch and batch has its own count).
_IGNORED = (1, 13, 6, 10)
#: Weights scaled in the trainer and in the reference alike. At the initial weights every token's
#: loss is within 1e-3 of log(vocab), which would hide a wrong weighting, and attention is nearly
#: uniform, which would hide wrong RoPE positions (measured: CP at local positions passed).
_SCALES = {"output.weight": 20.0, "attention.wq.weight": 8.0, "attention.wk.weight": 8.0}


def scale(name: str) -> float | None:
    """The factor of a parameter of :data:`_SCALES` (by its name's suffix), else None."""
    return next((f for suffix, f in _SCALES.items() if name == suffix or name.endswith("." + suffix)), None)


def mask(labels: torch.Tensor, batch: int) -> torch.Tensor:
    """``labels`` (this batch's global rows, data-parallel degree 1) with the test's labels ignored."""
    labels = labels.clone()
    for row in range(labels.shape[0]):
        labels[row, : _IGNORED[(row + 2 * batch) % 4]] = -100
    return labels


def job(folder: str, parallelism: dict[str, Any]) -> JobConfig:
    """``llama3`` ``tiny``, seq 16, local batch 2, the validator on for :data:`VAL_STEPS` batches."""
    return JobConfig.from_dict({
        "job": {"dump_folder": folder},
        "model": {"name": "llama3", "flavor": "tiny"},
        "training": {"steps": 1, "local_batch_size": 2, "seq_len": 16, "device": "cpu",
                     "mixed_precision_param": "float32"},
        "activation_checkpoint": {"mode": "none"},
        "lr_scheduler": {"warmup_steps": 1},
        "validator": {"enable": True, "steps": VAL_STEPS},
        "parallelism": {"data_parallel_shard_degree": 1, **parallelism},
        "debug": {"seed": SEED},
    })


def validate_on_rank(rank: int, world: int, cfg: JobConfig) -> dict[str, Any]:
    """Build the trainer (initial weights), mask its validation batches, validate once."""
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    assert trainer.validator is not None
    scaled = []
    with torch.no_grad():  # the stage's own (PP); a DTensor's shards in place (CP)
        for name, param in trainer.model.named_parameters():
            if (factor := scale(name)) is not None:
                param.mul_(factor)
                scaled.append(name)
    seen: list[tuple[bool, bool]] = []  # (training, grad enabled) at every stage's forward
    hooks = [m.register_forward_pre_hook(lambda m, a: seen.append((m.training, torch.is_grad_enabled())))
             for m in trainer.model_parts]
    plain = trainer.validator.build_dataloader
    trainer.validator.build_dataloader = lambda: ((x, mask(y, i)) for i, (x, y) in enumerate(plain()))
    try:
        record = trainer.validator.validate(0)
        for h in hooks:
            h.remove()
        # then a training step (torch's schedule switches back from eval): its loss is the
        # reference's on the first training batch, and its gradient norm is finite
        step = trainer.step(1)
        return {"loss": record.loss, "tokens": record.tokens, "seen": seen,
                "train_mode_after": [m.training for m in trainer.model_parts],
                "step_loss": step.loss, "grad_norm": step.grad_norm, "scaled": scaled}
    finally:
        trainer.close()


def reference_losses(cfg: JobConfig) -> tuple[float, int, float]:
    """The float64 reference's token-weighted mean loss over the same masked global batches
    (one process, whole sequences, the initial weights of seed 7, validation data at seed 8),
    their token count, and the loss of the first training batch (seed 7)."""
    from torchtitan_spmd.data import build_dataloader, build_tokenizer
    from torchtitan_spmd.models import get_model_spec

    vocab = build_tokenizer(None).model_vocab_size
    weights = {k: v.double() for k, v in reference.initial_weights("llama3", "tiny", SEED, vocab).items()}
    weights = {k: v * f if (f := scale(k)) is not None else v for k, v in weights.items()}
    arch = reference.architecture(cfg, get_model_spec("llama3").model_config("tiny", vocab_size=vocab))
    loader = build_dataloader(dp_rank=0, dp_degree=1, local_batch_size=cfg.training.local_batch_size,
                              seq_len=cfg.training.seq_len, seed=SEED + 1)
    train_tokens, train_labels = next(build_dataloader(dp_rank=0, dp_degree=1, local_batch_size=2,
                                                       seq_len=cfg.training.seq_len, seed=SEED))
    train_logits = reference.forward(weights, train_tokens, arch)
    train_loss = float(F.cross_entropy(train_logits.reshape(-1, train_logits.shape[-1]), train_labels.reshape(-1)))
    total, count = 0.0, 0
    for i in range(VAL_STEPS):
        tokens, labels = next(loader)
        labels = mask(labels, i)
        logits = reference.forward(weights, tokens, arch)
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                       reduction="sum", ignore_index=-100))
        count += int((labels != -100).sum())
    return total / count, count, train_loss


def check(out: list[dict[str, Any]], cfg: JobConfig) -> None:
    """Every rank's validation against the reference (value, tokens, eval mode and no grad at every
    stage's forward, train mode after), then its training step's loss."""
    want, tokens, train_loss = reference_losses(cfg)
    for rank, rank_out in enumerate(out):
        assert rank_out["loss"] == pytest.approx(want, rel=1e-5), (rank, rank_out["loss"], want)
        assert rank_out["tokens"] == tokens, (rank, rank_out["tokens"], tokens)
        assert rank_out["seen"] and all(s == (False, False) for s in rank_out["seen"]), (rank, rank_out["seen"])
        assert all(rank_out["train_mode_after"]), rank
        assert rank_out["step_loss"] == pytest.approx(train_loss, rel=1e-5), (rank, rank_out["step_loss"])
        assert math.isfinite(rank_out["grad_norm"]), rank
    scaled = {n for rank_out in out for n in rank_out["scaled"]}  # every stage's names together
    assert len(scaled) == 5 and "output.weight" in scaled, scaled  # output, wq and wk of 2 layers
