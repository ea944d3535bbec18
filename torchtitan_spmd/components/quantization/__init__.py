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
    """``Float8Linear`` and ``MXFP8Linear``, built from torchao's classes on first access (as in
    upstream's submodules ``float8`` and ``mx``, which are these modules here)."""
    if name == "Float8Linear":
        from .float8 import Float8Linear

        return Float8Linear
    if name == "MXFP8Linear":
        from .mx import MXFP8Linear

        return MXFP8Linear
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
