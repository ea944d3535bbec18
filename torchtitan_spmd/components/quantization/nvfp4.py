"""Upstream's ``torchtitan.components.quantization.nvfp4`` (b5bcd76): the NVFP4 converter, its linear,
and the recipes' helper that keeps the last blocks in high precision."""

from torchtitan_spmd.config.converters import nvfp4_bf16_tail_fqns
from torchtitan_spmd.techniques.quantization import NVFP4Linear, NVFP4LinearConverter

__all__ = ["NVFP4Linear", "NVFP4LinearConverter", "nvfp4_bf16_tail_fqns"]
