"""The ``llama3`` family's Hugging Face adapter: ``LlamaForCausalLM`` names, sizes and Q/K row order.

transformers' Llama rotates the two halves of each head (``rotate_half``); this model (as
torchtitan's) rotates interleaved pairs ``(x[2i], x[2i+1])``. The same attention therefore
needs the rows of ``wq`` and ``wk`` reordered within each head: our row ``2i + p`` of a head
is transformers' row ``p * head_dim / 2 + i`` (upstream's ``_permute`` /
``_reverse_permute`` in ``torchtitan/models/llama3/state_dict_adapter.py``, here as an
index, so that it applies to any shard of rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torchtitan_spmd.models.state_dict_adapter import (
    HFConfigError,
    StateDictAdapter,
    rope_scaling_of,
    rope_theta_of,
)

from .model import LlamaConfig

__all__ = ["Llama3StateDictAdapter", "interleaved_to_half_rows"]


def interleaved_to_half_rows(n_heads: int, head_dim: int) -> torch.Tensor:
    """``idx`` with ``hf_rows = our_rows[idx]`` for a ``[n_heads * head_dim, ...]`` Q or K weight:
    within each head, the even rows (first of each pair) first, then the odd ones."""
    return torch.arange(n_heads * head_dim).view(n_heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


class Llama3StateDictAdapter(StateDictAdapter):
    """``llama3`` <-> transformers ``LlamaForCausalLM``."""

    architecture = "LlamaForCausalLM"
    model_type = "llama"
    fixed_fields = {**StateDictAdapter.fixed_fields, "mlp_bias": False}

    model_config: LlamaConfig

    def hf_rows(self, fqn: str, n_rows: int) -> torch.Tensor | None:
        c = self.model_config
        if fqn.endswith("attention.wq.weight"):
            return interleaved_to_half_rows(c.n_heads, c.head_dim)
        if fqn.endswith("attention.wk.weight"):
            return interleaved_to_half_rows(c.kv_heads, c.head_dim)
        return None

    def family_fields(self, config: LlamaConfig) -> dict[str, Any]:
        return {"num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
                "intermediate_size": config.ffn_hidden_dim}

    @classmethod
    def model_config_from_hf(cls, hf: Mapping[str, Any], *, where: str = "config.json") -> LlamaConfig:
        cls(LlamaConfig())._check_variant(hf, where)
        f = cls._required(hf, where, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                          "intermediate_size", "rms_norm_eps")
        dim, heads, hidden = f["hidden_size"], f["num_attention_heads"], f["intermediate_size"]
        if hf.get("head_dim") not in (None, dim // heads):
            raise HFConfigError(f"{where}: head_dim={hf['head_dim']!r} is not supported: this model's head width "
                                f"is hidden_size / num_attention_heads = {dim // heads}.")
        # ffn_hidden_dim rounds int(8 dim / 3) (times the multiplier) up to multiple_of: with
        # multiple_of = intermediate_size it is intermediate_size exactly.
        base = int(2 * (4 * dim) / 3)
        config = LlamaConfig(
            dim=dim, n_layers=f["num_hidden_layers"], n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads") or heads, vocab_size=f["vocab_size"], multiple_of=hidden,
            ffn_dim_multiplier=None if base <= hidden else hidden / base, norm_eps=float(f["rms_norm_eps"]),
            rope_theta=float(rope_theta_of(hf) or 10000.0), max_seq_len=int(hf.get("max_position_embeddings") or 2048),
            rope_scaling=rope_scaling_of(hf, where),
            enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        )
        if config.ffn_hidden_dim != hidden:
            raise HFConfigError(f"{where}: intermediate_size={hidden} cannot be represented by this model "
                                f"(it would have {config.ffn_hidden_dim}).")
        return config
