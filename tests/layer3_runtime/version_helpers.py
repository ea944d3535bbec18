"""Which torch a test runs on, for tests that skip where a feature needs a newer one.

Test tooling (not installed with the package). Parses the version with ``packaging``,
independently of the runtime's own check (``representation.torch_at_least``), so a
test can compare the two. Layer 4's tests import it through ``spmd_helpers``' path.
"""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

__all__ = ["requires_torch", "torch_at_least", "torch_release"]


def torch_release() -> tuple[int, int]:
    """``(major, minor)`` of the running torch: ``"2.14.1+cu130"`` and ``"2.14.0.dev2026"`` give (2, 14)."""
    major, minor = Version(str(torch.__version__)).release[:2]
    return major, minor


def torch_at_least(minimum: str) -> bool:
    """Whether the running torch's ``major.minor`` is at least ``minimum`` (e.g. ``"2.14"``)."""
    return torch_release() >= Version(minimum).release[:2]


def requires_torch(minimum: str, feature: str) -> pytest.MarkDecorator:
    """A ``skipif`` marker: ``feature`` needs torch >= ``minimum``; the reason names both versions."""
    return pytest.mark.skipif(
        not torch_at_least(minimum),
        reason=f"{feature} needs torch >= {minimum} (this is torch {torch.__version__})",
    )
