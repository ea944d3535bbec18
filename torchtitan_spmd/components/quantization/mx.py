"""Upstream's ``torchtitan.components.quantization.mx``: the MXFP8 converters and linear
(``MXFP8Linear`` subclasses torchao's class: built on first access)."""

from torchtitan_spmd.techniques.quantization import (
    MXFP8GroupedExpertsConverter,
    MXFP8LinearConverter,
    torchao_linears_getattr,
)

__all__ = ["MXFP8GroupedExpertsConverter", "MXFP8Linear", "MXFP8LinearConverter"]  # noqa: F822 (__getattr__)
__getattr__ = torchao_linears_getattr(__name__, ("MXFP8Linear",))
