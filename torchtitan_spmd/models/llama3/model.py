"""A small Llama-3-style decoder (fp32 by default).

The module tree is :class:`~torchtitan_spmd.models.common.Decoder`'s, with this block::

    TransformerBlock (a DecoderBlock)
    ├── attention_norm        RMSNorm(dim)
    ├── attention             Attention: wq, wk, wv, wo (nn.Linear, no bias),
    │                         sdpa (ScaledDotProductAttention, no parameters)
    ├── ffn_norm              RMSNorm(dim)
    └── feed_forward          FeedForward: w1, w2, w3 (nn.Linear, no bias)

Rotary embeddings use real ``cos``/``sin`` tables on interleaved pairs
``(x[2i], x[2i+1])`` -- numerically the same rotation as torchtitan's complex
``freqs_cis`` formulation, without complex tensors. ``head_dim = dim // n_heads``;
grouped-query attention with ``n_kv_heads``; the SwiGLU width follows Llama's
``multiple_of`` rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan_spmd.models.common import (
    Decoder,
    DecoderBlock,
    GroupedQueryAttention,
    check_attn_mask_value,
    check_positive_ints,
)
from torchtitan_spmd.models.rope import NO_SCALING, RopeScaling

__all__ = [
    "Attention",
    "LlamaConfig",
    "Transformer",
    "TransformerBlock",
    "apply_rotary_emb",
    "ffn_hidden_dim",
]


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of :class:`Transformer`.

    Attributes:
        dim: model (residual stream) width.
        n_layers: number of transformer blocks.
        n_heads: number of query heads; ``dim`` must be divisible by it.
        n_kv_heads: number of key/value heads (grouped-query attention);
            ``None`` means ``n_heads``. Must divide ``n_heads``.
        vocab_size: number of token ids.
        multiple_of: the SwiGLU hidden width is rounded up to a multiple of this.
        ffn_dim_multiplier: optional factor applied to the SwiGLU hidden width.
        norm_eps: epsilon of every RMSNorm.
        rope_theta: base of the rotary-embedding frequencies.
        rope_scaling: how the RoPE frequencies are scaled (none, llama, yarn; see
            :mod:`torchtitan_spmd.models.rope`).
        enable_weight_tying: the output projection uses the embedding's weight (upstream's
            field; transformers' ``tie_word_embeddings``). Refused with pipeline parallelism.
        max_seq_len: number of rows of the RoPE tables (longest sequence).
        attn_mask_type: ``"causal"`` (default: the window is one sequence) or ``"block_causal"``
            (upstream's field: packed documents, split after each EOS token, attend only within
            themselves and their RoPE positions restart; the boundary token's loss is ignored).
    """

    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int | None = None
    vocab_size: int = 320
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048
    rope_scaling: RopeScaling = NO_SCALING
    enable_weight_tying: bool = False
    attn_mask_type: str = "causal"

    def __post_init__(self) -> None:
        check_attn_mask_value("LlamaConfig", self.attn_mask_type)
        if not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"LlamaConfig.rope_scaling must be a RopeScaling, got {self.rope_scaling!r}")
        check_positive_ints("LlamaConfig", {
            n: getattr(self, n) for n in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len")
        })
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig head_dim={self.head_dim} must be even for RoPE")
        kv = self.kv_heads
        if not isinstance(kv, int) or isinstance(kv, bool) or kv < 1 or self.n_heads % kv:
            raise ValueError(
                f"LlamaConfig.n_kv_heads={self.n_kv_heads!r} must be a positive divisor of n_heads={self.n_heads}"
            )
        if self.norm_eps <= 0:
            raise ValueError(f"LlamaConfig.norm_eps must be > 0, got {self.norm_eps!r}")
        if self.rope_theta <= 0:
            raise ValueError(f"LlamaConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if self.ffn_dim_multiplier is not None and self.ffn_dim_multiplier <= 0:
            raise ValueError(
                f"LlamaConfig.ffn_dim_multiplier must be > 0 or None, got {self.ffn_dim_multiplier!r}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``dim // n_heads``."""
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """``n_kv_heads`` with ``None`` resolved to ``n_heads``."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Hidden width of every SwiGLU feed-forward (see :func:`ffn_hidden_dim`)."""
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """The Llama SwiGLU hidden width.

    Start from ``4 * dim``, take two thirds (SwiGLU has three matrices instead of
    two), apply ``ffn_dim_multiplier`` if given, then round up to a multiple of
    ``multiple_of``.
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[..., 2i], x[..., 2i+1])`` of ``x`` by the RoPE angles.

    Args:
        x: ``[batch, seq, heads, head_dim]`` (any number of heads).
        cos, sin: ``[seq, head_dim // 2]``, or per token ``[batch, seq, head_dim // 2]``.

    Returns a new tensor of ``x``'s shape and dtype (computed in float32).
    """
    bs, seqlen, n_heads, head_dim = x.shape
    pairs = x.float().reshape(bs, seqlen, n_heads, head_dim // 2, 2)
    x_even = pairs[..., 0]
    x_odd = pairs[..., 1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over the heads
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.reshape(bs, seqlen, n_heads, head_dim).type_as(x)


class Attention(GroupedQueryAttention):
    """Llama attention: grouped-query, interleaved RoPE (:func:`apply_rotary_emb`), no QK norm."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(dim=config.dim, n_heads=config.n_heads, n_kv_heads=config.kv_heads,
                         head_dim=config.head_dim, rope=apply_rotary_emb)


class TransformerBlock(DecoderBlock):
    """The Llama block: :class:`~torchtitan_spmd.models.common.DecoderBlock` with :class:`Attention`."""

    def __init__(self, layer_id: int, config: LlamaConfig) -> None:
        super().__init__(layer_id, Attention(config), dim=config.dim, hidden_dim=config.ffn_hidden_dim,
                         norm_eps=config.norm_eps)


class Transformer(Decoder):
    """Llama-style decoder: ``tokens [batch, seq] -> logits [batch, seq, vocab]``."""

    config: LlamaConfig

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config, lambda i: TransformerBlock(i, config))
