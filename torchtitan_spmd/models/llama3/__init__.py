"""The ``llama3`` family: a Llama-3-style decoder, its sharding plan, flavours and validation."""

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
from torchtitan_spmd.models.rope import RopeScaling

from .model import (
    Attention,
    LlamaConfig,
    Transformer,
    TransformerBlock,
    apply_rotary_emb,
    ffn_hidden_dim,
)
from .plan import llama3_plan
from .state_dict_adapter import Llama3StateDictAdapter

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims

__all__ = [
    "Llama3StateDictAdapter",
    "FLAVORS",
    "MODEL_SPEC",
    "model_registry",
    "Attention",
    "LlamaConfig",
    "Transformer",
    "TransformerBlock",
    "apply_rotary_emb",
    "build_model",
    "ffn_hidden_dim",
    "llama3_plan",
    "validate",
]

#: Llama 3.1's RoPE scaling (every 3.1, 3.2 and 3.3 checkpoint's ``rope_type="llama3"``).
LLAMA31 = RopeScaling(kind="llama", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)

#: Named model sizes. ``debugmodel`` is the same order as torchtitan's llama3
#: debugmodel (~6M parameters); ``tiny`` is for fast tests. The vocabulary of
#: both matches :class:`torchtitan_spmd.data.Tokenizer` (320 ids).
FLAVORS: dict[str, LlamaConfig] = {
    "debugmodel": LlamaConfig(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=320, multiple_of=256,
        ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=2048,
    ),
    "tiny": LlamaConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, multiple_of=64,
        ffn_dim_multiplier=None, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=512,
    ),
    # Upstream's (a0c831c49) Llama 3.1 sizes: vocabulary 128256 (the tokenizer's replaces it),
    # theta 500000 with Llama 3.1's RoPE scaling (factor 8, band 1..4 over 8192), 131072 positions.
    "8B": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
        ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072, rope_scaling=LLAMA31,
    ),
    "70B": LlamaConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
        ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072, rope_scaling=LLAMA31,
    ),
    "405B": LlamaConfig(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
        ffn_dim_multiplier=1.2, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072, rope_scaling=LLAMA31,
    ),
}

#: Packed documents (``attn_mask_type="block_causal"``): upstream's ``debugmodel_flex_attn``
#: (FlexAttention there; SDPA with a mask here, on every device) and a tiny one for tests.
FLAVORS["debugmodel_flex_attn"] = replace(FLAVORS["debugmodel"], attn_mask_type="block_causal")
FLAVORS["tiny_block_causal"] = replace(FLAVORS["tiny"], attn_mask_type="block_causal")


def validate(config: LlamaConfig, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """Raise ValueError when ``training.seq_len`` does not fit or tensor parallelism cannot shard ``config`` evenly."""
    check_seq_len(config.max_seq_len, job_config)
    check_attn_mask_type(config, job_config, parallel_dims)
    check_weight_tying(config, job_config, parallel_dims)
    check_tp_divisible({
        "model n_heads": config.n_heads,
        "model n_kv_heads": config.kv_heads,
        "model ffn hidden dim": config.ffn_hidden_dim,
        "vocab size": config.vocab_size,
    }, job_config, parallel_dims)


MODEL_SPEC = ModelSpec(
    name="llama3",
    flavors=FLAVORS,
    build=Transformer,
    sharding_plan=llama3_plan,
    validate=validate,
    state_dict_adapter=Llama3StateDictAdapter,
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
