"""Upstream's ``torchtitan.components.quantization.float8``: the float8 converters and linear."""

from typing import Any

from torchtitan_spmd.techniques.quantization import (
    Float8GroupedExpertsConverter,
    Float8LinearConverter,
)

__all__ = ["Float8GroupedExpertsConverter", "Float8Linear", "Float8LinearConverter"]  # noqa: F822 (__getattr__)


def __getattr__(name: str) -> Any:
    """``Float8Linear``, built from torchao's class on first access."""
    if name == "Float8Linear":
        from torchtitan_spmd.techniques.quantization import _float8_linear_class

        return _float8_linear_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
