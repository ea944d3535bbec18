"""Upstream's ``torchtitan.components.quantization.mx``: the MXFP8 converters and linear."""

from typing import Any

from torchtitan_spmd.techniques.quantization import (
    MXFP8GroupedExpertsConverter,
    MXFP8LinearConverter,
)

__all__ = ["MXFP8GroupedExpertsConverter", "MXFP8Linear", "MXFP8LinearConverter"]  # noqa: F822 (__getattr__)


def __getattr__(name: str) -> Any:
    """``MXFP8Linear``, built from torchao's class on first access."""
    if name == "MXFP8Linear":
        from torchtitan_spmd.techniques.quantization import _mxfp8_linear_class

        return _mxfp8_linear_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
