"""A DeepSeek-V3-style decoder: multi-head latent attention (MLA) and DeepSeek's mixture of experts.

What sets it apart from ``qwen3`` (the rest is the shared
:class:`~torchtitan_spmd.models.common.Decoder`)::

    DeepSeekV3Block (a DecoderBlock)
    ├── attention_norm        RMSNorm(dim)
    ├── attention             LatentAttention (MLA)
    │   ├── wq                nn.Linear(dim, n_heads * qk_head_dim)      (q_lora_rank == 0)
    │   │   or wq_a, q_norm, wq_b: dim -> q_lora_rank, RMSNorm, -> n_heads * qk_head_dim
    │   ├── wkv_a             nn.Linear(dim, kv_lora_rank + qk_rope_head_dim)
    │   ├── kv_norm           RMSNorm(kv_lora_rank)
    │   ├── wkv_b             nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim))
    │   ├── sdpa              ScaledDotProductAttention (the CP-replaceable kernel)
    │   └── wo                nn.Linear(n_heads * v_head_dim, dim)
    ├── ffn_norm              RMSNorm(dim)
    └── feed_forward          FeedForward (layers < first_k_dense_replace)
        or moe                MoE: sigmoid/softmax router, group-limited top-k, shared experts

- **MLA** as upstream torchtitan and transformers define it: a query head is
  ``[q_nope (qk_nope_head_dim), q_rope (qk_rope_head_dim)]``; the keys' rope part ``k_rope`` is
  one head shared by all heads, taken from ``wkv_a`` before the low-rank norm, the rest of
  ``wkv_a``'s output (``kv_lora_rank`` wide) is RMS-normalised (``kv_norm``) and up-projected by
  ``wkv_b`` into every head's ``k_nope`` and value (``v_head_dim``). RoPE (interleaved pairs,
  as upstream's complex RoPE and transformers' ``rope_interleave=True``) rotates only the rope
  parts. Softmax scale ``qk_head_dim ** -0.5``, times ``mscale ** 2`` under YaRN.
- **YaRN** (``rope_scaling``, a :class:`~torchtitan_spmd.models.rope.RopeScaling`): the tables
  are the shared :mod:`torchtitan_spmd.models.rope`'s (of the ``qk_rope_head_dim`` rope part), and
  :func:`yarn_softmax_scale` multiplies the softmax scale by ``yarn_mscale(factor,
  mscale_all_dim) ** 2`` (transformers' DeepseekV3). As transformers, and unlike upstream (which
  applies it only when ``max_seq_len > original_seq_len``), YaRN applies whenever it is
  configured: the trainer sets ``max_seq_len`` to the run's sequence length, so upstream's
  condition would switch it off in short runs.
- **The kernel**: SDPA's fused CPU kernel (and torch's ring attention built on it) needs one head
  width for queries, keys and values; MLA's differ (192 vs 128 in the real flavours). The values
  are zero-padded to the query/key width before the kernel and the output sliced back, and the
  queries are pre-multiplied by ``softmax_scale * sqrt(qk_head_dim)`` so the kernel's default
  scale gives MLA's: the kernel (and context parallelism's ring attention) runs unchanged.
- **MoE** (:class:`~torchtitan_spmd.models.moe.MoE`): sigmoid (or softmax) scores, the expert
  bias for selection only, group-limited top-k (``n_group``/``topk_group``), the chosen scores
  normalised (``route_norm``) and times ``route_scale`` (``routed_scaling_factor``), and
  ``n_shared_experts`` shared experts; blocks ``0 .. first_k_dense_replace - 1`` are dense.
- Multi-token prediction (DeepSeek-V3's MTP module) is not built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_spmd.models.common import (
    Decoder,
    DecoderBlock,
    RMSNorm,
    ScaledDotProductAttention,
    check_attn_mask_value,
    check_positive_ints,
)
from torchtitan_spmd.models.llama3.model import apply_rotary_emb
from torchtitan_spmd.models.moe import MoE, local_weight
from torchtitan_spmd.models.rope import RopeScaling, yarn_mscale

__all__ = [
    "DeepSeekV3Block",
    "DeepSeekV3Config",
    "DeepSeekV3Model",
    "LatentAttention",
    "yarn_softmax_scale",
]

#: DeepSeek-V3's YaRN (upstream's flavours): factor 40 over a 4096-token context, mscale 1.
DEEPSEEK_YARN = RopeScaling(kind="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


@dataclass(frozen=True)
class DeepSeekV3Config:
    """Hyper-parameters of :class:`DeepSeekV3Model` (names as upstream torchtitan's, transformers' in brackets).

    Attributes:
        dim: model width (``hidden_size``). n_layers: blocks. n_heads: attention heads.
        vocab_size, norm_eps (``rms_norm_eps``), max_seq_len: the RoPE tables' rows.
        q_lora_rank: the queries' low-rank width; 0: no query compression (``wq``).
        kv_lora_rank: the keys' and values' low-rank width.
        qk_nope_head_dim, qk_rope_head_dim: the two parts of a query/key head (the rope part even).
        v_head_dim: a value head's width.
        rope_theta: RoPE base. rope_scaling: the RoPE scaling
            (:class:`~torchtitan_spmd.models.rope.RopeScaling`; DeepSeek's is YaRN with
            ``mscale == mscale_all_dim``, whose ``mscale_all_dim`` also scales the softmax).
        hidden_dim: the dense blocks' SwiGLU width (``intermediate_size``).
        first_k_dense_replace: the first this many blocks are dense (``n_dense_layers`` upstream).
        num_experts (``n_routed_experts``), top_k (``num_experts_per_tok``), moe_hidden_dim
            (``moe_intermediate_size``), n_shared_experts, score_func, route_norm
            (``norm_topk_prob``), route_scale (``routed_scaling_factor``), n_group, topk_group,
            load_balance_coeff (the expert bias' step; None: no bias): the MoE blocks'.
        attn_mask_type: ``"causal"`` or ``"block_causal"`` (packed documents; see
            :data:`~torchtitan_spmd.models.common.ATTN_MASK_TYPES`).
    """

    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    vocab_size: int = 320
    norm_eps: float = 1e-6
    max_seq_len: int = 2048
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = DEEPSEEK_YARN
    hidden_dim: int = 1024
    first_k_dense_replace: int = 1
    num_experts: int = 8
    top_k: int = 3
    moe_hidden_dim: int = 256
    n_shared_experts: int = 2
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    load_balance_coeff: float | None = 1e-3
    attn_mask_type: str = "causal"

    @property
    def qk_head_dim(self) -> int:
        """A query/key head's width: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The RoPE tables' head width (the rope part): ``qk_rope_head_dim``."""
        return self.qk_rope_head_dim

    @property
    def moe_enabled(self) -> bool:
        """Whether any block is a mixture of experts (``num_experts > 0`` and a block past the dense ones)."""
        return self.num_experts > 0 and self.n_layers > self.first_k_dense_replace

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` is an MoE block."""
        return self.num_experts > 0 and layer_id >= self.first_k_dense_replace

    def __post_init__(self) -> None:
        owner = "DeepSeekV3Config"
        check_attn_mask_value(owner, self.attn_mask_type)
        check_positive_ints(owner, {n: getattr(self, n) for n in (
            "dim", "n_layers", "n_heads", "vocab_size", "max_seq_len", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "hidden_dim")})
        for name in ("q_lora_rank", "first_k_dense_replace", "num_experts", "n_shared_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{owner}.{name} must be an int >= 0, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{owner}.qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(f"{owner}.norm_eps and rope_theta must be > 0, got {self.norm_eps!r}, {self.rope_theta!r}")
        if not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"{owner}.rope_scaling must be a RopeScaling, got {self.rope_scaling!r}")
        if self.num_experts == 0:
            return
        check_positive_ints(owner, {"top_k": self.top_k, "moe_hidden_dim": self.moe_hidden_dim,
                                    "n_group": self.n_group, "topk_group": self.topk_group})
        if self.top_k > self.num_experts:
            raise ValueError(f"{owner}.top_k={self.top_k} is larger than num_experts={self.num_experts}.")
        if self.num_experts % self.n_group:
            raise ValueError(f"{owner}.n_group={self.n_group} must divide num_experts={self.num_experts}.")
        if self.topk_group > self.n_group:
            raise ValueError(f"{owner}.topk_group={self.topk_group} must be at most n_group={self.n_group}.")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"{owner}.top_k={self.top_k} is more than the topk_group={self.topk_group} groups of "
                             f"{self.num_experts // self.n_group} experts hold.")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"{owner}.score_func={self.score_func!r}; valid: 'softmax', 'sigmoid'.")
        if self.load_balance_coeff is not None and not self.load_balance_coeff > 0:
            raise ValueError(f"{owner}.load_balance_coeff must be > 0 or None, got {self.load_balance_coeff!r}")


