"""A small Llama-style decoder-only transformer (fp32 by default).

The module tree mirrors torchtitan's llama3 model so that sharding plans written
against torchtitan's fully-qualified names apply unchanged::

    Transformer
    ├── tok_embeddings            nn.Embedding(vocab_size, dim)
    ├── layers                    nn.ModuleDict {"0": TransformerBlock, "1": ...}
    │   ├── attention_norm        RMSNorm(dim)
    │   ├── attention             Attention: wq, wk, wv, wo (nn.Linear, no bias),
    │   │                         sdpa (ScaledDotProductAttention, no parameters)
    │   ├── ffn_norm              RMSNorm(dim)
    │   └── feed_forward          FeedForward: w1, w2, w3 (nn.Linear, no bias)
    ├── norm                      RMSNorm(dim)
    ├── output                    nn.Linear(dim, vocab_size, bias=False)
    └── buffers rope_cos, rope_sin  [max_seq_len, head_dim // 2], non-persistent

Tensor-parallel friendliness: every module derives head counts, batch size and
sequence length from the shapes of the tensors it receives (``view(..., -1,
head_dim)``, ``reshape(bs, seqlen, -1)``), never from the config. The same code
therefore runs unchanged when ``wq``/``wk``/``wv``/``w1``/``w3`` are
column-sharded and ``wo``/``w2`` row-sharded and each rank holds only its heads.

Rotary embeddings use real ``cos``/``sin`` tables on interleaved pairs
``(x[2i], x[2i+1])`` -- numerically the same rotation as torchtitan's complex
``freqs_cis`` formulation, without complex tensors.

Initialisation is a function of ``(seed, parameter name)`` only: each parameter
is filled from its own ``torch.Generator`` (see :meth:`Transformer.init_weights`),
so the full weights are bit-identical whatever the construction order or the
parallel layout applied afterwards.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

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

#: Standard deviation of the normal init of embeddings and linears.
INIT_STD = 0.02


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
        max_seq_len: number of rows of the RoPE tables (longest sequence).
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

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"LlamaConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig head_dim={self.head_dim} must be even for RoPE")
        kv = self.kv_heads
        if not isinstance(kv, int) or isinstance(kv, bool) or kv < 1 or self.n_heads % kv:
            raise ValueError(
                f"LlamaConfig.n_kv_heads={self.n_kv_heads!r} must be a positive divisor "
                f"of n_heads={self.n_heads}"
            )
        if self.norm_eps <= 0:
            raise ValueError(f"LlamaConfig.norm_eps must be > 0, got {self.norm_eps!r}")
        if self.rope_theta <= 0:
            raise ValueError(f"LlamaConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if self.ffn_dim_multiplier is not None and self.ffn_dim_multiplier <= 0:
            raise ValueError(
                f"LlamaConfig.ffn_dim_multiplier must be > 0 or None, got "
                f"{self.ffn_dim_multiplier!r}"
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


#: Named model sizes. ``debugmodel`` is the same order as torchtitan's llama3
#: debugmodel (~6M parameters); ``tiny`` is for fast tests. The vocabulary of
#: both matches :class:`torchtitan_spmd.data.Tokenizer` (320 ids).
FLAVORS: dict[str, LlamaConfig] = {
    "debugmodel": LlamaConfig(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=320,
        multiple_of=256,
        ffn_dim_multiplier=1.3,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=2048,
    ),
    "tiny": LlamaConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=320,
        multiple_of=64,
        ffn_dim_multiplier=None,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_seq_len=512,
    ),
}


class RMSNorm(nn.Module):
    """Root-mean-square layer norm: ``x * rsqrt(mean(x**2, -1) + eps) * weight``.

    The normalisation is computed in float32 and cast back to the input dtype
    before the (learned) scale is applied. Written out by hand rather than using
    ``nn.RMSNorm`` so the numerics do not change across torch versions.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` over its last dimension."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        """Set the scale to ones."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def precompute_rope(
    head_dim: int, max_seq_len: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables ``(cos, sin)``, each float32 of shape ``[max_seq_len, head_dim // 2]``.

    Row ``p`` holds the angles ``p * theta ** (-2i / head_dim)`` for
    ``i = 0 .. head_dim/2 - 1``. Computed in float64, then rounded.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    positions = torch.arange(max_seq_len, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[..., 2i], x[..., 2i+1])`` of ``x`` by the RoPE angles.

    Args:
        x: ``[batch, seq, heads, head_dim]`` (any number of heads).
        cos, sin: ``[seq, head_dim // 2]``.

    Returns a new tensor of ``x``'s shape and dtype (computed in float32).
    """
    bs, seqlen, n_heads, head_dim = x.shape
    pairs = x.float().reshape(bs, seqlen, n_heads, head_dim // 2, 2)
    x_even = pairs[..., 0]
    x_odd = pairs[..., 1]
    cos = cos.view(1, seqlen, 1, head_dim // 2)
    sin = sin.view(1, seqlen, 1, head_dim // 2)
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.reshape(bs, seqlen, n_heads, head_dim).type_as(x)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Repeat each kv head ``n_rep`` times: ``[b, s, kv, d] -> [b, s, kv * n_rep, d]``.

    Query head ``h`` is paired with kv head ``h // n_rep``, so a contiguous
    block of query heads and the matching block of kv heads stay together under
    column sharding.
    """
    if n_rep == 1:
        return x
    bs, seqlen, n_kv, head_dim = x.shape
    return (
        x.unsqueeze(3)
        .expand(bs, seqlen, n_kv, n_rep, head_dim)
        .reshape(bs, seqlen, n_kv * n_rep, head_dim)
    )


class ScaledDotProductAttention(nn.Module):
    """Causal SDPA over ``[batch, heads, seq, head_dim]`` tensors.

    A module of its own so a sharding plan can declare its boundary (and let a
    backend run it on local shards where DTensor has no sharding rule for it).
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``softmax(q k^T / sqrt(d) + causal mask) v``."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE.

    Head counts are inferred from the (possibly local, column-sharded) outputs
    of ``wq``/``wk``; only ``head_dim`` is fixed.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        self.sdpa = ScaledDotProductAttention()

    def forward(
        self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor
    ) -> torch.Tensor:
        """Attend over ``x`` ``[batch, seq, dim]``; ``rope_cos``/``rope_sin`` are ``[seq, head_dim//2]``."""
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q = apply_rotary_emb(q, rope_cos, rope_sin)
        k = apply_rotary_emb(k, rope_cos, rope_sin)
        n_rep = q.shape[2] // k.shape[2]
        k = _repeat_kv(k, n_rep)
        v = _repeat_kv(v, n_rep)
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = out.transpose(1, 2).reshape(bs, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the feed-forward to ``x`` ``[..., dim]``."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, layer_id: int, config: LlamaConfig) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)

    def forward(
        self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor
    ) -> torch.Tensor:
        """Apply the block to ``x`` ``[batch, seq, dim]``."""
        h = x + self.attention(self.attention_norm(x), rope_cos, rope_sin)
        return h + self.feed_forward(self.ffn_norm(h))


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name`` under model seed ``seed``.

    A stable 63-bit hash (BLAKE2b) of ``"{seed}/{name}"``: independent of
    Python's hash randomisation, of construction order and of the process.
    """
    digest = hashlib.blake2b(f"{int(seed)}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Transformer(nn.Module):
    """Llama-style decoder: ``tokens [batch, seq] -> logits [batch, seq, vocab]``.

    No loss is computed inside the model. See the module docstring for the
    module tree. ``forward`` slices the RoPE tables with the global sequence
    length of ``tokens`` and passes the slices to every block.
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, config) for i in range(config.n_layers)}
        )
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = precompute_rope(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (float32) ``[batch, seq, vocab]`` for int64 ``tokens`` ``[batch, seq]``."""
        seqlen = tokens.shape[1]
        if seqlen > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seqlen} exceeds max_seq_len={self.config.max_seq_len}"
            )
        rope_cos = self.rope_cos[:seqlen]
        rope_sin = self.rope_sin[:seqlen]
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, rope_cos, rope_sin)
        h = self.norm(h)
        return self.output(h).float()

    def init_std(self, name: str) -> float:
        """Standard deviation of the normal init of weight ``name`` (a matrix).

        ``INIT_STD`` everywhere, except the residual-stream projections
        ``attention.wo`` and ``feed_forward.w2``, which are scaled by
        ``1 / sqrt(2 * n_layers)`` (GPT-2 style depth scaling).
        """
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            return INIT_STD / math.sqrt(2 * self.config.n_layers)
        return INIT_STD

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministically (re)initialise every parameter and the RoPE buffers.

        Each parameter is drawn on CPU in float32 from its own
        ``torch.Generator`` seeded with :func:`param_seed(seed, fqn)
        <param_seed>`, then copied in place: norm weights (1-D) are ones,
        matrices ``normal(0, std)`` with :meth:`init_std`. The result depends
        only on ``seed`` and the parameter names.
        """
        for name, param in self.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
                continue
            gen = torch.Generator(device="cpu")
            gen.manual_seed(param_seed(seed, name))
            values = torch.empty(param.shape, dtype=torch.float32)
            values.normal_(mean=0.0, std=self.init_std(name), generator=gen)
            param.copy_(values)
        cos, sin = precompute_rope(
            self.config.head_dim, self.config.max_seq_len, self.config.rope_theta
        )
        for buf_name, value in (("rope_cos", cos), ("rope_sin", sin)):
            buf = getattr(self, buf_name)
            if buf.shape == value.shape and buf.device.type != "meta":
                buf.copy_(value)
            else:
                setattr(self, buf_name, value.to(device=buf.device))


def build_model(flavor: str, *, seed: int, vocab_size: int | None = None) -> Transformer:
    """Build the named flavour full-size on CPU (float32) and initialise it.

    Args:
        flavor: a key of :data:`FLAVORS`.
        seed: the init seed (see :meth:`Transformer.init_weights`).
        vocab_size: overrides the flavour's vocabulary size when given.

    Raises:
        ValueError: unknown flavour (the message lists the valid ones) or a bad
            ``vocab_size``.
    """
    if flavor not in FLAVORS:
        raise ValueError(
            f"unknown model flavor {flavor!r}; valid flavors: {', '.join(sorted(FLAVORS))}"
        )
    config = FLAVORS[flavor]
    if vocab_size is not None:
        config = replace(config, vocab_size=vocab_size)
    # The default nn.Linear/nn.Embedding init draws from the global RNG; fork it so
    # building a model leaves the caller's RNG state untouched. (Constructing under
    # ``torch.device("meta")`` would avoid the wasted draws but imports torch._dynamo,
    # ~2 s.) Everything is then overwritten deterministically by init_weights.
    with torch.random.fork_rng(devices=[]):
        model = Transformer(config)
    model.init_weights(seed)
    return model


def count_parameters(model: nn.Module) -> int:
    """Total number of elements over ``model.parameters()`` (shared ones counted once)."""
    return sum(p.numel() for p in model.parameters())
