"""Rotary position embeddings: the frequencies, their scaling, and the ``cos``/``sin`` tables.

One place for every family (llama3, qwen3, and any later one such as DeepSeek-V3). The
scaling kinds are upstream's (``models/common/rope.py`` at a0c831c49): ``none``, ``llama``
(Llama 3.1's frequency-band scaling) and ``yarn`` (NTK-by-parts with its attention factor).
The numbers follow transformers' ``modeling_rope_utils`` (``_compute_llama3_parameters``,
``_compute_yarn_parameters``), which judges the Hugging Face checkpoints this library
loads; the tests compare the frequencies with transformers' own rotary embedding.

API (stable; other families build on it):

- :class:`RopeScaling`: a frozen dataclass, the scaling of one model (``kind`` and its numbers);
- :func:`rope_inv_freq`: the ``head_dim // 2`` inverse frequencies (float64) under a scaling;
- :func:`rope_attention_factor`: the factor transformers multiplies ``cos`` and ``sin`` by
  (YaRN's ``0.1 ln(factor) + 1`` or ``mscale / mscale_all_dim``; 1 otherwise);
- :func:`yarn_mscale`: YaRN's ``0.1 * mscale * ln(factor) + 1`` (DeepSeek-V3 also scales its
  softmax by ``yarn_mscale(factor, mscale_all_dim) ** 2``; that is the model's business);
- :func:`precompute_rope`: ``(cos, sin)`` float32 tables ``[max_seq_len, head_dim // 2]``,
  already multiplied by the attention factor (as transformers does);
- :func:`rope_scaling_from_hf` / :func:`rope_scaling_to_hf`: read and write a transformers
  config's ``rope_parameters`` (transformers 5) or ``rope_scaling`` (older) dict.

Differences from upstream, all following transformers: YaRN applies whatever the sequence
length (upstream's complex RoPE applies it only when ``max_seq_len`` exceeds the original
context), and the attention factor is folded into ``cos``/``sin`` for every pairing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

__all__ = [
    "NO_SCALING",
    "RopeKind",
    "RopeScaling",
    "precompute_rope",
    "rope_attention_factor",
    "rope_inv_freq",
    "rope_scaling_from_hf",
    "rope_scaling_to_hf",
    "yarn_mscale",
]

RopeKind = Literal["none", "llama", "yarn"]

#: transformers' ``rope_type`` -> our kind.
_HF_KINDS: dict[str, RopeKind] = {"default": "none", "llama3": "llama", "yarn": "yarn"}


@dataclass(frozen=True)
class RopeScaling:
    """How the RoPE frequencies are scaled (``kind="none"``: not at all).

    Attributes:
        kind: ``"none"``, ``"llama"`` (Llama 3.1) or ``"yarn"``.
        factor: how many times the context is extended (llama, yarn).
        original_max_position_embeddings: the pre-training context (llama, yarn).
        low_freq_factor, high_freq_factor: llama's band edges: wavelengths above
            ``original / low_freq_factor`` are divided by ``factor``, those below
            ``original / high_freq_factor`` kept, the ones between interpolated smoothly.
        beta_fast, beta_slow: yarn's ramp bounds, in rotations over the original context.
        mscale, mscale_all_dim: yarn's attention-factor numerator and denominator scales
            (DeepSeek-V3's config); when both are set the factor is their ratio.
        attention_factor: yarn's factor on ``cos``/``sin``, if given explicitly.
        truncate: yarn: round the ramp bounds to whole dimensions (transformers' default).
    """

    kind: RopeKind = "none"
    factor: float = 1.0
    original_max_position_embeddings: int = 8192
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("none", "llama", "yarn"):
            raise ValueError(f"RopeScaling.kind={self.kind!r} is not one of 'none', 'llama', 'yarn'.")
        if self.kind == "none":
            return
        if not (isinstance(self.factor, int | float) and self.factor > 0):
            raise ValueError(f"RopeScaling.factor must be > 0 for kind={self.kind!r}, got {self.factor!r}.")
        ctx = self.original_max_position_embeddings
        if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 1:
            raise ValueError(f"RopeScaling.original_max_position_embeddings must be a positive int, got {ctx!r}.")
        if self.kind == "llama" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"RopeScaling: llama scaling needs 0 < low_freq_factor < high_freq_factor, got "
                             f"low_freq_factor={self.low_freq_factor!r}, high_freq_factor={self.high_freq_factor!r}.")
        if self.kind == "yarn" and not 0 < self.beta_slow < self.beta_fast:
            raise ValueError(f"RopeScaling: yarn scaling needs 0 < beta_slow < beta_fast, got "
                             f"beta_slow={self.beta_slow!r}, beta_fast={self.beta_fast!r}.")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"RopeScaling.attention_factor must be > 0 or None, got {self.attention_factor!r}.")


#: No scaling: plain RoPE.
NO_SCALING = RopeScaling()


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: RopeScaling) -> float:
    """The factor on ``cos`` and ``sin`` (so ``factor**2`` on the attention logits): YaRN's, else 1."""
    if scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """The ``head_dim // 2`` inverse frequencies ``theta ** (-2i / head_dim)`` under ``scaling``, float64 on CPU."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    s = scaling or NO_SCALING
    if s.kind == "llama":
        ctx = s.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen, high_freq_wavelen = ctx / s.low_freq_factor, ctx / s.high_freq_factor
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    if s.kind == "yarn":
        ctx = s.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return head_dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp  # 1: keep the frequency, 0: divide it by factor
        return inv_freq / s.factor * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq


def precompute_rope(head_dim: int, max_seq_len: int, theta: float,
                    scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables ``(cos, sin)``, each float32 of shape ``[max_seq_len, head_dim // 2]``.

    Row ``p`` holds ``cos``/``sin`` of the angles ``p * inv_freq`` (:func:`rope_inv_freq`),
    times :func:`rope_attention_factor`. Computed in float64 (on CPU), then rounded.
    """
    s = scaling or NO_SCALING
    positions = torch.arange(max_seq_len, dtype=torch.float64, device="cpu")
    angles = torch.outer(positions, rope_inv_freq(head_dim, theta, s))
    attn = rope_attention_factor(s)
    return (angles.cos() * attn).to(torch.float32), (angles.sin() * attn).to(torch.float32)


def rope_scaling_from_hf(hf: Mapping[str, Any], *, where: str = "config.json") -> RopeScaling:
    """The :class:`RopeScaling` of a parsed transformers ``config.json`` (or ``config.to_dict()``).

    Reads ``rope_parameters`` (transformers 5) or ``rope_scaling`` (older); ``rope_type`` (or
    ``type``) ``default`` / ``llama3`` / ``yarn``. Raises ValueError naming the field and its
    value for any other type or a missing number.
    """
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, Mapping):
        raise ValueError(f"{where}: {field}={params!r} is not a dict.")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _HF_KINDS:
        raise ValueError(f"{where}: {field}.rope_type={rope_type!r} is not supported: this library implements "
                         f"{', '.join(map(repr, _HF_KINDS))} (RoPE scaling kinds none, llama, yarn).")
    kind = _HF_KINDS[rope_type]
    if kind == "none":
        return NO_SCALING
    original = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    if original is None:  # transformers then takes max_position_embeddings
        original = hf.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None and kind == "yarn" and original and hf.get("max_position_embeddings"):
        factor = hf["max_position_embeddings"] / original
    if factor is None or original is None:
        missing = "factor" if factor is None else "original_max_position_embeddings"
        raise ValueError(f"{where}: {field}.rope_type={rope_type!r} needs {field}.{missing}.")
    known = {f.name for f in fields(RopeScaling)} - {"kind", "factor", "original_max_position_embeddings"}
    extra = {k: params[k] for k in known if params.get(k) is not None}
    if kind == "llama":
        extra = {k: v for k, v in extra.items() if k in ("low_freq_factor", "high_freq_factor")}
    else:
        extra = {k: v for k, v in extra.items() if k not in ("low_freq_factor", "high_freq_factor")}
    try:
        return RopeScaling(kind=kind, factor=float(factor), original_max_position_embeddings=int(original), **extra)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {field}: {e}") from None


def rope_scaling_to_hf(scaling: RopeScaling, theta: float) -> dict[str, Any]:
    """The transformers ``rope_parameters`` dict of ``scaling`` with base ``theta``."""
    out: dict[str, Any] = {"rope_type": {v: k for k, v in _HF_KINDS.items()}[scaling.kind], "rope_theta": theta}
    if scaling.kind == "none":
        return out
    out.update(factor=scaling.factor, original_max_position_embeddings=scaling.original_max_position_embeddings)
    if scaling.kind == "llama":
        out.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor)
    else:
        out.update(beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow, truncate=scaling.truncate)
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(scaling, name) is not None:
                out[name] = getattr(scaling, name)
    return out