# ----------------------------------------------------------------------------- YaRN
def yarn_softmax_scale(config: DeepSeekV3Config) -> float:
    """MLA's softmax scale: ``qk_head_dim ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` under
    YaRN with ``mscale_all_dim`` set (transformers' DeepseekV3Attention)."""
    scale = config.qk_head_dim ** -0.5
    s = config.rope_scaling
    if s.kind != "none" and s.mscale_all_dim:
        m = yarn_mscale(s.factor, s.mscale_all_dim)
        scale *= m * m
    return scale


# ----------------------------------------------------------------------------- MLA
#: The mesh axes over which MLA's replicated weights (``wkv_a``, ``kv_norm``, ``wq_a``, ``q_norm``)
#: get pending-sum gradients: tensor parallelism's (each TP rank's heads use them).
REPLICATED_AXES: tuple[str, ...] = ("tp",)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`~torchtitan_spmd.models.common.RMSNorm`'s math with an explicit (local) weight."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


class LatentAttention(nn.Module):
    """Multi-head latent attention (see the module docstring). Head counts come from the
    (possibly column-sharded) up-projections' outputs, never from the config."""

    def __init__(self, config: DeepSeekV3Config) -> None:
        super().__init__()
        c = config
        self.q_lora_rank, self.kv_lora_rank = c.q_lora_rank, c.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = (
            c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim)
        self.qk_head_dim = c.qk_head_dim
        if c.q_lora_rank == 0:
            self.wq = nn.Linear(c.dim, c.n_heads * c.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(c.dim, c.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(c.q_lora_rank, eps=c.norm_eps)
            self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * c.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(c.dim, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(c.kv_lora_rank, eps=c.norm_eps)
        self.wkv_b = nn.Linear(c.kv_lora_rank, c.n_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.wo = nn.Linear(c.n_heads * c.v_head_dim, c.dim, bias=False)
        self.softmax_scale = yarn_softmax_scale(c)
        self.sdpa = ScaledDotProductAttention()

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Attend over ``x`` ``[batch, seq, dim]``; ``rope_cos``/``rope_sin`` ``[seq, qk_rope_head_dim // 2]``
        or per token ``[batch, seq, qk_rope_head_dim // 2]``; ``positions`` (block-causal only): the
        tokens' per-document positions, the kernel's mask.

        The body is the plan's local region (as an MoE block): it reads every weight's local value
        (:func:`~torchtitan_spmd.models.moe.local_weight`). Under tensor parallelism the
        up-projections and ``wo`` are sharded by heads, so the output is a pending sum over ``tp``,
        and the replicated low-rank projections and norms feed only this rank's heads: their
        gradients are pending sums over ``tp`` too (``REPLICATED_AXES``)."""
        bs, seqlen, _ = x.shape
        rep = REPLICATED_AXES
        if self.q_lora_rank == 0:
            q = F.linear(x, local_weight(self.wq.weight))
        else:
            q_latent = _rms_norm(F.linear(x, local_weight(self.wq_a.weight, rep)),
                                 local_weight(self.q_norm.weight, rep), self.q_norm.eps)
            q = F.linear(q_latent, local_weight(self.wq_b.weight))
        q = q.view(bs, seqlen, -1, self.qk_head_dim)
        q_nope, q_rope = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_rope = apply_rotary_emb(q_rope, rope_cos, rope_sin)
        kv, k_rope = torch.split(F.linear(x, local_weight(self.wkv_a.weight, rep)),
                                 [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rope = apply_rotary_emb(k_rope.unsqueeze(2), rope_cos, rope_sin)  # one head, shared by all
        kv = _rms_norm(kv, local_weight(self.kv_norm.weight, rep), self.kv_norm.eps)
        kv = F.linear(kv, local_weight(self.wkv_b.weight)).view(bs, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        heads = k_nope.shape[2]
        # The kernel's default scale is qk_head_dim ** -0.5: fold MLA's (YaRN's mscale) into q.
        q = torch.cat([q_nope, q_rope], dim=-1) * (self.softmax_scale * math.sqrt(self.qk_head_dim))
        k = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1)
        pad = self.qk_head_dim - self.v_head_dim
        if pad > 0:  # one head width for the fused kernel (and ring attention): zero value columns
            v = F.pad(v, (0, pad))
        elif pad < 0:  # zero query/key columns change no score
            q, k = F.pad(q, (0, -pad)), F.pad(k, (0, -pad))
        qkv = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = (self.sdpa(*qkv) if positions is None else self.sdpa(*qkv, positions)).transpose(1, 2)
        out = out[..., : self.v_head_dim]
        return F.linear(out.reshape(bs, seqlen, -1), local_weight(self.wo.weight))


class DeepSeekV3Block(DecoderBlock):
    """A DeepSeek-V3 block: MLA, then a dense SwiGLU (``layer_id < first_k_dense_replace``) or the MoE."""

    def __init__(self, layer_id: int, config: DeepSeekV3Config) -> None:
        c = config
        moe = None
        if c.is_moe_layer(layer_id):
            moe = MoE(c.dim, c.moe_hidden_dim, c.num_experts, c.top_k, score_func=c.score_func,
                      route_norm=c.route_norm, route_scale=c.route_scale, load_balance_coeff=c.load_balance_coeff,
                      n_group=c.n_group, topk_group=c.topk_group,
                      shared_hidden_dim=c.n_shared_experts * c.moe_hidden_dim)
        super().__init__(layer_id, LatentAttention(c), dim=c.dim, hidden_dim=c.hidden_dim, norm_eps=c.norm_eps,
                         moe=moe)


class DeepSeekV3Model(Decoder):
    """DeepSeek-V3-style decoder: ``tokens [batch, seq] -> logits [batch, seq, vocab]``."""

    config: DeepSeekV3Config

    def __init__(self, config: DeepSeekV3Config) -> None:
        super().__init__(config, lambda i: DeepSeekV3Block(i, config))

    def init_std(self, name: str) -> float:
        """As :meth:`Decoder.init_std`, the shared experts' ``w2``/``w3`` depth-scaled too."""
        if name.endswith(("moe.shared_experts.w2", "moe.shared_experts.w3")):
            return super().init_std("attention.wo.weight")
        return super().init_std(name)
