"""Upstream's ``torchtitan.components.quantization.float8``: the float8 converters and linear
(``Float8Linear`` subclasses torchao's class: built on first access)."""

from torchtitan_spmd.techniques.quantization import (
    Float8GroupedExpertsConverter,
    Float8LinearConverter,
    torchao_linears_getattr,
)

__all__ = ["Float8GroupedExpertsConverter", "Float8Linear", "Float8LinearConverter"]  # noqa: F822 (__getattr__)
__getattr__ = torchao_linears_getattr(__name__, ("Float8Linear",))
