"""The ``qwen3`` family's Hugging Face adapter: ``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM`` names and sizes.

Like upstream's ``torchtitan/models/qwen3/state_dict_adapter.py``: names only, no row
permutation (this model rotates halves, as transformers' Qwen3), plus the per-head QK norms.
The MoE flavours map to transformers' ``Qwen3MoeForCausalLM`` (``model_type="qwen3_moe"``):
the router's gate is ``mlp.gate.weight``; each grouped expert weight ``[num_experts, ...]`` is
``num_experts`` tensors on the Hub (``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``, the
layout transformers 5 writes with ``save_pretrained``; it fuses them only in memory), ``w1``
the gate projections, ``w3`` the up projections, ``w2`` the down projections. The expert bias
(load-balancing state) has no transformers counterpart: it is not exported, and an import
starts it at zero (transformers' router has no bias, so the exported model routes as this one
with a zero bias).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtitan_spmd.models.state_dict_adapter import (
    HFConfigError,
    StateDictAdapter,
    rope_scaling_of,
    rope_theta_of,
)

from .model import Qwen3Config

__all__ = ["Qwen3StateDictAdapter"]

_MOE_LAYER_KEYS = {"moe.router.gate.weight": "mlp.gate.weight"}
_MOE_GROUPED_KEYS = {
    "moe.experts.w1": "mlp.experts.{}.gate_proj.weight",
    "moe.experts.w3": "mlp.experts.{}.up_proj.weight",
    "moe.experts.w2": "mlp.experts.{}.down_proj.weight",
}
#: config.json fields of a Qwen3Moe model that this model has one value of (every block an MoE).
_MOE_FIXED = {"decoder_sparse_step": 1, "mlp_only_layers": []}


class Qwen3StateDictAdapter(StateDictAdapter):
    """``qwen3`` <-> transformers ``Qwen3ForCausalLM`` (dense flavours) or ``Qwen3MoeForCausalLM`` (MoE)."""

    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    layer_keys = {
        **StateDictAdapter.layer_keys,
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    }
    fixed_fields = {**StateDictAdapter.fixed_fields, "use_sliding_window": False}

    model_config: Qwen3Config

    def __init__(self, model_config: Qwen3Config, hf_assets_path: str | None = None) -> None:
        super().__init__(model_config, hf_assets_path)
        if model_config.moe_enabled:  # the MoE variant: transformers' Qwen3Moe names (instance attributes)
            self.architecture, self.model_type = "Qwen3MoeForCausalLM", "qwen3_moe"  # type: ignore[misc]
            dense = ("feed_forward.",)
            self.layer_keys = {  # type: ignore[misc]
                **{k: v for k, v in type(self).layer_keys.items() if not k.startswith(dense)}, **_MOE_LAYER_KEYS}
            self.grouped_layer_keys = dict(_MOE_GROUPED_KEYS)  # type: ignore[misc]
            self.fixed_fields = {**type(self).fixed_fields, **_MOE_FIXED}  # type: ignore[misc]

    def family_fields(self, config: Qwen3Config) -> dict[str, Any]:
        fields: dict[str, Any] = {"num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim,
                                  "intermediate_size": config.hidden_dim}
        if config.moe_enabled:
            fields.update(num_experts=config.num_experts, num_experts_per_tok=config.top_k,
                          moe_intermediate_size=config.moe_hidden_dim, norm_topk_prob=config.route_norm)
        return fields

    def hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        layers = self.model_config.n_layers
        return {**super().hf_config(dtype), "layer_types": ["full_attention"] * layers,
                "max_window_layers": layers, "sliding_window": None}

    def check_hf_config(self, hf: Mapping[str, Any], *, where: str = "config.json", flavor: str = "") -> None:
        super().check_hf_config(_moe_aliases(hf), where=where, flavor=flavor)

    def _check_variant(self, hf: Mapping[str, Any], where: str) -> None:
        super()._check_variant(hf, where)
        c = self.model_config
        if c.moe_enabled and (c.score_func != "softmax" or c.route_scale != 1.0):
            raise HFConfigError(f"{where}: transformers' Qwen3Moe routes with softmax scores and no scale; this "
                                f"flavour has score_func={c.score_func!r}, route_scale={c.route_scale!r}.")

    @classmethod
    def model_config_from_hf(cls, hf: Mapping[str, Any], *, where: str = "config.json") -> Qwen3Config:
        hf = _moe_aliases(hf)
        moe = hf.get("model_type") == "qwen3_moe"
        probe = Qwen3Config(num_experts=1, top_k=1, moe_hidden_dim=1) if moe else Qwen3Config()
        cls(probe)._check_variant(hf, where)
        f = cls._required(hf, where, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "intermediate_size", "rms_norm_eps")
        extra: dict[str, Any] = {}
        if moe:
            m = cls._required(hf, where, "num_experts", "num_experts_per_tok", "moe_intermediate_size")
            extra = dict(num_experts=m["num_experts"], top_k=m["num_experts_per_tok"],
                         moe_hidden_dim=m["moe_intermediate_size"], score_func="softmax",
                         route_norm=bool(hf.get("norm_topk_prob", False)))
        return Qwen3Config(
            dim=f["hidden_size"], n_layers=f["num_hidden_layers"], n_heads=f["num_attention_heads"],
            n_kv_heads=f["num_key_value_heads"],
            head_dim=hf.get("head_dim") or f["hidden_size"] // f["num_attention_heads"],
            hidden_dim=f["intermediate_size"], vocab_size=f["vocab_size"], norm_eps=float(f["rms_norm_eps"]),
            rope_theta=float(rope_theta_of(hf) or 1_000_000.0),
            max_seq_len=int(hf.get("max_position_embeddings") or 2048),
            rope_scaling=rope_scaling_of(hf, where),
            enable_weight_tying=bool(hf.get("tie_word_embeddings", False)), **extra,
        )


def _moe_aliases(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """``hf`` with ``num_experts`` where transformers wrote its alias ``num_local_experts``
    (``Qwen3MoeConfig.attribute_map``), and ``norm_topk_prob``/``decoder_sparse_step``/
    ``mlp_only_layers`` at transformers' defaults where they are left out."""
    if hf.get("model_type") != "qwen3_moe":
        return hf
    out = dict(hf)
    if out.get("num_experts") is None and out.get("num_local_experts") is not None:
        out["num_experts"] = out["num_local_experts"]
    out.setdefault("norm_topk_prob", False)
    out.setdefault("decoder_sparse_step", 1)
    if out.get("mlp_only_layers") is None:
        out["mlp_only_layers"] = []
    return out
