"""The ``qwen3`` family: a Qwen3-style decoder (QK RMSNorm per head), its plan, flavours and validation."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torchtitan_spmd.models import ModelSpec
from torchtitan_spmd.models.common import (
    check_attn_mask_type,
    check_seq_len,
    check_tp_divisible,
    check_weight_tying,
)

from .model import Qwen3Attention, Qwen3Block, Qwen3Config, Qwen3Model, apply_rotary_emb_half
from .plan import qwen3_plan
from .state_dict_adapter import Qwen3StateDictAdapter

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims

__all__ = [
    "Qwen3StateDictAdapter",
    "FLAVORS",
    "MODEL_SPEC",
    "model_registry",
    "MOE_FLAVORS",
    "Qwen3Attention",
    "Qwen3Block",
    "Qwen3Config",
    "Qwen3Model",
    "apply_rotary_emb_half",
    "build_model",
    "qwen3_plan",
    "validate",
]

#: Named model sizes; the vocabulary matches :class:`torchtitan_spmd.data.Tokenizer`
#: (320 ids). ``debugmodel`` (6.07M parameters) has heads twice as wide as
#: ``dim / n_heads``; ``tiny`` is for fast tests. The mixture-of-experts flavours:
#: ``debugmodel_moe``, upstream's (8 layers, 64 experts of width 768, top-8, softmax scores,
#: normalised; 315M parameters, 51M active per token), and ``moe_tiny`` (2 layers, 8 experts,
#: top-2) for fast tests.
FLAVORS: dict[str, Qwen3Config] = {
    "debugmodel": Qwen3Config(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768, vocab_size=320,
        norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=2048,
    ),
    "tiny": Qwen3Config(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=192, vocab_size=320,
        norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=512,
    ),
    "debugmodel_moe": Qwen3Config(
        dim=256, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=128, hidden_dim=768, vocab_size=320,
        norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=4096,
        num_experts=64, top_k=8, moe_hidden_dim=768, score_func="softmax", route_norm=True,
    ),
    "moe_tiny": Qwen3Config(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=192, vocab_size=320,
        norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=512,
        num_experts=8, top_k=2, moe_hidden_dim=64, score_func="softmax", route_norm=True,
    ),
    # Upstream's (a0c831c49) Qwen3 sizes: vocabulary 151936 (the tokenizer's replaces it), head_dim
    # 128, theta 1e6, 4096 positions (30B-A3B: 262144); 0.6B and 1.7B tie their embeddings.
    "0.6B": Qwen3Config(
        dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, hidden_dim=3072, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=4096, enable_weight_tying=True,
    ),
    "1.7B": Qwen3Config(
        dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, hidden_dim=6144, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=4096, enable_weight_tying=True,
    ),
    "14B": Qwen3Config(
        dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, head_dim=128, hidden_dim=17408, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=4096,
    ),
    "32B": Qwen3Config(
        dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128, hidden_dim=25600, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=4096,
    ),
    "30B-A3B": Qwen3Config(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, hidden_dim=768, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=262144,
        num_experts=128, top_k=8, moe_hidden_dim=768, score_func="softmax", route_norm=True,
    ),
}

#: The flavours with mixture-of-experts blocks (named in setup errors).
MOE_FLAVORS: tuple[str, ...] = tuple(name for name, c in FLAVORS.items() if c.moe_enabled)

#: Packed documents (``attn_mask_type="block_causal"``): upstream's ``debugmodel_flex``
#: (FlexAttention there; SDPA with a mask here) and a tiny one for tests.
FLAVORS["debugmodel_flex"] = replace(FLAVORS["debugmodel"], attn_mask_type="block_causal")
FLAVORS["tiny_block_causal"] = replace(FLAVORS["tiny"], attn_mask_type="block_causal")


def validate(config: Qwen3Config, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """Raise ValueError when ``training.seq_len`` does not fit or tensor parallelism cannot shard ``config``
    evenly. (The MoE flavours run every parallelism here but EP, whose degree ``ParallelDims`` and the
    trainer reject, and pipeline parallelism with the other techniques.)"""
    check_seq_len(config.max_seq_len, job_config)
    check_attn_mask_type(config, job_config, parallel_dims)
    check_weight_tying(config, job_config, parallel_dims)
    sizes = {
        "model n_heads": config.n_heads,
        "model n_kv_heads": config.n_kv_heads,
        "model hidden_dim": config.hidden_dim,
        "vocab size": config.vocab_size,
    }
    if config.moe_enabled:
        sizes["model moe_hidden_dim"] = config.moe_hidden_dim  # the experts' w1/w3 columns, w2 rows
    check_tp_divisible(sizes, job_config, parallel_dims)


MODEL_SPEC = ModelSpec(
    name="qwen3",
    flavors=FLAVORS,
    build=Qwen3Model,
    sharding_plan=qwen3_plan,
    validate=validate,
    state_dict_adapter=Qwen3StateDictAdapter,
)


#: ``build_model(flavor, *, seed, vocab_size=None)``: full-size on CPU, initialised (tests, notebooks).
build_model = MODEL_SPEC.build_initialized


def model_registry(flavor: str, attn_backend: str | None = None, converters: list[Any] | None = None) -> ModelSpec:
    """Upstream's ``model_registry(flavor, attn_backend=..., converters=[...])``: the family's spec with
    ``flavor`` and the model converters (``job.model_spec = model_registry(...)``). ``attn_backend`` is
    accepted for upstream's recipes and ignored: this library's attention is SDPA (with a mask for
    packed documents), on every device."""
    del attn_backend
    return MODEL_SPEC.registry(flavor, converters)
