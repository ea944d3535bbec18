"""The ``deepseek_v3`` family's Hugging Face adapter: transformers' ``DeepseekV3ForCausalLM`` names and config.

Names only, no row permutation: transformers' DeepseekV3 (``rope_interleave=True``, its default)
rotates interleaved pairs of the rope parts, as this model does (it re-lays them out as halves
for ``rotate_half``, the same permutation for queries and keys, so every score is the same).

- MLA: ``wq`` = ``q_proj`` (``q_lora_rank`` 0; transformers ``q_lora_rank=None``), or ``wq_a`` /
  ``q_norm`` / ``wq_b`` = ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``; ``wkv_a`` =
  ``kv_a_proj_with_mqa``, ``kv_norm`` = ``kv_a_layernorm``, ``wkv_b`` = ``kv_b_proj``, ``wo`` = ``o_proj``.
- The dense blocks' SwiGLU: ``mlp.gate_proj/up_proj/down_proj``.
- The MoE blocks: the router's gate ``mlp.gate.weight``, the expert bias
  ``mlp.gate.e_score_correction_bias`` (transformers' router selects with it, as this one),
  every expert ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` (one tensor per expert,
  as ``save_pretrained`` writes them), the shared experts ``mlp.shared_experts.*``.
- ``config.json``: the MLA widths, the MoE numbers (``n_routed_experts``, ``num_experts_per_tok``,
  ``n_shared_experts``, ``n_group``, ``topk_group``, ``routed_scaling_factor``,
  ``norm_topk_prob``, ``first_k_dense_replace``) and YaRN as ``rope_parameters``
  (``mscale == mscale_all_dim``, this model's one YaRN variant).

transformers' DeepseekV3 routes with sigmoid scores only: a ``softmax`` flavour (upstream's
``debugmodel`` and ``16B``) has no transformers counterpart and the adapter says so. Multi-token
prediction weights (``num_nextn_predict_layers``) are not part of transformers' model either.
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

from .model import DeepSeekV3Config

__all__ = ["DeepSeekV3StateDictAdapter"]

_ATTENTION = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
_MOE = {
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2": "mlp.shared_experts.down_proj.weight",
}


class DeepSeekV3StateDictAdapter(StateDictAdapter):
    """``deepseek_v3`` <-> transformers ``DeepseekV3ForCausalLM``."""

    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    layer_keys = {
        **{k: v for k, v in StateDictAdapter.layer_keys.items() if not k.startswith("attention.")},
        **_ATTENTION,
        **_MOE,
    }
    grouped_layer_keys = {
        "moe.experts.w1": "mlp.experts.{}.gate_proj.weight",
        "moe.experts.w3": "mlp.experts.{}.up_proj.weight",
        "moe.experts.w2": "mlp.experts.{}.down_proj.weight",
    }

    model_config: DeepSeekV3Config

    def family_fields(self, config: DeepSeekV3Config) -> dict[str, Any]:
        c = config
        return {
            "num_key_value_heads": c.n_heads, "q_lora_rank": c.q_lora_rank or None, "kv_lora_rank": c.kv_lora_rank,
            "qk_nope_head_dim": c.qk_nope_head_dim, "qk_rope_head_dim": c.qk_rope_head_dim,
            "v_head_dim": c.v_head_dim, "head_dim": c.qk_rope_head_dim, "intermediate_size": c.hidden_dim,
            "moe_intermediate_size": c.moe_hidden_dim, "n_routed_experts": c.num_experts,
            "num_experts_per_tok": c.top_k, "n_shared_experts": c.n_shared_experts, "n_group": c.n_group,
            "topk_group": c.topk_group, "routed_scaling_factor": c.route_scale, "norm_topk_prob": c.route_norm,
            "first_k_dense_replace": c.first_k_dense_replace,
        }

    def hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        self._check_score_func()
        return {**super().hf_config(dtype), "rope_interleave": True, "num_nextn_predict_layers": 0}

    def _check_score_func(self) -> None:
        c = self.model_config
        if c.moe_enabled and c.score_func != "sigmoid":
            raise HFConfigError(f"transformers' DeepseekV3 routes with sigmoid scores; this flavour has "
                                f"score_func={c.score_func!r} (upstream's debugmodel and 16B): it has no "
                                "transformers counterpart.")

    def _check_variant(self, hf: Mapping[str, Any], where: str) -> None:
        if hf.get("rope_interleave", True) is not True:
            raise HFConfigError(f"{where}: rope_interleave={hf.get('rope_interleave')!r} is not supported: this "
                                "model rotates interleaved pairs (rope_interleave=True).")
        super()._check_variant(hf, where)

    def check_hf_config(self, hf: Mapping[str, Any], *, where: str = "config.json", flavor: str = "") -> None:
        self._check_score_func()
        super().check_hf_config(_with_defaults(hf), where=where, flavor=flavor)

    @classmethod
    def model_config_from_hf(cls, hf: Mapping[str, Any], *, where: str = "config.json") -> DeepSeekV3Config:
        hf = _with_defaults(hf)
        cls(DeepSeekV3Config(score_func="sigmoid"))._check_variant(hf, where)
        f = cls._required(hf, where, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                          "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
                          "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "rms_norm_eps")
        return DeepSeekV3Config(
            dim=f["hidden_size"], n_layers=f["num_hidden_layers"], n_heads=f["num_attention_heads"],
            vocab_size=f["vocab_size"], norm_eps=float(f["rms_norm_eps"]),
            max_seq_len=int(hf.get("max_position_embeddings") or 2048), q_lora_rank=int(hf.get("q_lora_rank") or 0),
            kv_lora_rank=f["kv_lora_rank"], qk_nope_head_dim=f["qk_nope_head_dim"],
            qk_rope_head_dim=f["qk_rope_head_dim"], v_head_dim=f["v_head_dim"],
            rope_theta=float(rope_theta_of(hf) or 10000.0), rope_scaling=rope_scaling_of(hf, where),
            hidden_dim=f["intermediate_size"],
            first_k_dense_replace=int(hf["first_k_dense_replace"]), num_experts=f["n_routed_experts"],
            top_k=f["num_experts_per_tok"], moe_hidden_dim=f["moe_intermediate_size"],
            n_shared_experts=int(hf["n_shared_experts"]), score_func="sigmoid",
            route_norm=bool(hf["norm_topk_prob"]), route_scale=float(hf["routed_scaling_factor"]),
            n_group=int(hf["n_group"]), topk_group=int(hf["topk_group"]),
        )


def _with_defaults(hf: Mapping[str, Any]) -> dict[str, Any]:
    """``hf`` with transformers' ``DeepseekV3Config`` defaults for the MoE fields it may leave out."""
    out = dict(hf)
    for name, default in (("n_shared_experts", 1), ("n_group", 8), ("topk_group", 4), ("routed_scaling_factor", 2.5),
                          ("norm_topk_prob", True), ("first_k_dense_replace", 3), ("q_lora_rank", None)):
        out.setdefault(name, default)
    if out.get("num_key_value_heads") is None:
        out["num_key_value_heads"] = out.get("num_attention_heads")
    return out
