"""Helpers for the ``deepseek_v3`` parity tests: ``tiny`` on 4 real forked gloo ranks against the float64
reference (:mod:`torchtitan_spmd.reference`: MLA, YaRN and DeepSeek's routing restated there).

Each run: 4 steps (the layer-4 cells 2), per step ``(loss, grad_norm)``, every parameter's step-1
gradient norm and the expert biases after every step (:mod:`grad_probe`), compared with the
reference's on the same global batch.
"""

from __future__ import annotations

import functools
from typing import Any

from parity_helpers import LOCAL_BATCH, NORM_TOL, TOL, job_config, max_rel, warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

STEPS = 4
FLAVOR = "tiny"
#: name -> (world size, parallelism overrides)
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "fsdp4": (4, {"data_parallel_shard_degree": 4}),
    "fsdp2_tp2": (4, {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}),
    "fsdp4_ep4": (4, {"data_parallel_shard_degree": 4, "expert_parallel_degree": 4}),
    "fsdp2_tp2_ep4": (4, {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2, "expert_parallel_degree": 4}),
    "pp2_fsdp2_ep2": (4, {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2,
                          "expert_parallel_degree": 2}),
    "fsdp2_cp2": (4, {"data_parallel_shard_degree": 2, "context_parallel_degree": 2}),
    "cp2_tp2_ep4": (4, {"context_parallel_degree": 2, "tensor_parallel_degree": 2, "expert_parallel_degree": 4}),
    # HSDP 2 x 2 with EP 2 (experts sharded over efsdp x ep inside the replicas); with activation checkpointing
    "hsdp2x2_ep2": (4, {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2,
                        "expert_parallel_degree": 2}),
    # FSDP 4 x EP 2: efsdp 2 (the experts' dim 1 for a 2-expert flavour: 1 expert a rank)
    "fsdp4_ep2": (4, {"data_parallel_shard_degree": 4, "expert_parallel_degree": 2}),
}


def data_parallel(layout: str) -> int:
    world, par = LAYOUTS[layout]
    for axis in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
        world //= par.get(axis, 1)
    return world


def deepseek_config(backend: str, layout: str, *, steps: int = STEPS, ac: str = "none", **debug: Any) -> JobConfig:
    """The parity harness's deterministic fp32 config with ``deepseek_v3`` ``tiny``, ``steps`` steps,
    activation checkpointing ``ac`` (none by default)."""
    cfg = job_config(backend, LAYOUTS[layout][1], model="deepseek_v3", steps=steps, **debug)
    cfg.model.flavor = FLAVOR
    cfg.activation_checkpoint.mode = ac  # type: ignore[assignment]
    return cfg


@functools.cache
def reference_with_trace(global_batch: int, steps: int) -> tuple[tuple[tuple[float, float], ...], Any]:
    """The reference's per-step ``(loss, grad_norm)`` over ``steps`` steps of ``global_batch`` sequences
    and its :class:`~torchtitan_spmd.reference.ReferenceTrace` (every parameter's step-1 gradient norm,
    the expert biases after every step; cached)."""
    from torchtitan_spmd.reference import ReferenceTrace, run_reference

    cfg = deepseek_config("default", "fsdp4", steps=steps)
    cfg.parallelism.data_parallel_shard_degree = 1
    cfg.training.local_batch_size = global_batch
    trace = ReferenceTrace()
    return tuple(run_reference(cfg, global_batch=global_batch, trace=trace)), trace


