"""Helpers for the Hugging Face MoE weights tests: transformers' ``Qwen3MoeForCausalLM`` is the reference.

A random tiny ``Qwen3MoeForCausalLM`` of ``moe_tiny``'s sizes (2 layers, 8 experts of width 64,
top-2, normalised; the config written out here from transformers' own field names, not from the
library's adapter), every weight perturbed (norms and router gates included, so a gate or an
expert taken from the wrong place shows), saved by ``save_pretrained`` (one tensor per expert on
disk, as transformers 5 writes them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hf_helpers import (
    GLOBAL_BATCH,
    NO_STEP_EXPORT,
    STEPS,
    TOL,
    _worker,
    hf_cross_entropy,
    hf_job,
    read_safetensors,
)
from parity_helpers import warm_parent

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.launcher import run_forked

#: The transformers config of ``moe_tiny``'s sizes.
HF_MOE_CONFIG = dict(vocab_size=320, hidden_size=64, intermediate_size=192, moe_intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=512,
                     rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def hf_moe_model(seed: int = 0) -> Any:
    """A random transformers ``Qwen3MoeForCausalLM`` of ``moe_tiny``'s sizes, every weight perturbed."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**HF_MOE_CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms: 1 +- 0.3, different in every layer
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:  # gates (transformers starts them at zero) and experts too
                p.normal_(0.0, 0.08)
    return model.eval()


def save_moe_source(folder: Path, dtype: str = "bfloat16") -> Path:
    """``save_pretrained`` of :func:`hf_moe_model` in ``dtype``."""
    import torch

    hf_moe_model().to(getattr(torch, dtype)).save_pretrained(str(folder))
    return folder


def hf_moe_job(backend: str, src: Path, dump: Path) -> JobConfig:
    """FSDP 2 x TP 2, ``--model.flavor from_hf``: load the folder, export it (no step), train, export."""
    return hf_job("qwen3", "from_hf", {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2,
                                       "spmd_backend": backend}, GLOBAL_BATCH // 2, src, dump)


def moe_logits_gap(export: Path, weights: dict[str, list], tokens: list[list[int]]) -> float:
    """Largest |logit| difference between ``from_pretrained(export)`` and this library's ``moe_tiny``
    with the trainer's final weights (rounded to bfloat16, the export's dtype) and a zero expert bias
    (transformers' router has none: the bias is not exported) on ``tokens``."""
    import torch
    from transformers import AutoModelForCausalLM

    from torchtitan_spmd.models.qwen3 import build_model

    hf = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    ours = build_model("moe_tiny", seed=0).eval()
    state = {k: torch.tensor(v).to(torch.bfloat16).float() for k, v in weights.items()}
    state = {k: torch.zeros_like(v) if k.endswith("moe.expert_bias") else v for k, v in state.items()}
    ours.load_state_dict(state)
    x = torch.tensor(tokens)
    with torch.no_grad():
        return (hf(x).logits - ours(x)).abs().max().item()


def check_sharded_moe_round_trip(backend: str, tmp_path: Path) -> dict[str, float]:
    """Load -> export -> train -> export on FSDP 2 x TP 2 under ``backend``, judged by transformers."""
    warm_parent()
    import torch.distributed.checkpoint  # noqa: F401  (import once, before forking)

    src = save_moe_source(tmp_path / "src")
    dump = tmp_path / "dump"
    per_rank = run_forked(_worker, 4, [hf_moe_job(backend, src, dump)], timeout_s=300)
    r = per_rank[0][0]
    assert all(p[0]["loss1"] == r["loss1"] and p[0]["steps"] == list(range(1, STEPS + 1)) for p in per_rank)
    rows = {p[0]["dp_rank"]: p[0]["batch"] for p in per_rank}
    tokens = [row for dp in sorted(rows) for row in rows[dp][0]]
    labels = [row for dp in sorted(rows) for row in rows[dp][1]]
    want = hf_cross_entropy(src, tokens, labels)
    assert abs(r["loss1"] - want) < TOL, (r["loss1"], want)
    source, exported = read_safetensors(src), read_safetensors(dump / "checkpoint" / f"step-{NO_STEP_EXPORT}")
    assert sorted(exported) == sorted(source), sorted(set(exported) ^ set(source))
    for key, tensor in source.items():
        assert exported[key].dtype == tensor.dtype and exported[key].equal(tensor), key
    gap = moe_logits_gap(dump / "checkpoint" / f"step-{STEPS}", r["weights"], tokens)
    print(f"\nhf moe {backend}: step-1 loss gap {abs(r['loss1'] - want):.1e}, exported logits gap {gap:.1e}")
    assert gap < TOL
    return {"loss": abs(r["loss1"] - want), "logits": gap}
