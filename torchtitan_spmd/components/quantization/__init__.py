"""Upstream's ``torchtitan.components.quantization``: the quantized-training converters and the
linears they convert to.

``Float8LinearConverter.Config(recipe_name=..., filter_fqns=..., emulate=..., model_compile_enabled=...)``
and the rest, as upstream's recipes name them (:mod:`torchtitan_spmd.techniques.quantization`).
``Float8Linear`` and ``MXFP8Linear`` subclass torchao's own classes, so they are built on first
access (without torchao: one ImportError line naming the ``float8`` extra).
"""

from typing import Any

from torchtitan_spmd.techniques.quantization import (
    Float8GroupedExpertsConverter,
    Float8LinearConverter,
    MXFP8GroupedExpertsConverter,
    MXFP8LinearConverter,
    NVFP4Linear,
    NVFP4LinearConverter,
    QuantizationConverter,
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


def __getattr__(name: str) -> Any:
    """``Float8Linear`` and ``MXFP8Linear``, built from torchao's classes on first access."""
    from torchtitan_spmd.techniques import quantization

    if name == "Float8Linear":
        return quantization._float8_linear_class()
    if name == "MXFP8Linear":
        return quantization._mxfp8_linear_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
