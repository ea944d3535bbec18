"""Models trained by the runtime: a Llama-style decoder (:mod:`.llama`)."""

from torchtitan_spmd.models.llama import (
    FLAVORS,
    Attention,
    FeedForward,
    LlamaConfig,
    RMSNorm,
    ScaledDotProductAttention,
    Transformer,
    TransformerBlock,
    apply_rotary_emb,
    build_model,
    count_parameters,
    ffn_hidden_dim,
    param_seed,
    precompute_rope,
)

__all__ = [
    "FLAVORS",
    "Attention",
    "FeedForward",
    "LlamaConfig",
    "RMSNorm",
    "ScaledDotProductAttention",
    "Transformer",
    "TransformerBlock",
    "apply_rotary_emb",
    "build_model",
    "count_parameters",
    "ffn_hidden_dim",
    "param_seed",
    "precompute_rope",
]
