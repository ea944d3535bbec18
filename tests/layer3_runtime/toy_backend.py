"""A fourth backend for the tests: ``default``'s representation under another name.

Registered by ``test_fourth_backend.py`` with one registry line; this module is its
representation module (``REPRESENTATION``), as a fork's own backend would be.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from torchtitan_spmd.distributed.layout import SpmdLayout
from torchtitan_spmd.distributed.representations.default import DefaultRepresentation


class ToyRepresentation(DefaultRepresentation):
    """``default`` renamed; counts the parameters it distributes (proof that it is the one used)."""

    name: ClassVar[str] = "toy"
    distributed: ClassVar[int] = 0

    def distribute(self, tensor: torch.Tensor, layout: SpmdLayout) -> torch.Tensor:
        type(self).distributed += 1
        return super().distribute(tensor, layout)


REPRESENTATION = ToyRepresentation
