"""Hugging Face state-dict adapters: this library's parameter names and layouts <-> transformers'.

In the spirit of upstream's ``torchtitan/protocols/state_dict_adapter.py`` (a0c831c49): a
family's adapter is a field of its :class:`~torchtitan_spmd.models.ModelSpec`
(``state_dict_adapter``, a class), built as ``adapter_cls(model_config, hf_assets_path)``,
with ``to_hf`` / ``from_hf`` over full tensors and ``fqn_to_index_mapping`` (from the
assets folder's ``model.safetensors.index.json``, when there is one).

Beyond upstream, an adapter also describes its conversion *per tensor*, so the sharded
loader and exporter (``torchtitan_spmd/checkpoint/hf.py``) can apply it to each
rank's shard without any rank holding a full tensor:

- :meth:`StateDictAdapter.hf_key`: our name -> the transformers name (None: not exported);
- :meth:`StateDictAdapter.hf_rows`: for a weight whose rows transformers orders differently
  (llama3's Q/K projections: interleaved vs rotate-half RoPE), ``idx`` with
  ``hf_weight = our_weight[idx]``; None when the rows are the same;
- :meth:`StateDictAdapter.hf_grouped_keys`: for a grouped tensor (an MoE layer's experts
  ``[num_experts, ...]``), the transformers names of its slices along dim 0 (one tensor per
  expert on the Hub: ``mlp.experts.{e}.gate_proj.weight``); None for every other tensor.

and the model's ``config.json``: :meth:`StateDictAdapter.hf_config` writes one that
``transformers.AutoConfig`` reads, :meth:`StateDictAdapter.check_hf_config` compares one
with the flavour (a mismatch names the field and both values), and
:meth:`StateDictAdapter.model_config_from_hf` builds a flavour from one
(``--model.flavor from_hf``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from torchtitan_spmd._safe_files import UnsafeFile, read_json_inside
from torchtitan_spmd.models.rope import (
    NO_SCALING,
    RopeScaling,
    rope_scaling_from_hf,
    rope_scaling_to_hf,
)

__all__ = ["FROM_HF_FLAVOR", "HFConfigError", "StateDictAdapter", "rope_scaling_of", "rope_theta_of"]

#: ``model.flavor`` value that builds the model config from the HF folder's ``config.json``.
FROM_HF_FLAVOR = "from_hf"

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class HFConfigError(ValueError):
    """A ``config.json`` that this family's model cannot represent or that differs from the flavour."""


def rope_theta_of(hf: Mapping[str, Any]) -> Any:
    """The RoPE base of a transformers config: ``rope_parameters.rope_theta`` (transformers 5)
    or the older top-level ``rope_theta``."""
    params = hf.get("rope_parameters") or {}
    return params.get("rope_theta", hf.get("rope_theta"))


def rope_scaling_of(hf: Mapping[str, Any], where: str = "config.json") -> RopeScaling:
    """The RoPE scaling of a transformers config (:func:`~torchtitan_spmd.models.rope.rope_scaling_from_hf`),
    an unsupported one an :class:`HFConfigError` naming the field and its value."""
    try:
        return rope_scaling_from_hf(hf, where=where)
    except ValueError as e:
        raise HFConfigError(str(e)) from None


_INDEX = "model.safetensors.index.json"


def _weight_map(folder: str) -> dict[str, str]:
    """The ``weight_map`` (tensor -> file) of ``folder``'s ``model.safetensors.index.json``, read
    as a regular file of the folder (no link followed, plain JSON); ``ValueError`` in one line
    naming the file when it is not an object whose ``weight_map`` maps names to file names."""
    try:
        index = read_json_inside(folder, _INDEX)
    except UnsafeFile as err:
        raise ValueError(f"cannot read {err.path}: {err.line}") from None
    except OSError as err:
        raise ValueError(f"cannot read {os.path.join(folder, _INDEX)}: {err}") from None
    weight_map = index.get("weight_map", {}) if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise ValueError(f"{os.path.join(folder, _INDEX)} is not a safetensors index: it must be a JSON object "
                         "whose weight_map maps tensor names to file names.")
    return weight_map


