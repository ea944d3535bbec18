"""Layer 4: the validator under context parallelism with ``spmd_types`` (upstream's only CP
backend since #4218), against the float64 reference: the check of layer 3's
``test_validation_parallel.py`` (its helpers, :mod:`validation_helpers`), on this backend.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

_LAYER3 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "layer3_runtime")
if _LAYER3 not in sys.path:
    sys.path.insert(0, _LAYER3)

from spmd_helpers import requires_torch  # noqa: E402
from validation_helpers import check, job, validate_on_rank  # noqa: E402

from torchtitan_spmd.launcher import run_forked  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.backend("spmd_types"),
              requires_torch("2.14", "FSDP over spmd_types-annotated tensors")]


def test_validation_under_cp_with_spmd_types(tmp_path: Any) -> None:
    """cp 2, headtail, typed plain shards (FSDP over cp): the reference's token-weighted loss."""
    cfg = job(str(tmp_path), {"context_parallel_degree": 2, "spmd_backend": "spmd_types"})
    check(run_forked(validate_on_rank, 2, cfg, timeout_s=300), cfg)
