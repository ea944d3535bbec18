"""Building blocks the decoder families share: norms, RoPE, SwiGLU, SDPA, the decoder shell, init.

The module tree mirrors torchtitan's decoders, so sharding plans written against
torchtitan's fully-qualified names apply unchanged::

    Decoder
    ├── tok_embeddings            nn.Embedding(vocab_size, dim)
    ├── layers                    nn.ModuleDict {"0": block, "1": ...} (the family's block)
    ├── norm                      RMSNorm(dim)
    ├── output                    nn.Linear(dim, vocab_size, bias=False)
    └── buffers rope_cos, rope_sin  [max_seq_len, head_dim // 2], non-persistent

Tensor-parallel friendliness: every module derives head counts, batch size and
sequence length from the shapes of the tensors it receives (``view(..., -1,
head_dim)``), never from the config, so the same code runs on column- and
row-sharded weights.

Initialisation is a function of ``(seed, tensor name)`` only
(:meth:`Decoder.initial_value`): each parameter is drawn from its own
``torch.Generator``, so the full weights are bit-identical whatever the
construction order, the device the model was built on, or the parallel layout.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_spmd.models.rope import NO_SCALING, precompute_rope

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims

__all__ = [
    "ATTN_MASK_TYPES",
    "INIT_STD",
    "ZERO_INIT",
    "Decoder",
    "DecoderBlock",
    "FeedForward",
    "GroupedQueryAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "ScaledDotProductAttention",
    "VocabShardedEmbedding",
    "block_causal_mask",
    "check_attn_mask_type",
    "check_attn_mask_value",
    "check_positive_ints",
    "check_seq_len",
    "check_tp_divisible",
    "check_weight_tying",
    "count_parameters",
    "param_seed",
    "precompute_rope",
    "repeat_kv",
]

#: Standard deviation of the normal init of embeddings and linears.
INIT_STD = 0.02

#: Name endings of the tensors that start at zero: the MoE load-balancing state.
ZERO_INIT: tuple[str, ...] = ("moe.expert_bias", "moe.tokens_per_expert")


def check_positive_ints(owner: str, values: Mapping[str, object]) -> None:
    """Raise ValueError naming ``owner.field`` for any value that is not a positive int."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


#: The values of a family config's ``attn_mask_type`` (upstream's field, before #2761 renamed it
#: ``mask_type`` and a0c831c49 made every language model document-masked): ``causal`` (the whole
#: window is one sequence) and ``block_causal`` (packed documents, split after each EOS token,
#: attend only within themselves; their RoPE positions restart at 0).
ATTN_MASK_TYPES: tuple[str, ...] = ("causal", "block_causal")


def check_attn_mask_value(owner: str, value: object) -> None:
    """Raise ValueError naming ``owner.attn_mask_type`` for a value outside :data:`ATTN_MASK_TYPES`."""
    if value not in ATTN_MASK_TYPES:
        raise ValueError(f"{owner}.attn_mask_type must be one of {', '.join(map(repr, ATTN_MASK_TYPES))}, "
                         f"got {value!r}")