class StateDictAdapter:
    """Base of the per-family adapters; a subclass fills in the class attributes and the config maps.

    Args:
        model_config: the flavour's config (``LlamaConfig``, ``Qwen3Config``).
        hf_assets_path: a Hugging Face folder (``config.json``, ``*.safetensors``, maybe
            ``model.safetensors.index.json``), or None.
    """

    #: transformers' ``architectures[0]`` and ``model_type`` of the family.
    architecture: ClassVar[str] = ""
    model_type: ClassVar[str] = ""
    #: Our per-layer names (after ``layers.N.``) -> transformers' (after ``model.layers.N.``).
    layer_keys: ClassVar[dict[str, str]] = {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    top_keys: ClassVar[dict[str, str]] = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    #: config.json fields whose value must be exactly this (the model has no other variant).
    fixed_fields: ClassVar[dict[str, Any]] = {"attention_bias": False, "hidden_act": "silu"}

    def __init__(self, model_config: Any, hf_assets_path: str | None = None) -> None:
        self.model_config = model_config
        self.hf_assets_path = hf_assets_path
        #: transformers name -> file number, from ``model.safetensors.index.json`` (None: one file).
        self.fqn_to_index_mapping: dict[str, int] | None = None
        if hf_assets_path and os.path.lexists(os.path.join(hf_assets_path, _INDEX)):
            weight_map = _weight_map(hf_assets_path)
            self.fqn_to_index_mapping = {
                k: int(m.group(1)) if (m := re.search(r"(\d+)-of-\d+", v)) else 1 for k, v in weight_map.items()
            }

    # ------------------------------------------------------------------ names and rows
    def hf_key(self, fqn: str) -> str | None:
        """The transformers name of our tensor ``fqn`` (None: it has none, e.g. a buffer)."""
        m = _LAYER.match(fqn)
        if m:
            rest = self.layer_keys.get(m.group(2))
            return f"model.layers.{m.group(1)}.{rest}" if rest else None
        return self.top_keys.get(fqn)

    def fqn(self, hf_key: str) -> str | None:
        """Our name of transformers tensor ``hf_key`` (None: this model has no such tensor)."""
        m = _HF_LAYER.match(hf_key)
        if m:
            ours = {v: k for k, v in self.layer_keys.items()}.get(m.group(2))
            return f"layers.{m.group(1)}.{ours}" if ours else None
        return {v: k for k, v in self.top_keys.items()}.get(hf_key)

    def hf_rows(self, fqn: str, n_rows: int) -> torch.Tensor | None:
        """``idx`` (int64, ``[n_rows]``) with ``hf_weight = our_weight[idx]``, or None (same rows)."""
        return None

    #: Our per-layer names of grouped tensors (after ``layers.N.``) -> transformers' name pattern
    #: of one slice (after ``model.layers.N.``, ``{}`` the index along dim 0).
    grouped_layer_keys: ClassVar[dict[str, str]] = {}

    def hf_grouped_keys(self, fqn: str, n_groups: int) -> tuple[str, ...] | None:
        """The transformers names of the ``n_groups`` slices ``our_tensor[g]`` of grouped tensor
        ``fqn``, in order; None when ``fqn`` is not grouped (then :meth:`hf_key` names it)."""
        m = _LAYER.match(fqn)
        pattern = self.grouped_layer_keys.get(m.group(2)) if m else None
        if pattern is None:
            return None
        return tuple(f"model.layers.{m.group(1)}.{pattern.format(g)}" for g in range(n_groups))  # type: ignore[union-attr]

    def grouped_fqn(self, hf_key: str) -> tuple[str, int] | None:
        """``(our grouped tensor, slice index)`` of transformers tensor ``hf_key``, or None."""
        m = _HF_LAYER.match(hf_key)
        if not m:
            return None
        for ours, pattern in self.grouped_layer_keys.items():
            head, _, tail = pattern.partition("{}")
            rest = m.group(2)
            if rest.startswith(head) and rest.endswith(tail) and rest[len(head):len(rest) - len(tail)].isdigit():
                return f"layers.{m.group(1)}.{ours}", int(rest[len(head):len(rest) - len(tail)])
        return None

    # ------------------------------------------------------------------ full tensors (upstream's API)
    def to_hf(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Our full state dict -> transformers' (names and row order); tensors without a name are dropped."""
        out = {}
        for fqn, value in state_dict.items():
            grouped = self.hf_grouped_keys(fqn, value.shape[0])
            if grouped is not None:
                out.update(zip(grouped, value.unbind(0), strict=True))
                continue
            key = self.hf_key(fqn)
            if key is None:
                continue
            idx = self.hf_rows(fqn, value.shape[0])
            out[key] = value if idx is None else value[idx]
        return out

    def from_hf(self, hf_state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """transformers' full state dict -> ours (ValueError for a tensor this model lacks)."""
        out: dict[str, Any] = {}
        slices: dict[str, dict[int, Any]] = {}
        for key, value in hf_state_dict.items():
            grouped = self.grouped_fqn(key)
            if grouped is not None:
                slices.setdefault(grouped[0], {})[grouped[1]] = value
                continue
            fqn = self.fqn(key)
            if fqn is None:
                raise ValueError(f"the Hugging Face tensor {key!r} has no counterpart in this {self.model_type} model.")
            idx = self.hf_rows(fqn, value.shape[0])
            out[fqn] = value if idx is None else value[torch.argsort(idx)]
        for fqn, parts in slices.items():
            if sorted(parts) != list(range(len(parts))):
                raise ValueError(f"the Hugging Face slices of {fqn!r} are not 0..{len(parts) - 1}: {sorted(parts)}.")
            out[fqn] = torch.stack([parts[g] for g in range(len(parts))])
        return out

    # ------------------------------------------------------------------ config.json
    def config_fields(self, config: Any) -> dict[str, Any]:
        """config.json field -> the value ``config`` implies: the decoder's shared sizes, then
        :meth:`family_fields`."""
        return {
            "vocab_size": config.vocab_size, "hidden_size": config.dim, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "rms_norm_eps": config.norm_eps,
            "rope_theta": config.rope_theta,
            "tie_word_embeddings": bool(getattr(config, "enable_weight_tying", False)), **self.family_fields(config),
        }

    def family_fields(self, config: Any) -> dict[str, Any]:
        """The family's own config.json fields (KV heads, head width, feed-forward width)."""
        raise NotImplementedError

    def hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        """A ``config.json`` for this flavour that ``transformers.AutoConfig`` reads (``dtype``: the weights')."""
        c = self.model_config
        fields = self.config_fields(c)
        theta = fields.pop("rope_theta")
        return {
            "architectures": [self.architecture], "model_type": self.model_type, **fields, **self.fixed_fields,
            "rope_parameters": rope_scaling_to_hf(getattr(c, "rope_scaling", NO_SCALING), theta), "rope_theta": theta,
            "max_position_embeddings": c.max_seq_len, "dtype": dtype, "torch_dtype": dtype,
            "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": True,
        }

    def _check_variant(self, hf: Mapping[str, Any], where: str) -> None:
        if hf.get("model_type") != self.model_type:
            raise HFConfigError(f"{where}: model_type={hf.get('model_type')!r}, but this family reads "
                                f"model_type={self.model_type!r} ({self.architecture}); pick the matching model.name.")
        for name, want in self.fixed_fields.items():
            if name in hf and hf[name] != want:
                raise HFConfigError(f"{where}: {name}={hf[name]!r} is not supported: this model has {name}={want!r}.")
        rope_scaling_of(hf, where)

    def check_hf_config(self, hf: Mapping[str, Any], *, where: str = "config.json", flavor: str = "") -> None:
        """Raise :class:`HFConfigError` naming the first field of ``hf`` (a parsed ``config.json``)
        that differs from this adapter's model config, with both values."""
        self._check_variant(hf, where)
        for name, ours in self.config_fields(self.model_config).items():
            default = ours if name == "head_dim" else False if name == "tie_word_embeddings" else None
            theirs = rope_theta_of(hf) if name == "rope_theta" else hf.get(name, default)
            same = (isinstance(ours, float) and isinstance(theirs, int | float)
                    and abs(theirs - ours) <= 1e-12 * max(1.0, abs(ours))) or theirs == ours
            if not same:
                raise HFConfigError(f"{where}: {name}={theirs!r}, but model.flavor={flavor!r} has {name}={ours!r}; "
                                    f"use the matching flavour or --model.flavor {FROM_HF_FLAVOR}.")
        ours_s, theirs_s = getattr(self.model_config, "rope_scaling", NO_SCALING), rope_scaling_of(hf, where)
        if ours_s != theirs_s:
            raise HFConfigError(f"{where}: the RoPE scaling is {theirs_s!r}, but model.flavor={flavor!r} has "
                                f"{ours_s!r}; use the matching flavour or --model.flavor {FROM_HF_FLAVOR}.")

    @classmethod
    def model_config_from_hf(cls, hf: Mapping[str, Any], *, where: str = "config.json") -> Any:
        """This family's model config with the sizes of ``hf`` (a parsed ``config.json``)."""
        raise NotImplementedError

    @classmethod
    def _required(cls, hf: Mapping[str, Any], where: str, *names: str) -> dict[str, Any]:
        missing = [n for n in names if hf.get(n) is None]
        if missing:
            raise HFConfigError(f"{where}: no {', '.join(missing)} (needed to build the model).")
        return {n: hf[n] for n in names}