def check_probed(got: Any, layout: str, what: str) -> tuple[float, float, float]:
    """``got`` (a :class:`parity_helpers.Run` with its :mod:`grad_probe` trace) against the reference:
    loss within ``TOL`` and gradient norm within ``NORM_TOL`` at every step, every parameter's step-1
    gradient norm within ``grad_probe.GRAD_TOL``, the expert biases after every step within
    ``grad_probe.BIAS_TOL``, and the loss going down; returns the largest relative differences
    (loss, grad norm, per-tensor gradient norms)."""
    from grad_probe import compare_expert_bias, compare_grad_norms

    steps, trace = reference_with_trace(LOCAL_BATCH * data_parallel(layout), len(got))
    assert got.trace is not None and got.trace.grad_norms, f"{what}: no gradient norms recorded"
    grad_diff = compare_grad_norms(got.trace.grad_norms, trace.grad_norms, what=what)
    compare_expert_bias(got.trace.expert_bias, trace.expert_bias, what=what)
    loss, norm = [g[0] for g in got], [g[1] for g in got]
    loss_diff, norm_diff = max_rel(loss, [r[0] for r in steps]), max_rel(norm, [r[1] for r in steps])
    assert loss_diff < TOL, (what, loss, steps)
    assert norm_diff < NORM_TOL, (what, norm, steps)
    assert loss[-1] < loss[0] - 0.05, (what, loss)
    return loss_diff, norm_diff, grad_diff


def hf_model(**overrides: Any) -> tuple[object, dict]:
    """A random transformers ``DeepseekV3ForCausalLM`` of ``tiny``'s sizes (transformers' own field names),
    with ``overrides`` of those fields (e.g. ``n_routed_experts``)."""
    import torch
    import transformers

    torch.manual_seed(0)
    fields = dict(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  norm_topk_prob=True, first_k_dense_replace=1, tie_word_embeddings=False,
                  max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "mscale": 1.0, "mscale_all_dim": 1.0})
    fields.update(overrides)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**fields))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model.eval(), fields


def check_hf_training(backend: str, layouts: tuple[str, ...], root: Any, **overrides: Any) -> dict[str, float]:
    """For each of ``layouts`` (one launch of 4 gloo ranks): :func:`hf_model` (with ``overrides``) saved in bfloat16 loads
    through the trainer's sharded HF path (``--model.flavor from_hf``) under ``backend``; the step-1 loss
    is transformers' cross-entropy of the source on the same global batch (relative ``TOL``), and an
    export right after the load holds exactly the source's tensors (names, dtype, bits). Returns
    layout -> the loss's relative difference."""
    import torch
    from hf_helpers import (
        GLOBAL_BATCH,
        NO_STEP_EXPORT,
        STEPS,
        _worker,
        hf_cross_entropy,
        hf_job,
        read_safetensors,
    )

    warm_parent()
    import torch.distributed.checkpoint  # noqa: F401  (import once, before forking)

    src = root / "src"
    hf_model(**overrides)[0].to(torch.bfloat16).save_pretrained(str(src))
    cfgs = [hf_job("deepseek_v3", "from_hf", {**LAYOUTS[lay][1], "spmd_backend": backend},
                   GLOBAL_BATCH // data_parallel(lay), src, root / lay) for lay in layouts]
    per_rank = run_forked(_worker, 4, cfgs, timeout_s=300)
    source = read_safetensors(src)
    out = {}
    for i, lay in enumerate(layouts):
        r = per_rank[0][i]
        assert all(p[i]["loss1"] == r["loss1"] and p[i]["steps"] == list(range(1, STEPS + 1)) for p in per_rank), lay
        rows = {p[i]["dp_rank"]: p[i]["batch"] for p in per_rank}
        tokens = [row for dp in sorted(rows) for row in rows[dp][0]]
        labels = [row for dp in sorted(rows) for row in rows[dp][1]]
        want = hf_cross_entropy(src, tokens, labels)
        out[lay] = abs(r["loss1"] - want) / want
        print(f"\nsharded HF load, {backend} {lay}: step-1 loss {r['loss1']:.6f}, transformers {want:.6f} "
              f"({out[lay]:.1e} relative)")
        assert out[lay] <= TOL, (backend, lay, r["loss1"], want)
        exported = read_safetensors(root / lay / "checkpoint" / f"step-{NO_STEP_EXPORT}")
        assert sorted(exported) == sorted(source), sorted(set(exported) ^ set(source))
        for key, tensor in source.items():
            assert exported[key].dtype == tensor.dtype and exported[key].equal(tensor), (lay, key)
    return out
