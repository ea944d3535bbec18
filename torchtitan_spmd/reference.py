"""An independent reference for parity: the built-in model families restated in plain PyTorch.

The parity tests and ``python -m torchtitan_spmd.parity`` compare the trainer, under
every backend and layout, with this module. It shares **no runtime code** with the
trainer: the decoder (``llama3`` and ``qwen3``) is written here from its math, on a
flat dict of full tensors, with no module of :mod:`torchtitan_spmd.models` or
:mod:`torchtitan_spmd.distributed`; the optimizer is ``torch.optim.AdamW``; the
learning rate is the schedule's closed form; the gradient norm and clipping are
written out; the loss is ``F.cross_entropy`` over the whole global batch. By
default it computes in float64, so what it measures is the trainer's own error.

What it takes from the project, and only as data:

- the initial weights: the full tensors the family's ``initial_value`` defines
  (:func:`initial_weights`), the same ones every rank of a real run copies its
  shards of; or, when the run starts from ``checkpoint.initial_load_path`` (a seed
  checkpoint), that checkpoint's model entries, read with ``torch.distributed.checkpoint``
  on this one process (:func:`checkpoint_weights`);
- the global batches: the single-process data loader's batches (the data-parallel
  split the trainer does is what the comparison checks), each checked to be
  next-token pairs (:func:`global_batches`).

DeepSeek-V3 (``deepseek_v3``) is restated from its math too: multi-head latent attention
(:func:`_latent_attention`: the low-rank projections and norms, the shared rope key, scores as
the sum of the no-rope and rope parts' products, the YaRN frequencies of :func:`_yarn_inv_freq`
and its softmax scale), group-limited routing (:func:`_moe`: groups ranked by the sum of their
two best biased scores, experts outside the best ``topk_group`` groups never chosen), shared
experts, and the first ``first_k_dense_replace`` blocks dense.

Mixture-of-experts layers (qwen3's MoE flavours) are restated densely (:func:`_moe`): every
expert on every token, weighted by a gate matrix that is zero off each token's chosen
experts; the choice by pairwise comparison (:func:`_choose_experts`), not a sort; the expert
biases updated after each step from the global batch's counts.

Pure parts (:func:`forward`, :func:`lr_factor`, :func:`train`) import torch only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig

__all__ = [
    "ADAMW_BETAS",
    "ARCHITECTURES",
    "Architecture",
    "BIAS",
    "MLAArchitecture",
    "MoEArchitecture",
    "ReferenceTrace",
    "checkpoint_weights",
    "forward",
    "global_batches",
    "initial_weights",
    "lr_factor",
    "run_reference",
    "train",
]

#: The name ending of a layer's MoE expert bias (state: in the weights, not trained).
BIAS = "moe.expert_bias"

#: AdamW's betas, as torchtitan configures them (the config has no field for them).
ADAMW_BETAS: tuple[float, float] = (0.9, 0.95)


@dataclass(frozen=True)
class Architecture:
    """What sets a family apart, as numbers and two switches."""

    rope: Literal["interleaved", "half"]
    """RoPE pairs: ``(x[2i], x[2i+1])`` (Llama) or ``(x[i], x[i + d/2])`` (Qwen, rotate-half)."""

    qk_norm: bool
    """Per-head RMSNorm of queries and keys before RoPE (Qwen3)."""

    head_dim: int
    norm_eps: float
    rope_theta: float
    moe: MoEArchitecture | None = None
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    """The RoPE scaling's fields as ``(name, value)`` pairs (empty or ``kind="none"``: none); restated
    by :func:`_frequencies`."""
    """Mixture-of-experts feed-forwards (None: dense)."""
    mla: MLAArchitecture | None = None
    """Multi-head latent attention (DeepSeek-V3) instead of grouped-query attention."""
    dense_layers: int = 0
    """The first this many blocks are dense even with ``moe`` (DeepSeek's ``first_k_dense_replace``)."""
    tied: bool = False
    """Tied embeddings (``enable_weight_tying``): there is no ``output.weight``; the logits are the
    final hidden states times the embedding table's transpose, so its gradient has both parts."""
    document_eos: int | None = None
    """Packed documents (``attn_mask_type="block_causal"``): the EOS id that ends each document.
    A token then attends only to the earlier tokens of its own document, its RoPE position is
    its index in that document, and an EOS token's label (the next document's first token) is
    not trained. None: one causal sequence per window."""


@dataclass(frozen=True)
class MLAArchitecture:
    """The numbers of DeepSeek-V3's multi-head latent attention (see :func:`_latent_attention`)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    yarn: tuple[float, int, float, float, float] | None
    """``(factor, original_seq_len, beta_fast, beta_slow, mscale)``, or None: plain RoPE."""


@dataclass(frozen=True)
class MoEArchitecture:
    """The numbers and switches of a mixture-of-experts feed-forward (see :func:`_moe`)."""

    num_experts: int
    top_k: int
    score_func: Literal["softmax", "sigmoid"]
    route_norm: bool
    route_scale: float
    load_balance_coeff: float | None
    force_load_balance: bool = False
    n_group: int = 1
    topk_group: int = 1
    shared_experts: bool = False


#: Family name -> (RoPE pairing, QK norm). The numbers come from the family's flavour.
ARCHITECTURES: dict[str, tuple[Literal["interleaved", "half"], bool]] = {
    "llama3": ("interleaved", False),
    "deepseek_v3": ("interleaved", False),
    "qwen3": ("half", True),
}


# ----------------------------------------------------------------------------- the model
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _frequencies(d: int, theta: float, scaling: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """The ``d/2`` angular frequencies and the factor on ``cos``/``sin``, one frequency at a time.

    ``llama`` (Llama 3.1): a wavelength ``2 pi / f`` longer than ``ctx / low_freq_factor`` is slowed
    ``factor`` times, one shorter than ``ctx / high_freq_factor`` kept, in between
    ``f * ((1 - a) / factor + a)`` with ``a = (ctx / wavelength - low) / (high - low)``.
    ``yarn``: dimension ``i`` of the ``d/2`` keeps ``f`` below the dimension that turns
    ``beta_fast`` times over ``ctx``, is slowed ``factor`` times above the one that turns ``beta_slow``
    times, linearly in between; ``cos``/``sin`` carry ``0.1 ln(factor) + 1`` (or the ratio with
    ``mscale``/``mscale_all_dim``, or ``attention_factor``).
    """
    kind = scaling.get("kind", "none")
    out, gain = [], 1.0
    for i in range(d // 2):
        f = theta ** (-2.0 * i / d)
        if kind == "llama":
            ctx, factor = scaling["original_max_position_embeddings"], scaling["factor"]
            lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
            wavelength = 2 * math.pi / f
            if wavelength > ctx / lo:
                f = f / factor
            elif wavelength >= ctx / hi:
                a = (ctx / wavelength - lo) / (hi - lo)
                f = f * ((1 - a) / factor + a)
        elif kind == "yarn":
            ctx, factor = scaling["original_max_position_embeddings"], scaling["factor"]

            low, high = (d * math.log(ctx / (scaling[b] * 2 * math.pi)) / (2 * math.log(theta))
                         for b in ("beta_fast", "beta_slow"))  # the dimensions turning beta times over ctx
            if scaling["truncate"]:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, d - 1)
            high = high + 0.001 if high == low else high
            slowed = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: f kept, 1: f / factor
            f = f * (1 - slowed) + f / factor * slowed
        out.append(f)
    if kind == "yarn":
        factor = scaling["factor"]

        def m(scale: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

        if scaling["attention_factor"] is not None:
            gain = scaling["attention_factor"]
        elif scaling["mscale"] and scaling["mscale_all_dim"]:
            gain = m(scaling["mscale"]) / m(scaling["mscale_all_dim"])
        else:
            gain = m(1.0)
    return torch.tensor(out, dtype=torch.float64), gain


def _rope(x: torch.Tensor, theta: float, style: str, scaling: Mapping[str, Any] | None = None,
          freq: torch.Tensor | None = None, position: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``x`` ``[batch, seq, heads, d]``: pair ``i`` of position ``p`` by ``p * f_i``
    (:func:`_frequencies`: ``theta**(-2i/d)`` unless scaled), the result times the scaling's gain;
    or by ``p * freq[i]`` when the frequencies are given (DeepSeek's MLA restates its own YaRN).
    ``p`` is the token's index in the window, or ``position[b, s]`` when given (packed documents)."""
    seq, d = x.shape[1], x.shape[3]
    if freq is None:
        freq, gain = _frequencies(d, theta, scaling or {})
    else:
        gain = 1.0
    p = torch.arange(seq, dtype=torch.float64)[None, :] if position is None else position.to(torch.float64)
    angle = p[..., None] * freq  # [batch or 1, seq, d/2]
    cos = (gain * angle.cos()).to(x.dtype)[:, :, None, :]
    sin = (gain * angle.sin()).to(x.dtype)[:, :, None, :]
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def _documents(tokens: torch.Tensor, eos: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Who may attend to whom, ``[batch, 1, seq(query), seq(key)]`` (True: masked out), and each
    token's RoPE position ``[batch, seq]`` (None: its index in the window).

    Without ``eos``: a key after its query is masked. With it (packed documents): token ``i`` is
    in document ``n`` when ``n`` EOS tokens come before it; a key is masked unless it is in the
    query's document and not after it, and a token's position counts the earlier tokens of its
    document.
    """
    seq = tokens.shape[1]
    later = torch.ones(seq, seq, dtype=torch.bool).triu(1)  # [query, key]: the key comes after
    if eos is None:
        return later[None, None], None
    ends = (tokens == eos).long()
    document = ends.cumsum(1) - ends  # EOS tokens strictly before each token
    same = document[:, :, None] == document[:, None, :]  # [batch, query, key]
    earlier = ~later & ~torch.eye(seq, dtype=torch.bool)
    position = (same & earlier[None]).sum(-1)
    return (~same | later[None])[:, None], position


def _attention(x: torch.Tensor, w: Mapping[str, torch.Tensor], prefix: str, arch: Architecture,
               masked: torch.Tensor, position: torch.Tensor | None) -> torch.Tensor:
    bsz, seq, _ = x.shape
    d = arch.head_dim
    q = (x @ w[prefix + "wq.weight"].T).view(bsz, seq, -1, d)
    k = (x @ w[prefix + "wk.weight"].T).view(bsz, seq, -1, d)
    v = (x @ w[prefix + "wv.weight"].T).view(bsz, seq, -1, d)
    if arch.qk_norm:
        q = _rms_norm(q, w[prefix + "q_norm.weight"], arch.norm_eps)
        k = _rms_norm(k, w[prefix + "k_norm.weight"], arch.norm_eps)
    scaling = dict(arch.rope_scaling)
    q = _rope(q, arch.rope_theta, arch.rope, scaling, position=position)
    k = _rope(k, arch.rope_theta, arch.rope, scaling, position=position)
    group = q.shape[2] // k.shape[2]  # query head h reads key/value head h // group
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    probs = scores.masked_fill(masked, float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(bsz, seq, -1)
    return out @ w[prefix + "wo.weight"].T


def _yarn_inv_freq(d: int, theta: float, yarn: tuple[float, int, float, float, float]) -> torch.Tensor:
    """YaRN's RoPE frequencies: pair ``i``'s ``theta**(-2i/d)`` kept where its wavelength fits
    ``original_seq_len`` more than ``beta_fast`` times, divided by ``factor`` where it fits fewer
    than ``beta_slow`` times, linearly between (the range's ends floored/ceiled into ``[0, d-1]``)."""
    factor, original, beta_fast, beta_slow, _ = yarn
    i = torch.arange(d // 2, dtype=torch.float64)
    freq = theta ** (-2.0 * i / d)

    def pair_where(turns: float) -> float:  # the (real) pair index whose wavelength fits ``turns`` times
        return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = max(math.floor(pair_where(beta_fast)), 0), min(math.ceil(pair_where(beta_slow)), d - 1)
    blend = ((i - lo) / ((hi - lo) if hi != lo else 0.001)).clamp(0.0, 1.0)  # 0: extrapolate, 1: interpolate
    return freq * (1.0 - blend) + (freq / factor) * blend


def _latent_attention(x: torch.Tensor, w: Mapping[str, torch.Tensor], prefix: str,
                      arch: Architecture, masked: torch.Tensor, position: torch.Tensor | None) -> torch.Tensor:
    """DeepSeek-V3's multi-head latent attention on ``x`` ``[batch, seq, dim]``, causal.

    ``q = wq x`` (or ``wq_b rms(wq_a x)``), per head ``[q_nope, q_rope]``; ``wkv_a x = [c, k_rope]``
    with one ``k_rope`` for every head; ``wkv_b rms(c)`` = per head ``[k_nope, v]``; score
    ``(q_nope . k_nope + rope(q_rope) . rope(k_rope)) * scale``, ``scale = (nope + rope)**-0.5``
    times ``(0.1 * mscale * ln(factor) + 1)**2`` under YaRN.
    """
    m = arch.mla
    assert m is not None
    bsz, seq, _ = x.shape
    nope, rope_d = m.qk_nope_head_dim, m.qk_rope_head_dim
    if prefix + "wq.weight" in w:
        q = x @ w[prefix + "wq.weight"].T
    else:
        q = _rms_norm(x @ w[prefix + "wq_a.weight"].T, w[prefix + "q_norm.weight"], arch.norm_eps) @ w[prefix + "wq_b.weight"].T
    q = q.view(bsz, seq, -1, nope + rope_d)
    compressed = x @ w[prefix + "wkv_a.weight"].T
    latent, k_rope = compressed[..., : m.kv_lora_rank], compressed[..., m.kv_lora_rank:]
    kv = (_rms_norm(latent, w[prefix + "kv_norm.weight"], arch.norm_eps) @ w[prefix + "wkv_b.weight"].T)
    kv = kv.view(bsz, seq, -1, nope + m.v_head_dim)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    freq = None if m.yarn is None else _yarn_inv_freq(rope_d, arch.rope_theta, m.yarn)
    q_rope = _rope(q[..., nope:], arch.rope_theta, "interleaved", freq=freq, position=position)
    k_rope = _rope(k_rope[:, :, None, :], arch.rope_theta, "interleaved", freq=freq, position=position)[:, :, 0, :]
    scale = (nope + rope_d) ** -0.5
    if m.yarn is not None and m.yarn[0] > 1 and m.yarn[4]:
        scale *= (0.1 * m.yarn[4] * math.log(m.yarn[0]) + 1.0) ** 2
    scores = (torch.einsum("bqhd,bkhd->bhqk", q[..., :nope], k_nope)
              + torch.einsum("bqhd,bkd->bhqk", q_rope, k_rope)) * scale
    probs = scores.masked_fill(masked, float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(bsz, seq, -1)
    return out @ w[prefix + "wo.weight"].T


def _choose_experts(key: torch.Tensor, k: int) -> torch.Tensor:
    """``[T, E]`` bool: expert ``e`` is one of token ``t``'s ``k`` choices when fewer than ``k``
    experts rank above it; ``j`` ranks above ``e`` with a larger key, or an equal key and a
    lower index (ties go to the lower expert index)."""
    idx = torch.arange(key.shape[-1])
    ki, kj = key[:, :, None], key[:, None, :]  # [T, e, 1] against [T, 1, j]
    above = (kj > ki) | ((kj == ki) & (idx[None, None, :] < idx[None, :, None]))
    return above.sum(-1) < k


def _moe(x: torch.Tensor, w: Mapping[str, torch.Tensor], prefix: str, moe: MoEArchitecture,
         bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixture of experts on ``x`` ``[batch, seq, dim]``, and the tokens each expert got ``[E]``.

    Written densely: every expert runs on every token, and each output is the sum over the
    experts of the token's gate (zero for experts it did not choose) times the expert's output.
    Scores: ``softmax`` (``exp(l - max) / sum``) or ``sigmoid`` of the router's logits; choice:
    the ``top_k`` largest of ``scores + bias`` (:func:`_choose_experts`), or round-robin
    ``(t * top_k + j) % E`` when forced; gates: the chosen scores, normalised to sum 1 with
    ``route_norm``, times ``route_scale``.
    """
    bsz, seq, dim = x.shape
    xt = x.reshape(bsz * seq, dim)
    logits = xt @ w[prefix + "router.gate.weight"].T
    if moe.score_func == "softmax":
        e = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
        scores = e / e.sum(dim=-1, keepdim=True)
    else:
        scores = 1.0 / (1.0 + torch.exp(-logits))
    n_tokens, n_experts = scores.shape
    if moe.force_load_balance:
        chosen = torch.zeros(n_tokens, n_experts, dtype=torch.bool)
        for t in range(n_tokens):
            for j in range(moe.top_k):
                chosen[t, (t * moe.top_k + j) % n_experts] = True
    else:
        key = scores.detach() if bias is None else scores.detach() + bias
        if moe.n_group > 1:  # only the experts of the topk_group best groups are eligible
            per = n_experts // moe.n_group
            best_two = key.view(n_tokens, moe.n_group, per).topk(min(2, per), dim=-1).values.sum(-1)
            eligible = _choose_experts(best_two, moe.topk_group).repeat_interleave(per, dim=1)
            key = torch.where(eligible, key, torch.full_like(key, float("-inf")))
        chosen = _choose_experts(key, moe.top_k)
    gates = torch.where(chosen, scores, torch.zeros_like(scores))
    if moe.route_norm:
        gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
    gates = gates * moe.route_scale
    w1, w2, w3 = (w[prefix + f"experts.{n}"] for n in ("w1", "w2", "w3"))
    out = torch.zeros_like(xt)
    for ex in range(n_experts):
        y = (F.silu(xt @ w1[ex].T) * (xt @ w3[ex].T)) @ w2[ex].T
        out = out + gates[:, ex : ex + 1] * y
    if moe.shared_experts:
        s1, s2, s3 = (w[prefix + f"shared_experts.{n}"] for n in ("w1", "w2", "w3"))
        out = out + (F.silu(xt @ s1.T) * (xt @ s3.T)) @ s2.T
    return out.view(bsz, seq, dim), chosen.sum(dim=0)


def _layer_count(weights: Mapping[str, torch.Tensor]) -> int:
    return len({name.split(".")[1] for name in weights if name.startswith("layers.")})


def _expected_names(n_layers: int, qk_norm: bool, moe: MoEArchitecture | None = None,
                    mla: MLAArchitecture | None = None, dense_layers: int = 0, q_lora: bool = False,
                    tied: bool = False) -> set[str]:
    names = {"tok_embeddings.weight", "norm.weight"} | (set() if tied else {"output.weight"})
    if mla is None:
        attention = [f"attention.{m}.weight" for m in "wq wk wv wo".split()]
    else:
        attention = [f"attention.{m}.weight" for m in ("wkv_a", "kv_norm", "wkv_b", "wo")]
        attention += [f"attention.{m}.weight" for m in (("wq_a", "q_norm", "wq_b") if q_lora else ("wq",))]
    common = ["attention_norm.weight", "ffn_norm.weight", *attention]
    dense = [f"feed_forward.{m}.weight" for m in ("w1", "w2", "w3")]
    sparse = []
    if moe is not None:
        sparse = ["moe.router.gate.weight", "moe.experts.w1", "moe.experts.w2", "moe.experts.w3"]
        if moe.load_balance_coeff is not None:
            sparse.append(BIAS)
        if moe.shared_experts:
            sparse += [f"moe.shared_experts.{m}" for m in ("w1", "w2", "w3")]
    if qk_norm:
        common += ["attention.q_norm.weight", "attention.k_norm.weight"]
    return names | {f"layers.{i}.{p}" for i in range(n_layers)
                    for p in common + (sparse if moe is not None and i >= dense_layers else dense)}


def _check_names(weights: Mapping[str, torch.Tensor], arch: Architecture) -> int:
    n_layers = _layer_count(weights)
    q_lora = arch.mla is not None and "layers.0.attention.wq_a.weight" in weights
    expected = _expected_names(n_layers, arch.qk_norm, arch.moe, arch.mla, arch.dense_layers, q_lora, arch.tied)
    if set(weights) != expected:
        raise ValueError(f"reference: the weights do not match the architecture: missing "
                         f"{sorted(expected - set(weights))}, unexpected {sorted(set(weights) - expected)}.")
    return n_layers


def forward(weights: Mapping[str, torch.Tensor], tokens: torch.Tensor, arch: Architecture,
            expert_counts: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Logits ``[batch, seq, vocab]`` of the pre-norm decoder for int64 ``tokens`` ``[batch, seq]``.

    ``h = x + attn(rms(x)); x' = h + w2(silu(w1 rms(h)) * w3 rms(h))``, causal softmax attention
    with grouped key/value heads, RoPE on queries and keys, a final RMSNorm and the output matrix.
    With ``arch.moe`` the feed-forward is :func:`_moe` (its bias: ``weights``' ``moe.expert_bias``),
    and each layer's tokens per expert are appended to ``expert_counts`` when given.
    """
    n_layers = _check_names(weights, arch)
    masked, position = _documents(tokens, arch.document_eos)
    h = weights["tok_embeddings.weight"][tokens]
    for i in range(n_layers):
        p = f"layers.{i}."
        attend = _attention if arch.mla is None else _latent_attention
        h = h + attend(_rms_norm(h, weights[p + "attention_norm.weight"], arch.norm_eps), weights,
                       p + "attention.", arch, masked, position)
        x = _rms_norm(h, weights[p + "ffn_norm.weight"], arch.norm_eps)
        if arch.moe is not None and i >= arch.dense_layers:
            out, counts = _moe(x, weights, p + "moe.", arch.moe, weights.get(p + BIAS))
            h = h + out
            if expert_counts is not None:
                expert_counts.append(counts)
            continue
        gate = F.silu(x @ weights[p + "feed_forward.w1.weight"].T) * (x @ weights[p + "feed_forward.w3.weight"].T)
        h = h + gate @ weights[p + "feed_forward.w2.weight"].T
    out = weights["tok_embeddings.weight" if arch.tied else "output.weight"]
    return _rms_norm(h, weights["norm.weight"], arch.norm_eps) @ out.T


# ----------------------------------------------------------------------------- training
@dataclass
class ReferenceTrace:
    """What :func:`train` also records when given one (filled in place), for per-tensor parity checks."""

    grad_norms: dict[str, float] = field(default_factory=dict)
    """Each parameter's gradient norm at the first step, before clipping, by name."""
    tokens_per_expert: list[list[list[int]]] = field(default_factory=list)
    """Per step, per MoE layer: the tokens (token, choice pairs) each expert got from the global batch."""
    expert_bias: list[dict[str, list[float]]] = field(default_factory=list)
    """Per step: every MoE layer's expert bias after that step's update, by name."""


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_factor: float,
              decay_ratio: float | None = None, decay_type: str = "linear") -> float:
    """The learning rate of 0-based step ``step`` over ``optimizer.lr``, in closed form
    (upstream's warmup-stable-decay, restated).

    With ``W = min(warmup_steps, total_steps)`` and ``D`` the decay's length (``round(total *
    decay_ratio)`` capped at ``total - W``, or ``total - W``): steps ``0 .. W-1`` ramp as
    ``(step + 1) / W``; the decay's ``D`` steps are the last ``D`` of ``total + 1`` (one virtual
    step past the end), each at progress ``(step + 1 - (total + 1 - D)) / D``, between them
    the factor is 1.
    """
    w = min(warmup_steps, total_steps)
    d = total_steps - w if decay_ratio is None else min(round(total_steps * decay_ratio), total_steps - w)
    if step < w:
        return (step + 1) / w
    decay_begins = total_steps + 1 - d  # the first 0-based step of the decay
    if step < decay_begins:
        return 1.0
    p = (step + 1 - decay_begins) / d
    shape = {"linear": 1.0 - p, "sqrt": 1.0 - math.sqrt(p), "cosine": (1.0 + math.cos(math.pi * p)) / 2.0}
    return min_lr_factor + (1.0 - min_lr_factor) * shape[decay_type]


def train(weights: Mapping[str, torch.Tensor], batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
          arch: Architecture, *, lr: float, eps: float, weight_decay: float, betas: tuple[float, float],
          warmup_steps: int, total_steps: int, min_lr_factor: float, max_norm: float,
          dtype: torch.dtype = torch.float64, trace: ReferenceTrace | None = None,
          decay_ratio: float | None = None, decay_type: str = "linear") -> list[tuple[float, float]]:
    """Train a copy of ``weights`` on ``batches``; per step ``(mean loss, gradient norm before clipping)``.

    ``torch.optim.AdamW`` (the single-tensor implementation) over every tensor, the
    learning rate set each step from :func:`lr_factor`, and gradients scaled by
    ``min(1, max_norm / (norm + 1e-6))`` when ``max_norm > 0``. The MoE expert biases are
    state, not parameters: after each optimizer step, each moves by
    ``coeff * sign(mean(counts) - counts)`` minus that step's mean, from the tokens per
    expert of the whole global batch. ``trace``: also record the first step's per-parameter
    gradient norms and each step's tokens per expert and expert biases there.
    """
    params = {name: t.detach().to(dtype=dtype, device="cpu").clone().requires_grad_(not name.endswith(BIAS))
              for name, t in weights.items()}
    opt = torch.optim.AdamW([p for p in params.values() if p.requires_grad], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            foreach=False)
    records = []
    for step, (tokens, labels) in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = lr * lr_factor(step, warmup_steps=warmup_steps, total_steps=total_steps,
                                         min_lr_factor=min_lr_factor, decay_ratio=decay_ratio,
                                         decay_type=decay_type)
        counts: list[torch.Tensor] = []
        logits = forward(params, tokens, arch, counts)
        if arch.document_eos is not None:  # no prediction across a document boundary (upstream #4075)
            labels = torch.where(tokens == arch.document_eos, torch.full_like(labels, -100), labels)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        loss.backward()
        grads = [p.grad for p in params.values() if p.grad is not None]
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        if trace is not None and step == 0:
            trace.grad_norms = {name: float(p.grad.norm()) for name, p in params.items() if p.grad is not None}
        if max_norm > 0:
            scale = min(1.0, max_norm / (float(norm) + 1e-6))
            for g in grads:
                g.mul_(scale)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if arch.moe is not None and arch.moe.load_balance_coeff is not None:
            moe_layers = sorted(int(n.split(".")[1]) for n in params if n.endswith(BIAS))
            for i, count in zip(moe_layers, counts, strict=True):
                c = count.to(dtype)
                step_e = arch.moe.load_balance_coeff * torch.sign(c.mean() - c)
                with torch.no_grad():
                    params[f"layers.{i}.{BIAS}"] += step_e - step_e.mean()
        if trace is not None and arch.moe is not None:
            trace.tokens_per_expert.append([[int(c) for c in count] for count in counts])
            trace.expert_bias.append({name: [float(v) for v in t] for name, t in params.items()
                                      if name.endswith(BIAS)})
        records.append((float(loss.detach()), float(norm)))
    return records


# ----------------------------------------------------------------------------- inputs (data)
def initial_weights(model_name: str, flavor: str, seed: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """The full initial weights of ``model_name``/``flavor`` under ``seed``, by the trainer's names.

    The family's ``initial_value`` defines them (every rank of a run copies its shards of
    these); this is the only thing the reference reads from the model package.
    """
    from torchtitan_spmd.models import get_model_spec

    model = get_model_spec(model_name).build_initialized(flavor, seed=seed, vocab_size=vocab_size)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def checkpoint_weights(path: str, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model entries of the DCP checkpoint at ``path``, shaped and named as ``like``.

    Read with ``torch.distributed.checkpoint.load`` on this one process (no process group):
    DCP assembles each full tensor from whatever layout the checkpoint was saved in.

    Raises:
        ValueError: ``path`` is not a DCP checkpoint, or lacks one of ``like``'s names.
    """
    import os

    import torch.distributed.checkpoint as dcp

    # not numerics: the reader that runs none of the checkpoint author's code
    from torchtitan_spmd.checkpoint.safe_metadata import (
        RefusedCheckpointData,
        RestrictedLoadPlanner,
        RestrictedReader,
    )

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ValueError(f"reference: checkpoint.initial_load_path={path!r} is not a DCP checkpoint "
                         "(no .metadata file in it).")
    state = {name: torch.empty_like(t) for name, t in like.items()}
    try:
        RestrictedReader(path).read_metadata()  # a refusal here, before DCP's own read (which retries)
        dcp.load(state, storage_reader=RestrictedReader(path), planner=RestrictedLoadPlanner(), no_dist=True)
    except RefusedCheckpointData as err:
        raise ValueError(f"reference: checkpoint.initial_load_path={path!r}: {err}") from None
    except Exception as err:  # DCP wraps a missing key or a bad shape in its own CheckpointException
        raise ValueError(f"reference: could not read the model from checkpoint.initial_load_path={path!r}: "
                         f"{err}") from err
    return state


def global_batches(job_config: JobConfig, global_batch: int, seed: int,
                   tokenizer: Any = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``training.steps`` global batches of ``global_batch`` sequences, from the single-process loader
    (``dataloader.dataset``, tokenised with ``tokenizer`` for a file dataset).

    Each must be a next-token pair (``labels[:, :-1] == inputs[:, 1:]``).
    """
    from torchtitan_spmd.data import build_dataloader

    training = job_config.training
    loader = build_dataloader(dp_rank=0, dp_degree=1, local_batch_size=global_batch, seq_len=training.seq_len,
                              seed=seed, dataset=job_config.dataloader.dataset, dataset_path=job_config.dataloader.dataset_path,
                              tokenizer=tokenizer)
    batches = [next(loader) for _ in range(training.steps)]
    for step, (tokens, labels) in enumerate(batches, 1):
        if tokens.shape != (global_batch, training.seq_len) or not torch.equal(labels[:, :-1], tokens[:, 1:]):
            raise ValueError(f"reference: the data loader's batch {step} is not {global_batch} next-token "
                             f"pairs of {training.seq_len} tokens.")
    return batches


def architecture(job_config: JobConfig, model_config: Any) -> Architecture:
    """The :class:`Architecture` of ``job_config``'s family, its numbers read from ``model_config``."""
    name = job_config.model.name
    if name not in ARCHITECTURES:
        raise ValueError(f"reference: no reference for model.name={name!r}; it restates "
                         f"{', '.join(map(repr, ARCHITECTURES))}.")
    rope, qk_norm = ARCHITECTURES[name]
    moe = None
    c = model_config
    if int(getattr(c, "num_experts", 0)) > 0:
        coeff = c.load_balance_coeff
        moe = MoEArchitecture(num_experts=int(c.num_experts), top_k=int(c.top_k), score_func=c.score_func,
                              route_norm=bool(c.route_norm), route_scale=float(c.route_scale),
                              load_balance_coeff=None if coeff is None else float(coeff),
                              force_load_balance=bool(job_config.debug.moe_force_load_balance),
                              n_group=int(getattr(c, "n_group", 1)), topk_group=int(getattr(c, "topk_group", 1)),
                              shared_experts=int(getattr(c, "n_shared_experts", 0)) > 0)
    mla = None
    if name == "deepseek_v3":
        s = c.rope_scaling  # read as numbers; DeepSeek's YaRN has mscale == mscale_all_dim (cos/sin unscaled)
        if s.kind not in ("none", "yarn") or (s.kind == "yarn" and (s.mscale != s.mscale_all_dim or s.attention_factor)):
            raise ValueError(f"reference: deepseek_v3 restates YaRN with mscale == mscale_all_dim only, got {s!r}.")
        yarn = ((float(s.factor), int(s.original_max_position_embeddings), float(s.beta_fast), float(s.beta_slow),
                 float(s.mscale_all_dim or 0.0)) if s.kind == "yarn" else None)
        mla = MLAArchitecture(kv_lora_rank=int(c.kv_lora_rank), qk_nope_head_dim=int(c.qk_nope_head_dim),
                              qk_rope_head_dim=int(c.qk_rope_head_dim), v_head_dim=int(c.v_head_dim), yarn=yarn)
    return Architecture(rope=rope, qk_norm=qk_norm, head_dim=int(c.head_dim), norm_eps=float(c.norm_eps),
                        rope_theta=float(c.rope_theta), moe=moe, mla=mla,
                        dense_layers=int(getattr(c, "first_k_dense_replace", 0)),
                        rope_scaling=() if mla is not None else _scaling_fields(c),
                        tied=bool(getattr(c, "enable_weight_tying", False)))


def _scaling_fields(model_config: Any) -> tuple[tuple[str, Any], ...]:
    """The model config's ``rope_scaling`` as plain ``(name, value)`` pairs (its numbers only)."""
    scaling = getattr(model_config, "rope_scaling", None)
    if scaling is None:
        return ()
    return tuple((f.name, getattr(scaling, f.name)) for f in dataclasses.fields(scaling))


def run_reference(job_config: JobConfig, *, global_batch: int,
                  dtype: torch.dtype = torch.float64, trace: ReferenceTrace | None = None) -> list[tuple[float, float]]:
    """Per-step ``(loss, grad_norm)`` of ``job_config`` on one process, by this module's math
    (``trace``: see :func:`train`).

    ``global_batch``: sequences per step over all data-parallel ranks (``local_batch_size``
    times the data-parallel degree of the run it is compared with).
    """
    from torchtitan_spmd.data import build_tokenizer
    from torchtitan_spmd.models import get_model_spec

    cfg = job_config
    seed = cfg.debug.seed if cfg.debug.seed is not None else 0
    tokenizer = build_tokenizer(cfg.hf_assets_path)
    vocab = tokenizer.model_vocab_size
    model_config = get_model_spec(cfg.model.name).model_config(cfg.model.flavor, vocab_size=vocab)
    opt = cfg.optimizer
    betas = (float(getattr(opt, "beta1", ADAMW_BETAS[0])), float(getattr(opt, "beta2", ADAMW_BETAS[1])))
    weights = initial_weights(cfg.model.name, cfg.model.flavor, seed, vocab)
    if cfg.checkpoint.enable and cfg.checkpoint.initial_load_path:
        weights = checkpoint_weights(cfg.checkpoint.initial_load_path, weights)
    arch = architecture(cfg, model_config)
    if getattr(model_config, "attn_mask_type", "causal") == "block_causal":
        arch = dataclasses.replace(arch, document_eos=int(tokenizer.eos_id))
    return train(
        weights, global_batches(cfg, global_batch, seed, tokenizer),
        arch, lr=opt.lr, eps=opt.eps, weight_decay=opt.weight_decay, betas=betas,
        warmup_steps=cfg.lr_scheduler.warmup_steps,
        total_steps=cfg.lr_scheduler.total_steps if cfg.lr_scheduler.total_steps is not None else cfg.training.steps,
        min_lr_factor=cfg.lr_scheduler.min_lr_factor, max_norm=float(cfg.training.max_norm), dtype=dtype,
        trace=trace,
        decay_ratio=cfg.lr_scheduler.decay_ratio, decay_type=cfg.lr_scheduler.decay_type,
    )
