"""The validation loop of ``[validator]`` (upstream's ``Validator``, a0c831c49; the loss as HEAD).

At step 1 and every ``validator.freq`` steps the trainer runs ``validator.steps`` validation
batches from the start of the validation data (a fresh loader at each validation, as upstream's
``validate()`` builds one, so every validation measures the same batches), or with
``validator.steps = -1`` one pass over a file dataset (upstream's ``infinite=False``: every whole
global batch of the set, the same count on every rank). The model in eval mode (restored after), under ``torch.no_grad``, in the same train
context, autocast and representation as training, on every backend. The loss is upstream
HEAD's (#4167) **token-weighted** mean: the sum of every rank's per-token losses over every
validation batch, divided by the number of non-ignored tokens of all of them (not the mean
of the batches' means, which weights a batch with few tokens as much as a full one).

Each batch's loss is computed as the training loss is (:func:`cross_entropy_loss` with that
batch's global token count: the batch's global mean), then weighted by that count. A batch
goes through the trainer's own :meth:`~torchtitan_spmd.train.Trainer.prepare_batch`, so under
context parallelism each rank validates its slice of every sequence at its global RoPE
positions, with the ring attention the model was built with (as a training step). Under
pipeline parallelism the batch runs through torch's schedule forward only (its ``eval``,
upstream's validator's call; :meth:`~torchtitan_spmd.techniques.pipeline_parallel.PipelineParallel.evaluate`):
each microbatch's loss on the last stage is its per-token sum over the batch's global count,
and the sum is agreed over ``pp`` (the other stages contribute 0), as the training loss is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_spmd.data import build_dataloader, load_documents
from torchtitan_spmd.techniques.loss import global_loss_value, global_token_count

__all__ = ["ValidationRecord", "Validator", "validate_validator"]


@dataclass(frozen=True)
class ValidationRecord:
    """One validation: the token-weighted mean loss over ``steps`` batches (those validated) and
    ``tokens`` tokens."""

    step: int
    loss: float
    tokens: int
    steps: int
    seconds: float

    def log_line(self) -> str:
        """``validate step: 10  loss: 5.123456  tokens: 4096  time: 0.12s``."""
        return (f"validate step: {self.step}  loss: {self.loss:.6f}  tokens: {self.tokens}  "
                f"time: {self.seconds:.2f}s")


def validate_validator(job_config: Any, stages: Any) -> None:
    """Setup errors of ``[validator]`` that need the validated pipeline (``stages``: the
    :class:`~torchtitan_spmd.techniques.pipeline_parallel.PipelineStages`, or None without PP):
    a ``ValueError`` naming the fields.

    A V-shaped schedule (``ZBVZeroBubble``, ``DualPipeV``) cannot validate: torch's ``eval`` of
    its runtime (torch 2.14.1) still runs the backward actions of the rank's two stages and fails
    in the first one ("can't steal_bwd_input if this stage doesn't have backward", measured).
    """
    if job_config.validator.enable and stages is not None and stages.v_shaped:
        raise ValueError(
            f"validator.enable=True with parallelism.pipeline_parallel_schedule={stages.schedule_name!r}: "
            "torch's forward-only run (schedule.eval) of a V-shaped schedule fails (it runs the backward "
            "actions of the rank's two stages); validate with a looped schedule such as 'Interleaved1F1B' "
            "or 'InterleavedZeroBubble', or set validator.enable=False.")


class Validator:
    """Runs validation for a :class:`~torchtitan_spmd.train.Trainer` (its model, representation,
    loss, contexts and data-parallel layout; typed ``Any``: this module sits beside the trainer,
    which imports it)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        cfg = trainer.job_config
        self.config = cfg.validator
        data = self.config.dataloader
        #: A file dataset's documents, read once (each validation packs them afresh); None: synthetic.
        self.documents: Any = None
        if data.dataset != "synthetic":
            self.documents = load_documents(data.dataset, data.dataset_path)
        if self.config.steps == -1:  # one pass: a set shorter than one global batch would validate nothing
            try:
                next(self.build_dataloader())
            except StopIteration:
                raise ValueError(
                    f"validator.steps=-1: validator.dataloader.dataset={data.dataset!r} at "
                    f"{data.dataset_path!r} holds fewer tokens than one global validation batch "
                    f"(training.local_batch_size x data-parallel degree rows of training.seq_len + 1 "
                    f"= {cfg.training.seq_len + 1} tokens): give it more documents, or set validator.steps."
                ) from None

    def build_dataloader(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A fresh validation loader at the start of the validation data (upstream builds one in
        every ``validate()``): endless with ``validator.steps >= 1``, one pass with -1."""
        t = self.trainer
        batch_mesh = t.parallel_dims.get_optional_mesh("batch")
        data = self.config.dataloader
        return build_dataloader(
            dp_rank=batch_mesh.get_local_rank() if batch_mesh is not None else 0,
            dp_degree=batch_mesh.size() if batch_mesh is not None else 1,
            local_batch_size=t.local_rows, seq_len=t.job_config.training.seq_len,  # one schedule iteration under PP
            # synthetic validation data is a stream held out from training's (another seed)
            seed=t.seed + 1, dataset=data.dataset, dataset_path=data.dataset_path,
            tokenizer=t.tokenizer, infinite=self.config.steps != -1, documents=self.documents,
        )

    def should_validate(self, step: int) -> bool:
        """Upstream's rule: step 1 and every ``freq`` steps."""
        return step == 1 or step % self.config.freq == 0

    @torch.no_grad()
    def validate(self, step: int) -> ValidationRecord:
        """Run ``validator.steps`` batches (-1: one pass) of a fresh loader and return their
        token-weighted mean loss (every rank alike)."""
        t = self.trainer
        rep, pipeline = t.representation, t.pipeline
        start = time.perf_counter()
        # the model and every root a pipeline stage runs (a multi-stage rank's views have their own flag)
        modules = list(dict.fromkeys([t.model, *t.model_parts]))
        was_training = [m.training for m in modules]
        for m in modules:
            m.eval()
        weighted, tokens, batches = 0.0, 0.0, 0
        dataloader = self.build_dataloader()
        try:
            for inputs, labels in dataloader:  # -1: the whole pass; otherwise the first `steps` batches
                if self.config.steps != -1 and batches >= self.config.steps:
                    break
                batches += 1
                [(inputs, labels)], [positions] = t.prepare_batch(inputs.to(t.device_type), labels.to(t.device_type))
                with t.train_context():
                    count = global_token_count([labels], rep)
                n = float(rep.to_local(count))
                if pipeline is not None:  # the schedule forward only; the loss on the last stage
                    with t.schedule_context(), t.amp():
                        local = pipeline.evaluate(inputs, labels, count, positions)
                    value = pipeline.global_loss(local, rep.sum_over_batch)
                else:
                    with t.train_context():
                        with t.amp():
                            logits = t.model(inputs) if positions is None else t.model(inputs, positions=positions)
                        loss = t.loss_fn(logits, labels, rep, logits_layout=t.plan.output_layout(),
                                         token_count=count)
                        value = global_loss_value(loss, rep)
                # the batch's global mean, weighted by its global token count
                weighted += value * n
                tokens += n
        finally:
            for m, mode in zip(modules, was_training, strict=True):
                m.train(mode)
        mean = weighted / tokens if tokens > 0 else float("nan")
        return ValidationRecord(step=step, loss=mean, tokens=int(tokens), steps=batches,
                                seconds=time.perf_counter() - start)
