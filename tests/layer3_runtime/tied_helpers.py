"""Helpers for the tied-embedding tests: a tied tiny model at FSDP 2 x TP 2 with loss parallel,
trained by the real Trainer on forked gloo ranks, against the float64 reference.

The tied flavour (``tiny_tied``: the family's ``tiny`` with ``enable_weight_tying``) is put in
the family's flavour registry by :func:`tied_flavour` in the test process, before it forks the
ranks (they inherit it), and taken out afterwards. The reference restates tying itself
(``reference.Architecture.tied``: the logits use the embedding table; its gradient has both parts).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import grad_probe
from parity_helpers import job_config, max_rel, warm_parent, with_trace

from torchtitan_spmd.launcher import run_forked

TIED = "tiny_tied"
#: FSDP 2 x TP 2 (sequence parallel and loss parallel on: the config's defaults).
PARALLELISM = {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}
WORLD, TP, DP = 4, 2, 2
STEPS = 4
LOCAL_BATCH = 2
#: Relative tolerance of each step's loss against the reference (fp32 against float64).
TOL = 1e-5


@contextlib.contextmanager
def tied_flavour(model: str) -> Iterator[None]:
    """``model``'s flavour registry holds ``tiny_tied`` while the block runs (its launches in fresh
    forks, which inherit it: a warm world's ranks were forked before)."""
    from torchtitan_spmd.launcher import warm_worlds
    from torchtitan_spmd.models import get_model_spec

    flavours = get_model_spec(model).flavors
    flavours[TIED] = dataclasses.replace(flavours["tiny"], enable_weight_tying=True)  # type: ignore[index]
    try:
        with warm_worlds(False):
            yield
    finally:
        del flavours[TIED]  # type: ignore[attr-defined]


def tied_job(backend: str, model: str = "llama3", **debug: Any) -> Any:
    cfg = job_config(backend, PARALLELISM, local_batch=LOCAL_BATCH, steps=STEPS, model=model, **debug)
    cfg.model.flavor = TIED
    assert not cfg.parallelism.disable_loss_parallel and cfg.parallelism.enable_sequence_parallel
    return cfg


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _train_and_inspect(rank: int, world: int, cfg: Any) -> tuple[list[tuple[float, float]], dict[str, Any]]:
    """Train; also report how the tied parameter and the logits are laid out on this rank."""
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    model = trainer.model
    weight = model.output.weight
    seen: dict[str, Any] = {
        "one_parameter": weight is model.tok_embeddings.weight,
        "names": sorted(n for n, _ in model.named_parameters() if "tok_embeddings" in n or "output" in n),
        "local_numel": _local(weight).numel(),
        "embedding_local_numel": _local(model.tok_embeddings.weight).numel(),
        "global_shape": tuple(weight.shape),
        "layouts": {k: repr(v.layout) for k, v in trainer.state_layouts.items()
                    if k in ("output.weight", "tok_embeddings.weight")},
    }
    shapes: list[tuple[int, ...]] = []
    handle = model.output.register_forward_hook(lambda _m, _a, out: shapes.append(tuple(_local(out).shape)))
    records = [(r.loss, r.grad_norm) for r in trainer.run()]
    handle.remove()
    seen["logits_local_shape"] = shapes[0] if shapes else None
    return records, seen


def run_tied(backend: str, model: str = "llama3", *, tied: bool = True, **debug: Any) -> tuple[Any, dict[str, Any]]:
    """Train the tied tiny ``model`` (``tied=False``: the untied ``tiny``) at FSDP 2 x TP 2 under
    ``backend``: (per-step records with the step-1 gradient-norm trace, rank 0's layout report)."""
    warm_parent()
    with tied_flavour(model):
        cfg = tied_job(backend, model, **debug)
        if not tied:
            cfg.model.flavor = "tiny"
        results = run_forked(grad_probe.probed(_train_and_inspect), WORLD, cfg, timeout_s=300)
    per_rank = [r for (r, _), _ in results]
    for rank, records in enumerate(per_rank):
        assert records == per_rank[0], f"rank {rank} logged {records}, rank 0 {per_rank[0]}"
    run = with_trace(per_rank[0], [t for _, t in results])
    return run, results[0][0][1]


def tied_reference(model: str = "llama3") -> tuple[Any, Any]:
    """The float64 reference of the tied tiny ``model`` on the same global batches, with its trace."""
    from torchtitan_spmd.reference import ReferenceTrace, run_reference

    with tied_flavour(model):
        cfg = job_config("default", {"data_parallel_shard_degree": 1}, local_batch=LOCAL_BATCH * DP, steps=STEPS,
                         model=model)
        cfg.model.flavor = TIED
        trace = ReferenceTrace()
        return run_reference(cfg, global_batch=LOCAL_BATCH * DP, trace=trace), trace


