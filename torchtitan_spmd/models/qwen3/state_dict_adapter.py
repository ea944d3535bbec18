"""The ``qwen3`` family's Hugging Face adapter: ``Qwen3ForCausalLM`` names and sizes.

Like upstream's ``torchtitan/models/qwen3/state_dict_adapter.py``: names only, no row
permutation (this model rotates halves, as transformers' Qwen3), plus the per-head QK norms.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtitan_spmd.models.state_dict_adapter import StateDictAdapter, rope_theta_of

from .model import Qwen3Config

__all__ = ["Qwen3StateDictAdapter"]


class Qwen3StateDictAdapter(StateDictAdapter):
    """``qwen3`` <-> transformers ``Qwen3ForCausalLM``."""

    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    layer_keys = {
        **StateDictAdapter.layer_keys,
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    }
    fixed_fields = {**StateDictAdapter.fixed_fields, "use_sliding_window": False}

    model_config: Qwen3Config

    def family_fields(self, config: Qwen3Config) -> dict[str, Any]:
        return {"num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim,
                "intermediate_size": config.hidden_dim}

    def hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        layers = self.model_config.n_layers
        return {**super().hf_config(dtype), "layer_types": ["full_attention"] * layers,
                "max_window_layers": layers, "sliding_window": None}

    @classmethod
    def model_config_from_hf(cls, hf: Mapping[str, Any], *, where: str = "config.json") -> Qwen3Config:
        cls(Qwen3Config())._check_variant(hf, where)
        f = cls._required(hf, where, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "intermediate_size", "rms_norm_eps")
        return Qwen3Config(
            dim=f["hidden_size"], n_layers=f["num_hidden_layers"], n_heads=f["num_attention_heads"],
            n_kv_heads=f["num_key_value_heads"],
            head_dim=hf.get("head_dim") or f["hidden_size"] // f["num_attention_heads"],
            hidden_dim=f["intermediate_size"], vocab_size=f["vocab_size"], norm_eps=float(f["rms_norm_eps"]),
            rope_theta=float(rope_theta_of(hf) or 1_000_000.0),
            max_seq_len=int(hf.get("max_position_embeddings") or 2048),
        )
