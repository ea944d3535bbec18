"""Hugging Face ``config.json`` in: which folder, its checks, and the model config it resolves to.

The setup-time half of Hugging Face interop, below checkpointing: ``model.flavor=from_hf``
sizes the model from a transformers folder's ``config.json`` (through the family's
state-dict adapter), and ``checkpoint.initial_load_in_hf`` checks the folder against a named
flavour. The weights themselves are read and written by :mod:`torchtitan_spmd.checkpoint.hf`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from torchtitan_spmd._errors import require
from torchtitan_spmd._safe_files import UnsafeFile, read_json_inside
from torchtitan_spmd.models import replace_config
from torchtitan_spmd.models.state_dict_adapter import FROM_HF_FLAVOR, HFConfigError

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig
    from torchtitan_spmd.models import ModelSpec

__all__ = [
    "HF_EXTRA",
    "hf_folder",
    "read_hf_config",
    "require_safetensors",
    "resolve_model_config",
    "validate_hf_config",
]

#: The optional dependency group that brings ``safetensors``.
HF_EXTRA = "hf"
_CONFIG = "config.json"


def require_safetensors() -> None:
    """Import ``safetensors`` or raise :class:`MissingExtraError` naming the ``[hf]`` extra."""
    require("safetensors", HF_EXTRA,
            "Hugging Face checkpoints (checkpoint.initial_load_in_hf, checkpoint.last_save_in_hf)")


def _has_checkpointable_tensor() -> bool:
    try:
        from torch.distributed.checkpoint.protocol import CheckpointableTensor  # noqa: F401
    except ImportError:
        return False
    return True


def hf_folder(job_config: JobConfig) -> str | None:
    """The Hugging Face folder: ``checkpoint.initial_load_path``, else a root ``hf_assets_path``
    (upstream's field, where the root config has one)."""
    path = job_config.checkpoint.initial_load_path
    if path:
        return path
    for owner in (job_config, getattr(job_config, "model", None)):
        assets = getattr(owner, "hf_assets_path", None)
        if assets:
            return str(assets)
    return None


def read_hf_config(folder: str) -> dict[str, Any]:
    """The parsed ``config.json`` of ``folder``; ValueError naming the path when it is missing or bad."""
    path = os.path.join(folder, _CONFIG)
    try:  # a regular file of the folder, no link followed, plain finite JSON (a FIFO would block)
        config = read_json_inside(folder, _CONFIG)
    except FileNotFoundError:
        raise ValueError(f"{folder!r} has no {_CONFIG}: a Hugging Face folder (save_pretrained) is needed "
                         "for checkpoint.initial_load_in_hf and --model.flavor from_hf.") from None
    except UnsafeFile as err:
        raise ValueError(f"cannot read {err.path}: {err.line}") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object.")
    return config


def validate_hf_config(job_config: JobConfig, spec: ModelSpec) -> None:
    """Setup-time checks of the HF fields (ValueError naming the field): the combinations
    upstream requires, a folder to read, an adapter for the family, the torch and the extra."""
    ck = job_config.checkpoint
    if not (ck.initial_load_in_hf or ck.last_save_in_hf or job_config.model.flavor == FROM_HF_FLAVOR):
        return
    for name in ("initial_load_in_hf", "last_save_in_hf"):
        if getattr(ck, name) and not ck.enable:  # upstream ignores them silently then
            raise ValueError(f"checkpoint.{name}=True needs checkpoint.enable=True (without it nothing is "
                             f"{'loaded' if name.startswith('initial') else 'saved'}).")
    if ck.initial_load_in_hf and not ck.initial_load_model_only:
        raise ValueError("checkpoint.initial_load_in_hf=True needs checkpoint.initial_load_model_only=True "
                         "(safetensors hold the model only).")
    if ck.last_save_in_hf and not ck.last_save_model_only:
        raise ValueError("checkpoint.last_save_in_hf=True needs checkpoint.last_save_model_only=True "
                         "(safetensors hold the model only).")
    if (ck.initial_load_in_hf or job_config.model.flavor == FROM_HF_FLAVOR) and hf_folder(job_config) is None:
        what = "checkpoint.initial_load_in_hf" if ck.initial_load_in_hf else f"model.flavor={FROM_HF_FLAVOR!r}"
        raise ValueError(f"{what} needs a Hugging Face folder: set checkpoint.initial_load_path "
                         "(or the config's hf_assets_path, where it has one).")
    if spec.state_dict_adapter is None:
        raise ValueError(f"model.name={spec.name!r} has no Hugging Face state-dict adapter "
                         "(ModelSpec.state_dict_adapter); checkpoint.*_in_hf cannot be used.")
    if (ck.initial_load_in_hf or ck.last_save_in_hf) and not _has_checkpointable_tensor():
        raise ValueError(f"checkpoint.initial_load_in_hf / last_save_in_hf need torch >= 2.14 (DCP's "
                         f"CheckpointableTensor, for sharded Q/K rows); this is torch {torch.__version__}.")
    if ck.initial_load_in_hf or ck.last_save_in_hf:
        require_safetensors()


def resolve_model_config(spec: ModelSpec, job_config: JobConfig, *, vocab_size: int | None,
                         max_seq_len: int | None = None) -> Any:
    """The model config of ``model.flavor``: a named flavour (vocabulary ``vocab_size``; None: the
    flavour's own), or with
    ``from_hf`` the HF folder's ``config.json`` sizes (its own vocabulary, which must hold
    ``vocab_size`` ids). ``max_seq_len`` (the RoPE tables' rows, from ``training.seq_len``)
    replaces the config's when given, for either. With ``checkpoint.initial_load_in_hf`` the folder's ``config.json``
    must match the flavour: :class:`~torchtitan_spmd.models.state_dict_adapter.HFConfigError`
    names the first field that differs and both values."""
    validate_hf_config(job_config, spec)
    flavor = job_config.model.flavor
    if flavor != FROM_HF_FLAVOR:
        config = spec.model_config(flavor, vocab_size=vocab_size, max_seq_len=max_seq_len)
        if job_config.checkpoint.initial_load_in_hf:
            folder = hf_folder(job_config)
            assert folder is not None and spec.state_dict_adapter is not None
            spec.state_dict_adapter(config, folder).check_hf_config(
                read_hf_config(folder), where=os.path.join(folder, _CONFIG), flavor=flavor)
        return config
    folder = hf_folder(job_config)
    assert folder is not None and spec.state_dict_adapter is not None
    where = os.path.join(folder, _CONFIG)
    config = spec.state_dict_adapter.model_config_from_hf(read_hf_config(folder), where=where)
    if vocab_size is not None and config.vocab_size < vocab_size:
        raise HFConfigError(f"{where}: vocab_size={config.vocab_size} is smaller than the tokenizer's "
                         f"{vocab_size} ids.")
    return replace_config(config, max_seq_len=max_seq_len)
