"""Upstream's ``torchtitan.components.quantization``: the quantized-training converters.

``Float8LinearConverter.Config(recipe_name=..., filter_fqns=..., emulate=..., model_compile_enabled=...)``
and the rest, as upstream's recipes name them (:mod:`torchtitan_spmd.techniques.quantization`).
"""

from torchtitan_spmd.techniques.quantization import (
    Float8GroupedExpertsConverter,
    Float8LinearConverter,
    MXFP8GroupedExpertsConverter,
    MXFP8LinearConverter,
    NVFP4LinearConverter,
    QuantizationConverter,
)

__all__ = [
    "Float8GroupedExpertsConverter",
    "Float8LinearConverter",
    "MXFP8GroupedExpertsConverter",
    "MXFP8LinearConverter",
    "NVFP4LinearConverter",
    "QuantizationConverter",
]
