"""Helpers for the converter tests: the trainer with model converters on forked gloo ranks, and the
judge it is compared with: torchao's own single-process ``Float8Linear`` model, which shares no
code with the library's float8 technique.

The judge is the tiny Llama built from the same seed (the family's ``initial_value``, which every
layout starts from), converted by ``torchao.float8.convert_to_float8_training`` with the same
recipe, trained with ``torch.optim.AdamW`` on the same global batches, the learning rate from the
reference's closed form (:func:`torchtitan_spmd.reference.lr_factor`). Each data-parallel rank's
rows go through the model as their own forward (float8 scales tokens per rank: the weight
gradient's per-column scales are those of the rank's batch, in a run as in upstream's FSDP); the
loss is the global token mean, so the gradients add up as FSDP's do.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import grad_probe
import torch
import torch.nn.functional as F
from parity_helpers import job_config, warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

__all__ = ["F8_STEPS", "PARALLELISM", "float8_job", "run_trainer", "torchao_reference"]

PARALLELISM: dict[str, Any] = {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}
F8_STEPS = 3
LOCAL_BATCH = 2


def float8_job(backend: str, converters: list[Any], *, parallelism: dict[str, Any] | None = None,
               steps: int = F8_STEPS, **debug: Any) -> JobConfig:
    """The parity job (tiny Llama, fp32, deterministic) of ``backend`` with ``converters``."""
    cfg = job_config(backend, parallelism or PARALLELISM, local_batch=LOCAL_BATCH, steps=steps, **debug)
    cfg.model.converters = list(converters)
    cfg.validate()
    return cfg


def _train(rank: int, world: int, cfg: JobConfig, probe: str | None) -> dict[str, Any]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    extra: dict[str, Any] = {}
    if probe is not None:
        import importlib

        module, _, name = probe.partition(":")
        extra = getattr(importlib.import_module(module), name)(trainer)
    records = [trainer.step(s) for s in range(1, cfg.training.steps + 1)]
    out = {"records": [(r.loss, r.grad_norm) for r in records]}
    if probe is not None:
        out["probe"] = extra["result"]()
    trainer.close()
    return out


def run_trainer(cfg: JobConfig, world: int = 4, probe: str | None = None) -> tuple[list[dict[str, Any]], Any]:
    """Every rank's ``{"records", "probe"}`` and the pooled step-1 gradient trace (:mod:`grad_probe`)."""
    warm_parent()
    results = run_forked(grad_probe.probed(_train), world, cfg, probe, timeout_s=300)
    outs = [r for r, _ in results]
    for rank, out in enumerate(outs):
        assert out["records"] == outs[0]["records"], f"rank {rank} logged {out['records']}, rank 0 {outs[0]['records']}"
    return outs, grad_probe.merge([t for _, t in results])[0]


