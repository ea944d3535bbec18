"""Upstream's ``torchtitan.components.lora``: ``LoRAConverter.Config(rank=..., alpha=..., target_modules=...)``
(:mod:`torchtitan_spmd.techniques.lora`)."""

from torchtitan_spmd.techniques.lora import LoRAConverter

__all__ = ["LoRAConverter"]