def check_attn_mask_type(config: object, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """Raise ValueError for ``attn_mask_type="block_causal"`` under context parallelism.

    Torch's ring attention (what CP runs) takes no mask: each CP rank's chunk would attend
    across documents.
    """
    if getattr(config, "attn_mask_type", "causal") == "block_causal" and parallel_dims.cp_enabled:
        raise ValueError(
            f"model {job_config.model.name}/{job_config.model.flavor} has attn_mask_type='block_causal', which "
            f"context parallelism cannot run (parallelism.context_parallel_degree={parallel_dims.cp}: torch's "
            f"ring attention takes no mask): train it without CP (FSDP, TP, PP), or use a flavour with "
            f"attn_mask_type='causal'.")


def check_seq_len(max_seq_len: int, job_config: JobConfig) -> None:
    """Raise ValueError when ``training.seq_len`` exceeds the model's ``max_seq_len`` (its RoPE tables)."""
    seq_len = job_config.training.seq_len
    if seq_len > max_seq_len:
        raise ValueError(f"training.seq_len={seq_len} exceeds the model's max_seq_len={max_seq_len} "
                         f"(model.flavor={job_config.model.flavor!r}).")


def check_weight_tying(config: object, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """Raise ValueError for a tied model (``enable_weight_tying``) under pipeline parallelism.

    As upstream: the embedding and the output projection sit on different stages, so one
    parameter cannot serve both.
    """
    if getattr(config, "enable_weight_tying", False) and parallel_dims.pp_enabled:
        raise ValueError(
            f"model {job_config.model.name}/{job_config.model.flavor} ties its embedding and output weights "
            f"(enable_weight_tying; HF tie_word_embeddings), which pipeline parallelism cannot split over stages "
            f"(parallelism.pipeline_parallel_degree={parallel_dims.pp}): train it without PP (FSDP, TP, CP), "
            f"or untie it (a flavour without enable_weight_tying; its output then starts as a copy).")


def check_tp_divisible(sizes: Mapping[str, int], job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """Raise ValueError for the first of ``sizes`` (``what -> size``) that TP does not divide.

    With sequence parallelism, ``training.seq_len`` must divide too. No-op without TP.
    """
    if not parallel_dims.tp_enabled:
        return
    checks = dict(sizes)
    if job_config.parallelism.enable_sequence_parallel:
        checks["training.seq_len"] = job_config.training.seq_len
    tp = parallel_dims.tp
    for what, value in checks.items():
        if value % tp:
            raise ValueError(f"{what}={value} is not divisible by parallelism.tensor_parallel_degree={tp}.")


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

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Repeat each kv head ``n_rep`` times: ``[b, s, kv, d] -> [b, s, kv * n_rep, d]``.

    Query head ``h`` is paired with kv head ``h // n_rep``, so a contiguous block of
    query heads and the matching block of kv heads stay together under column sharding.
    """
    if n_rep == 1:
        return x
    bs, seqlen, n_kv, head_dim = x.shape
    return x.unsqueeze(3).expand(bs, seqlen, n_kv, n_rep, head_dim).reshape(bs, seqlen, n_kv * n_rep, head_dim)


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def block_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """The block-causal attention mask ``[batch, 1, seq, seq]`` (bool, True: attend) of tokens
    whose per-document positions are ``positions`` ``[batch, seq]``: a document starts where its
    position is 0 (as upstream's a0c831c49 reads document starts from the positions), and a
    query attends to the keys of its own document at or before it."""
    doc = torch.cumsum(positions == 0, dim=1)
    same = doc[:, None, :, None] == doc[:, None, None, :]
    seq = positions.shape[1]
    return same & torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()


class ScaledDotProductAttention(nn.Module):
    """Causal grouped-query SDPA over heads-first ``[batch, heads, seq, head_dim]`` tensors.

    Given the tokens' per-document ``positions`` (``attn_mask_type="block_causal"``), the
    mask is :func:`block_causal_mask` instead, built from them inside the kernel's local
    region (so every backend sees this rank's plain local positions): SDPA with an explicit
    boolean mask, on every device (FlexAttention has no CPU backward).

    A module of its own so a sharding plan can declare it a local region (DTensor
    has no sharding rule for it on every device), and so context parallelism can
    replace its body (ring attention over sequence shards): keys and values keep their
    own (fewer) heads up to here, so a context-parallel exchange of them moves
    ``n_kv_heads``, not ``n_heads``.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """``softmax(q k^T / sqrt(d) + causal mask) v`` (``is_causal``: no mask tensor), or with
        the block-causal mask of ``positions`` ``[batch, seq]`` when given.

        ``k``/``v`` may have fewer heads than ``q`` (a divisor): query head ``h`` attends
        with kv head ``h // n_rep``.
        """
        # enable_gqa: no repeated copy of k and v (on CPU the flash kernel saves them as given,
        # which halves what attention keeps for backward at n_heads = 2 * n_kv_heads).
        gqa = q.shape[1] != k.shape[1]
        for t in (k, v) if gqa else ():
            if t.requires_grad:
                # The CPU flash kernel's GQA backward returns key/value gradients in a layout
                # that a later DTensor ``view`` in backward (full_dtensor) rejects.
                t.register_hook(_contiguous)
        if positions is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(positions), enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


class VocabShardedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose table may be sharded on the vocabulary (every decoder's).

    Tensor parallelism shards the table on the vocabulary (``S(0)@tp``, upstream's
    ``RowwiseParallel`` for an ``nn.Embedding``), tied or not (a tied decoder's table is its
    output projection's weight, ``ColwiseParallel`` there). The plan declares this module a
    local region: each rank looks up the tokens its rows hold and gives zeros for the others,
    so the output is a pending sum over ``tp`` (reduced, or reduce-scattered onto the residual
    stream, at the module's output boundary).

    Which rows this rank holds is read, whatever the backend, from the non-persistent buffer
    ``vocab_ids`` (``arange(num_embeddings)``), which the plan lays out as the table: its local
    shard holds the ids of the local rows (not saved; ``Decoder.initial_value`` restates it).
    Unsharded, the lookup is ``nn.Embedding``'s.
    """

    vocab_ids: torch.Tensor

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.register_buffer("vocab_ids", torch.arange(num_embeddings, device=self.weight.device),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's table for the ``tokens`` it holds, zeros for the others.

        DTensor ``tokens`` (a plan that does not declare this module a local region, under
        ``full_dtensor``): DTensor computes the lookup itself."""
        from torch.distributed.tensor import DTensor

        if isinstance(tokens, DTensor):
            return F.embedding(tokens, self.weight)
        weight, ids = _local_shard_weight(self.weight), _local_value(self.vocab_ids)
        if weight.shape[0] == self.num_embeddings:  # the whole table
            return F.embedding(tokens, weight)
        local = tokens - ids[:1]
        outside = (local < 0) | (local >= weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), weight)
        return rows.masked_fill(outside.unsqueeze(-1), 0.0)


def _local_value(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local value (a DTensor's ``to_local()``; a plain tensor as it is)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _local_shard_weight(weight: torch.Tensor) -> torch.Tensor:
    """A vocab-sharded table's local value inside its local region, its gradient a pending sum
    (``Partial``) on every mesh dim where the table is replicated: those hold different tokens
    (the batch; the sequence under ``cp``), so each rank's gradient is its tokens' share. The
    table's other use (the tied output projection) gets the same gradient placements from
    DTensor, so the two add up in one gradient. A plain tensor is returned as it is."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(weight, DTensor):
        return weight
    return weight.to_local(grad_placements=[Partial() if isinstance(p, Replicate) else p for p in weight.placements])


RotaryEmbedding = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``rope(x [batch, seq, heads, head_dim], cos, sin) -> x rotated``; ``cos``/``sin`` are
``[seq, head_dim // 2]`` or per token ``[batch, seq, head_dim // 2]`` (broadcast over heads)."""


class GroupedQueryAttention(nn.Module):
    """Causal grouped-query self-attention with RoPE and optional per-head QK RMSNorm.

    ``wq``/``wk``/``wv``/``wo`` (no bias), ``q_norm``/``k_norm`` (``RMSNorm(head_dim)``,
    when ``qk_norm_eps`` is given: applied per head before RoPE) and ``sdpa``. Head
    counts are inferred from the (possibly local, column-sharded) outputs of
    ``wq``/``wk``; only ``head_dim`` is fixed.
    """

    def __init__(self, *, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, rope: RotaryEmbedding,
                 qk_norm_eps: float | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rope = rope
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps=qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, eps=qk_norm_eps) if qk_norm_eps is not None else None
        self.sdpa = ScaledDotProductAttention()

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Attend over ``x`` ``[batch, seq, dim]``; ``rope_cos``/``rope_sin`` are ``[seq, head_dim//2]``
        or, per token, ``[batch, seq, head_dim//2]``; ``positions`` (block-causal only): the
        tokens' per-document positions, from which the kernel builds its mask."""
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, rope_cos, rope_sin), self.rope(k, rope_cos, rope_sin)
        qkv = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = self.sdpa(*qkv) if positions is None else self.sdpa(*qkv, positions)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


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


class DecoderBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``.

    ``attention(x, rope_cos, rope_sin)`` is the family's attention module. With ``moe`` (a
    :class:`~torchtitan_spmd.models.moe.MoE`) the block has it, named ``moe`` as upstream, in
    place of the dense ``feed_forward`` (``moe_enabled``).
    """

    def __init__(self, layer_id: int, attention: nn.Module, *, dim: int, hidden_dim: int, norm_eps: float,
                 moe: nn.Module | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        self.moe_enabled = moe is not None
        if moe is not None:
            self.moe = moe
        else:
            self.feed_forward = FeedForward(dim, hidden_dim)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the block to ``x`` ``[batch, seq, dim]`` (``positions``: block-causal only, the
        tokens' per-document positions for the attention's mask)."""
        args = (rope_cos, rope_sin) if positions is None else (rope_cos, rope_sin, positions)
        h = x + self.attention(self.attention_norm(x), *args)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))


def param_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name`` under model seed ``seed``.

    A stable 63-bit hash (BLAKE2b) of ``"{seed}/{name}"``: independent of Python's
    hash randomisation, of construction order and of the process.
    """
    digest = hashlib.blake2b(f"{int(seed)}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Decoder(nn.Module):
    """A pre-norm decoder: ``tokens [batch, seq] -> logits [batch, seq, vocab]`` (float32).

    Families give the config (``dim``, ``n_layers``, ``vocab_size``, ``norm_eps``,
    ``head_dim``, ``max_seq_len``, ``rope_theta``, optionally ``rope_scaling``, a
    :class:`~torchtitan_spmd.models.rope.RopeScaling`) and the block factory. No loss
    is computed inside the model. ``forward`` slices the RoPE tables with the
    global sequence length of ``tokens`` and passes them to every block.
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: object, block: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.config = config
        c = config
        tied = bool(getattr(c, "enable_weight_tying", False))
        # Vocab-sharded under tensor parallelism, tied or not (tied: the table is also the output's weight).
        self.tok_embeddings = VocabShardedEmbedding(c.vocab_size, c.dim)  # type: ignore[attr-defined]
        self.layers = nn.ModuleDict({str(i): block(i) for i in range(c.n_layers)})  # type: ignore[attr-defined]
        self.norm = RMSNorm(c.dim, eps=c.norm_eps)  # type: ignore[attr-defined]
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)  # type: ignore[attr-defined]
        if tied:
            self.tie_weights()
            # Saved once, as the embedding (HF's tie_word_embeddings writes no lm_head either):
            # the output's name leaves the state dict, and loading puts it back, tied.
            self._register_state_dict_hook(_drop_tied_output)
            self.register_load_state_dict_pre_hook(_fill_tied_output)
        cos, sin = self._rope_tables()
        device = self.output.weight.device
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    @property
    def weights_tied(self) -> bool:
        """Whether the output projection's weight is the embedding's (``enable_weight_tying``)."""
        emb, out = getattr(self, "tok_embeddings", None), getattr(self, "output", None)
        return emb is not None and out is not None and out.weight is emb.weight

    def tie_weights(self) -> None:
        """Make ``output.weight`` the very parameter ``tok_embeddings.weight`` (one tensor, one
        gradient: the two uses' gradients add up in it). Called again after anything that
        replaces parameters (sharding, meta materialisation)."""
        self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        # ``to_empty``/``to`` replace each module's parameters one module at a time, which unties.
        out = super()._apply(fn, recurse)
        if getattr(self.config, "enable_weight_tying", False) and not self.weights_tied \
                and getattr(self, "tok_embeddings", None) is not None and getattr(self, "output", None) is not None:
            self.tie_weights()
        return out

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        scaling = getattr(c, "rope_scaling", NO_SCALING)
        return precompute_rope(c.head_dim, c.max_seq_len, c.rope_theta, scaling)  # type: ignore[attr-defined]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (float32) ``[batch, seq, vocab]`` for int64 ``tokens`` ``[batch, seq]``.

        ``positions``: each token's index in its sequence (int64, ``tokens``' shape), for
        RoPE; None means ``0 .. seq-1``. Context parallelism passes them: a rank then holds
        a slice of every sequence, not its start. With ``attn_mask_type="block_causal"`` they
        are required: each token's index in its own document
        (:func:`~torchtitan_spmd.distributed.inputs.document_positions`), which both rotate
        RoPE and give every attention its block-causal mask.
        """
        block_causal = getattr(self.config, "attn_mask_type", "causal") == "block_causal"
        if block_causal and positions is None:
            raise ValueError(
                "attn_mask_type='block_causal': the model needs the tokens' per-document positions, "
                "forward(tokens, positions=document_positions(tokens, eos_id)) "
                "(torchtitan_spmd.distributed.inputs.document_positions); the trainer passes them.")
        if positions is None and self.tok_embeddings is None:
            # A later pipeline stage: ``tokens`` is an activation, sequence-sharded under
            # sequence parallelism, so its length is not the sequence's. The trainer sizes
            # the tables to the run's sequences (max_seq_len = training.seq_len).
            rope_cos, rope_sin = self.rope_cos, self.rope_sin
        elif positions is None:
            seqlen, limit = tokens.shape[1], self.config.max_seq_len  # type: ignore[attr-defined]
            if seqlen > limit:
                raise ValueError(f"sequence length {seqlen} exceeds max_seq_len={limit}")
            rope_cos, rope_sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        else:  # per-token tables [batch, seq, head_dim // 2], laid out as the tokens
            rope_cos, rope_sin = F.embedding(positions, self.rope_cos), F.embedding(positions, self.rope_sin)
        # A pipeline stage's part (techniques/pipeline_parallel.py) lacks the modules other
        # stages hold: without the embedding ``tokens`` is the previous stage's activation.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        extra = (positions,) if block_causal else ()
        for layer in self.layers.values():
            h = layer(h, rope_cos, rope_sin, *extra)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h).float() if self.output is not None else h

    def init_std(self, name: str) -> float:
        """Standard deviation of the normal init of weight matrix ``name``.

        ``INIT_STD`` everywhere, except the residual-stream projections
        ``attention.wo`` and ``feed_forward.w2``, scaled by ``1 / sqrt(2 * n_layers)``
        (GPT-2 style depth scaling); in an MoE block, as upstream's qwen3, the router's gate
        and the experts' ``w2`` and ``w3`` are depth-scaled too (``w1``: ``INIT_STD``).
        """
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "moe.router.gate.weight",
                          "moe.experts.w2", "moe.experts.w3")):
            return INIT_STD / math.sqrt(2 * self.config.n_layers)  # type: ignore[attr-defined]
        return INIT_STD

    def initial_value(self, fqn: str, shape: Sequence[int], seed: int) -> torch.Tensor:
        """The full initial value (CPU, float32) of parameter or buffer ``fqn`` of full ``shape``.

        Vectors (norm weights) are ones, the MoE state (``ZERO_INIT``) zeros; matrices ``normal(0, init_std(fqn))`` from a
        ``torch.Generator`` seeded with :func:`param_seed(seed, fqn) <param_seed>`;
        the RoPE buffers their tables. Depends only on ``seed``, ``fqn`` and the config.
        """
        if fqn in ("rope_cos", "rope_sin"):
            return self._rope_tables()[0 if fqn == "rope_cos" else 1]
        if fqn == "tok_embeddings.vocab_ids":  # a tied table's row ids (VocabShardedEmbedding)
            return torch.arange(shape[0])
        if fqn.endswith(ZERO_INIT):
            return torch.zeros(shape, dtype=torch.float32)
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.float32)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(param_seed(seed, fqn))
        values = torch.empty(shape, dtype=torch.float32)
        return values.normal_(mean=0.0, std=self.init_std(fqn), generator=gen)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """(Re)initialise every parameter and the RoPE buffers of an unsharded model, in place."""
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            tensor.copy_(self.initial_value(name, tensor.shape, seed))


_TIED = "output.weight"


def _drop_tied_output(module: nn.Module, state_dict: dict, prefix: str, local_metadata: object) -> None:
    """``state_dict`` hook of a tied decoder: the output weight is the embedding, saved once."""
    if getattr(module, "weights_tied", False):
        state_dict.pop(prefix + _TIED, None)


def _fill_tied_output(module: nn.Module, state_dict: dict, prefix: str, *_: object) -> None:
    """``load_state_dict`` pre-hook of a tied decoder: the output weight is the embedding's, so
    a state dict without it (saved once) loads; one with its own copy is refused (not tied)."""
    emb = state_dict.get(prefix + "tok_embeddings.weight")
    out = state_dict.get(prefix + _TIED)
    if out is not None and emb is not None and out is not emb and not torch.equal(out, emb):
        raise ValueError(f"{prefix}{_TIED} differs from {prefix}tok_embeddings.weight, but this model ties "
                         "them (enable_weight_tying): load a tied checkpoint, or untie the model.")
    if emb is not None:
        state_dict[prefix + _TIED] = emb


def count_parameters(model: nn.Module) -> int:
    """Total number of elements over ``model.parameters()`` (shared ones counted once)."""
    return sum(p.numel() for p in model.parameters())