def check_tied(backend: str, model: str = "llama3", **debug: Any) -> dict[str, float]:
    """The tied model at FSDP 2 x TP 2 with loss parallel under ``backend``: one parameter, laid out
    vocab-sharded on ``tp`` (so its local storage is a quarter of the table, and the logits are
    vocab-sharded), and the loss of every step and the tied table's step-1 gradient norm (both
    uses' parts) equal to the float64 reference's. ``debug``: ``debug.*`` fields of the run."""
    run, seen = run_tied(backend, model, **debug)
    ref, ref_trace = tied_reference(model)
    from torchtitan_spmd.models import get_model_spec

    vocab, dim = get_model_spec(model).flavors["tiny"].vocab_size, get_model_spec(model).flavors["tiny"].dim
    assert seen["one_parameter"] and seen["names"] == ["tok_embeddings.weight"], seen
    assert seen["global_shape"] == (vocab, dim), seen
    # FSDP shards the table over dp, TP over the vocabulary: each rank stores 1/(dp*tp) of it
    # (a table replicated on tp would store 1/dp).
    assert seen["local_numel"] == vocab * dim // (DP * TP), (seen["local_numel"], vocab * dim)
    assert seen["logits_local_shape"] is not None and seen["logits_local_shape"][-1] == vocab // TP, seen
    assert seen["layouts"] == dict.fromkeys(("output.weight", "tok_embeddings.weight"), repr(_vocab_rows())), \
        seen["layouts"]
    want, got = "tok_embeddings.weight", run.trace.grad_norms
    assert "output.weight" not in got and want in got, sorted(got)
    grad_rel = abs(got[want] - ref_trace.grad_norms[want]) / ref_trace.grad_norms[want]
    assert grad_rel <= grad_probe.GRAD_TOL, (
        f"{backend}: the tied table's gradient norm at step 1 is {got[want]!r}, the reference's "
        f"{ref_trace.grad_norms[want]!r} ({grad_rel:.2e} relative)")
    grad_probe.compare_grad_norms(got, ref_trace.grad_norms, what=f"tied {model} {backend}")
    loss_rel = max_rel([r[0] for r in run], [r[0] for r in ref])
    assert loss_rel < TOL, ([r[0] for r in run], [r[0] for r in ref])
    return {"loss_rel": loss_rel, "grad_rel": grad_rel}


def _vocab_rows() -> Any:
    from torchtitan_spmd.distributed.layout import S, SpmdLayout

    return SpmdLayout({"tp": S(0)})


def check_untied(backend: str, model: str = "llama3", **debug: Any) -> dict[str, float]:
    """The untied tiny ``model`` at FSDP 2 x TP 2 with loss parallel under ``backend``: the embedding
    and the output two parameters, each laid out vocab-sharded on ``tp`` (each rank stores a quarter
    of each table; the logits vocab-sharded), every step's loss and every parameter's step-1
    gradient norm equal to the float64 reference's (``parity_helpers.reference_with_trace``)."""
    from parity_helpers import reference_with_trace

    run, seen = run_tied(backend, model, tied=False, **debug)
    ref, ref_trace = reference_with_trace(LOCAL_BATCH * DP, STEPS, model)
    from torchtitan_spmd.models import get_model_spec

    vocab, dim = get_model_spec(model).flavors["tiny"].vocab_size, get_model_spec(model).flavors["tiny"].dim
    assert not seen["one_parameter"] and seen["names"] == ["output.weight", "tok_embeddings.weight"], seen
    # FSDP shards each table over dp, TP over the vocabulary: 1/(dp*tp) of each on every rank
    assert seen["local_numel"] == seen["embedding_local_numel"] == vocab * dim // (DP * TP), seen
    assert seen["logits_local_shape"] is not None and seen["logits_local_shape"][-1] == vocab // TP, seen
    assert seen["layouts"] == dict.fromkeys(("output.weight", "tok_embeddings.weight"), repr(_vocab_rows())), \
        seen["layouts"]
    grad_rel = grad_probe.compare_grad_norms(run.trace.grad_norms, ref_trace.grad_norms,
                                             what=f"untied {model} {backend}")
    loss_rel = max_rel([r[0] for r in run], [r[0] for r in ref])
    assert loss_rel < TOL, ([r[0] for r in run], [r[0] for r in ref])
    return {"loss_rel": loss_rel, "grad_rel": grad_rel}