@functools.cache
def torchao_reference(recipe: str, dp: int, steps: int = F8_STEPS, skip: tuple[str, ...] = ()) -> tuple[
        tuple[tuple[float, float], ...], tuple[tuple[str, float], ...]]:
    """``((loss, grad_norm) per step, (name, step-1 gradient norm) per parameter)`` of torchao's own
    float8 model (emulated ``recipe``) on the parity job's data over ``dp`` data-parallel ranks;
    the linears whose name is in ``skip`` stay in high precision."""
    import torchao.float8 as f8

    from torchtitan_spmd import reference
    from torchtitan_spmd.data import build_tokenizer
    from torchtitan_spmd.models import get_model_spec

    cfg = float8_job("default", [], parallelism={"data_parallel_shard_degree": 1}, steps=steps)
    seed, vocab = cfg.debug.seed, build_tokenizer(None).model_vocab_size
    model = get_model_spec("llama3").build_initialized(cfg.model.flavor, seed=seed, vocab_size=vocab,
                                                       max_seq_len=cfg.training.seq_len)
    config = dataclasses.replace(f8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    f8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: (
        m.in_features % 16 == 0 and m.out_features % 16 == 0 and fqn.rpartition(".")[2] not in skip))
    n_float8 = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    want = 15 - sum(2 if s in ("wq", "wk", "wv", "wo", "w1", "w2", "w3") else 1 for s in skip)
    assert n_float8 == want, f"torchao converted {n_float8} linears, expected {want}"
    opt_cfg = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay,
                            betas=reference.ADAMW_BETAS, foreach=False)
    records, grad_norms = [], ()
    batches = reference.global_batches(cfg, dp * LOCAL_BATCH, seed)
    for step, (tokens, labels) in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = opt_cfg.lr * reference.lr_factor(
                step, warmup_steps=cfg.lr_scheduler.warmup_steps, total_steps=steps,
                min_lr_factor=cfg.lr_scheduler.min_lr_factor, decay_ratio=cfg.lr_scheduler.decay_ratio,
                decay_type=cfg.lr_scheduler.decay_type)
        total = torch.zeros(())
        for r in range(dp):  # each data-parallel rank's rows: their own forward, their own scales
            rows = slice(r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH)
            logits = model(tokens[rows])
            total = total + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[rows].reshape(-1),
                                            reduction="sum")
        loss = total / labels.numel()
        loss.backward()
        if step == 0:
            grad_norms = tuple((n, float(p.grad.norm())) for n, p in model.named_parameters())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float(cfg.training.max_norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
        records.append((float(loss.detach()), float(norm)))
    return tuple(records), grad_norms


#: The casts of one float8 linear's forward and backward: 2 + 4.
CASTS_PER_LINEAR = 6


def _recording(calls: list[tuple[str, list[float], tuple[int, ...]]], limit: int, real: Any) -> Any:
    def hp_tensor_and_scale_to_float8(hp_tensor: torch.Tensor, s: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if len(calls) < limit:
            role = args[2] if len(args) > 2 else kwargs.get("gemm_input_role")
            scale = s.to_local() if hasattr(s, "to_local") else s
            calls.append((str(role), [float(v) for v in scale.reshape(-1)], tuple(scale.shape)))
        return real(hp_tensor, s, *args, **kwargs)

    return hp_tensor_and_scale_to_float8


def scale_probe(trainer: Any) -> dict[str, Any]:
    """Every float8 cast's scale (role, values, local shape) of this rank's first forward and backward."""
    import torchao.float8.float8_training_tensor as tt

    n_linears = sum(type(m).__name__.endswith("Float8Linear") for m in trainer.model.modules())
    calls: list[tuple[str, list[float], tuple[int, ...]]] = []
    tt.hp_tensor_and_scale_to_float8 = _recording(calls, CASTS_PER_LINEAR * n_linears, tt.hp_tensor_and_scale_to_float8)
    return {"result": lambda: {"calls": calls, "tp_rank": trainer.parallel_dims.get_mesh("tp").get_local_rank()}}


def torchao_scales(recipe: str) -> list[tuple[str, list[float], tuple[int, ...]]]:
    """The same casts of torchao's single-process model: data-parallel rank 0's rows of step 1."""
    import torchao.float8 as f8
    import torchao.float8.float8_scaling_utils as su

    from torchtitan_spmd import reference
    from torchtitan_spmd.data import build_tokenizer
    from torchtitan_spmd.models import get_model_spec

    cfg = float8_job("default", [], parallelism={"data_parallel_shard_degree": 1}, steps=1)
    seed, vocab = cfg.debug.seed, build_tokenizer(None).model_vocab_size
    model = get_model_spec("llama3").build_initialized(cfg.model.flavor, seed=seed, vocab_size=vocab,
                                                       max_seq_len=cfg.training.seq_len)
    config = dataclasses.replace(f8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    f8.convert_to_float8_training(model, config=config)
    calls: list[tuple[str, list[float], tuple[int, ...]]] = []
    real = su.hp_tensor_and_scale_to_float8
    su.hp_tensor_and_scale_to_float8 = _recording(calls, 10**6, real)
    try:
        tokens, labels = reference.global_batches(cfg, 2 * LOCAL_BATCH, seed)[0]
        logits = model(tokens[:LOCAL_BATCH])
        # the rank's share of the global mean: its token sum over the global batch's tokens
        (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:LOCAL_BATCH].reshape(-1), reduction="sum")
         / labels.numel()).backward()
    finally:
        su.hp_tensor_and_scale_to_float8 = real
    return calls


def lora_probe(trainer: Any) -> dict[str, Any]:
    """After the steps: the Hugging Face export (the last, model-only save), every parameter's full
    value (rank 0), which parameters hold optimizer state, and which require gradients."""

    def result() -> dict[str, Any] | None:
        from torchtitan_spmd.distributed.apply_plan import plain_fqn

        steps = trainer.job_config.training.steps
        trainer.checkpointer.save(steps, last_step=True)
        trainer.checkpointer.wait()
        full = {k: v.full_tensor() for k, v in trainer.checkpointer._model_state().items()}
        names = {id(p): plain_fqn(n) for n, p in trainer.model.named_parameters()}
        with_state = sorted(names[id(p)] for p, s in trainer.optimizer.state.items() if s)
        trainable = sorted(plain_fqn(n) for n, p in trainer.model.named_parameters() if p.requires_grad)
        if trainer.rank != 0:
            return None
        return {"weights": {k: v.detach().tolist() for k, v in full.items()}, "with_state": with_state,
                "trainable": trainable}

    return {"result": result}
