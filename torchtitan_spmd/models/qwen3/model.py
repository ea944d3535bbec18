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
        (or moe               MoE: with num_experts > 0, the mixture-of-experts flavours)

- QK-norm: every query and key head is RMS-normalised over its ``head_dim``
  with a learned scale shared by all heads;
- ``head_dim`` is its own hyper-parameter (``n_heads * head_dim`` need not be ``dim``);
- RoPE rotates the two halves of each head (``rotate_half``, the Hugging Face /
  Qwen convention), not interleaved pairs; ``rope_theta`` is 1e6.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from torchtitan_spmd.models.common import (
    Decoder,
    DecoderBlock,
    GroupedQueryAttention,
    check_attn_mask_value,
    check_positive_ints,
)
from torchtitan_spmd.models.moe import MoE
from torchtitan_spmd.models.rope import NO_SCALING, RopeScaling

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
        rope_scaling: how the RoPE frequencies are scaled (none, llama, yarn; see
            :mod:`torchtitan_spmd.models.rope`).
        enable_weight_tying: the output projection uses the embedding's weight (upstream's
            field; transformers' ``tie_word_embeddings``). Refused with pipeline parallelism.
        max_seq_len: number of rows of the RoPE tables (longest sequence).
        attn_mask_type: ``"causal"`` (default: the window is one sequence) or ``"block_causal"``
            (upstream's field: packed documents, split after each EOS token, attend only within
            themselves and their RoPE positions restart; the boundary token's loss is ignored).
        num_experts: 0 for the dense model; otherwise every block's feed-forward is a mixture
            of this many experts (:class:`~torchtitan_spmd.models.moe.MoE`).
        top_k: experts per token (MoE; at most ``num_experts``).
        moe_hidden_dim: the SwiGLU width of one expert (MoE).
        score_func: the router's score, ``"softmax"`` over the experts (qwen3, as upstream) or
            ``"sigmoid"``.
        route_norm: divide each token's chosen scores by their sum (qwen3: True).
        route_scale: a factor on the gating weights.
        load_balance_coeff: the expert-bias step of auxiliary-loss-free load balancing (None: no
            bias, no balancing); upstream's default 1e-3.
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
    num_experts: int = 0
    top_k: int = 1
    moe_hidden_dim: int = 0
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = True
    route_scale: float = 1.0
    load_balance_coeff: float | None = 1e-3
    rope_scaling: RopeScaling = NO_SCALING
    enable_weight_tying: bool = False
    attn_mask_type: str = "causal"

    @property
    def moe_enabled(self) -> bool:
        """Whether the blocks are mixtures of experts (``num_experts > 0``)."""
        return self.num_experts > 0

    def __post_init__(self) -> None:
        check_attn_mask_value("Qwen3Config", self.attn_mask_type)
        if not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"Qwen3Config.rope_scaling must be a RopeScaling, got {self.rope_scaling!r}")
        self._check_moe()
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

    def _check_moe(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"Qwen3Config.num_experts must be an int >= 0 (0: dense), got {self.num_experts!r}")
        if not self.moe_enabled:
            return
        check_positive_ints("Qwen3Config", {"top_k": self.top_k, "moe_hidden_dim": self.moe_hidden_dim})
        if self.top_k > self.num_experts:
            raise ValueError(f"Qwen3Config.top_k={self.top_k} is larger than num_experts={self.num_experts}; "
                             f"valid: 1 .. {self.num_experts}.")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"Qwen3Config.score_func={self.score_func!r}; valid: 'softmax', 'sigmoid'.")
        if self.load_balance_coeff is not None and not self.load_balance_coeff > 0:
            raise ValueError(f"Qwen3Config.load_balance_coeff must be > 0 or None, got {self.load_balance_coeff!r}")


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
        c = config
        moe = (MoE(c.dim, c.moe_hidden_dim, c.num_experts, c.top_k, score_func=c.score_func,
                   route_norm=c.route_norm, route_scale=c.route_scale, load_balance_coeff=c.load_balance_coeff)
               if c.moe_enabled else None)
        super().__init__(layer_id, Qwen3Attention(config), dim=config.dim, hidden_dim=config.hidden_dim,
                         norm_eps=config.norm_eps, moe=moe)


class Qwen3Model(Decoder):
    """Qwen3-style decoder: ``tokens [batch, seq] -> logits [batch, seq, vocab]``."""

    config: Qwen3Config

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config, lambda i: Qwen3Block(i, config))
