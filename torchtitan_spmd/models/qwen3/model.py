"""A small Qwen3-style decoder (fp32 by default).

What sets it apart from ``llama3`` (the rest is the shared
:class:`~torchtitan_spmd.models.common.Decoder`)::

    Qwen3Block (a DecoderBlock)
    ├── attention_norm        RMSNorm(dim)
    ├── attention             Qwen3Attention: wq, wk, wv, wo (no bias),
    │   ├── q_norm            RMSNorm(head_dim): per head, on the queries, before RoPE
    │   ├── k_norm            RMSNorm(head_dim): per head, on the keys, before RoPE
    │   └── sdpa              ScaledDotProductAttention
    ├── ffn_norm              RMSNorm(dim)
    └── feed_forward          FeedForward(dim, hidden_dim): an explicit SwiGLU width

- QK-norm: every query and key head is RMS-normalised over its ``head_dim``
  with a learned scale shared by all heads;
- ``head_dim`` is its own hyper-parameter (``n_heads * head_dim`` need not be ``dim``);
- RoPE rotates the two halves of each head (``rotate_half``, the Hugging Face /
  Qwen convention), not interleaved pairs; ``rope_theta`` is 1e6.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan_spmd.models.common import (
    Decoder,
    DecoderBlock,
    GroupedQueryAttention,
    check_positive_ints,
)

__all__ = ["Qwen3Attention", "Qwen3Block", "Qwen3Config", "Qwen3Model", "apply_rotary_emb_half"]


@dataclass(frozen=True)
class Qwen3Config:
    """Hyper-parameters of :class:`Qwen3Model`.

    Attributes:
        dim: model (residual stream) width.
        n_layers: number of blocks.
        n_heads: number of query heads.
        n_kv_heads: number of key/value heads; must divide ``n_heads``.
        head_dim: width of one head (even, for RoPE); independent of ``dim``.
        hidden_dim: SwiGLU hidden width.
        vocab_size: number of token ids.
        norm_eps: epsilon of every RMSNorm (QK norms included).
        rope_theta: base of the rotary-embedding frequencies.
        max_seq_len: number of rows of the RoPE tables (longest sequence).
    """

    dim: int = 256
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 64
    hidden_dim: int = 768
    vocab_size: int = 320
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        check_positive_ints("Qwen3Config", {
            n: getattr(self, n) for n in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                                          "hidden_dim", "vocab_size", "max_seq_len")
        })
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"Qwen3Config.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Config.head_dim={self.head_dim} must be even for RoPE")
        if self.norm_eps <= 0:
            raise ValueError(f"Qwen3Config.norm_eps must be > 0, got {self.norm_eps!r}")
        if self.rope_theta <= 0:
            raise ValueError(f"Qwen3Config.rope_theta must be > 0, got {self.rope_theta!r}")


def apply_rotary_emb_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the halves ``(x[..., i], x[..., i + head_dim/2])`` of ``x`` by the RoPE angles.

    Args:
        x: ``[batch, seq, heads, head_dim]`` (any number of heads).
        cos, sin: ``[seq, head_dim // 2]``, or per token ``[batch, seq, head_dim // 2]``.

    Returns a new tensor of ``x``'s shape and dtype (computed in float32).
    """
    head_dim = x.shape[-1]
    x32 = x.float()
    first, second = x32[..., : head_dim // 2], x32[..., head_dim // 2 :]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over the heads
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).type_as(x)


class Qwen3Attention(GroupedQueryAttention):
    """Qwen3 attention: grouped-query, per-head QK RMSNorm, rotate-half RoPE (:func:`apply_rotary_emb_half`)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(dim=config.dim, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
                         head_dim=config.head_dim, rope=apply_rotary_emb_half, qk_norm_eps=config.norm_eps)


class Qwen3Block(DecoderBlock):
    """The Qwen3 block: :class:`~torchtitan_spmd.models.common.DecoderBlock` with :class:`Qwen3Attention`."""

    def __init__(self, layer_id: int, config: Qwen3Config) -> None:
        super().__init__(layer_id, Qwen3Attention(config), dim=config.dim, hidden_dim=config.hidden_dim,
                         norm_eps=config.norm_eps)


class Qwen3Model(Decoder):
    """Qwen3-style decoder: ``tokens [batch, seq] -> logits [batch, seq, vocab]``."""

    config: Qwen3Config

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config, lambda i: Qwen3Block(i, config))
