"""Upstream's ``torchtitan.components.quantization``: the quantized-training converters and the
linears they convert to.

``Float8LinearConverter.Config(recipe_name=..., filter_fqns=..., emulate=..., model_compile_enabled=...)``
and the rest, as upstream's recipes name them (:mod:`torchtitan_spmd.techniques.quantization`).
``Float8Linear`` and ``MXFP8Linear`` subclass torchao's own classes, so they are built on first
access (without torchao: one ImportError line naming the ``float8`` extra).
"""

from torchtitan_spmd.techniques.quantization import (
    Float8GroupedExpertsConverter,
    Float8LinearConverter,
    MXFP8GroupedExpertsConverter,
    MXFP8LinearConverter,
    NVFP4Linear,
    NVFP4LinearConverter,
    QuantizationConverter,
    torchao_linears_getattr,
)

__all__ = [
    "Float8GroupedExpertsConverter",
    "Float8Linear",
    "Float8LinearConverter",
    "MXFP8GroupedExpertsConverter",
    "MXFP8Linear",
    "MXFP8LinearConverter",
    "NVFP4Linear",
    "NVFP4LinearConverter",
    "QuantizationConverter",
]
__getattr__ = torchao_linears_getattr(__name__, ("Float8Linear", "MXFP8Linear"))
