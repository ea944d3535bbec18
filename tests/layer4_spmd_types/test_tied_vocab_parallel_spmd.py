"""Layer 4: the tied model vocab-parallel on both sides under ``spmd_types`` (FSDP 2 x TP 2, loss
parallel, the type checker on), against the float64 reference (``tied_helpers.check_tied``; the
other backends' rows: ``tests/layer3_runtime/test_tied_vocab_parallel.py``)."""

from __future__ import annotations

import pytest
from spmd_helpers import requires_torch  # first: it puts layer 3's helpers on the path

# isort: split
from tied_helpers import check_tied

pytestmark = [pytest.mark.backend("spmd_types"), pytest.mark.multiproc,
              requires_torch("2.14", "spmd_types with FSDP")]


def test_tied_model_is_vocab_parallel_and_matches_the_reference_typechecked() -> None:
    gaps = check_tied("spmd_types", spmd_typechecking=True)
    print(f"\ntied llama3 spmd_types fsdp2_tp2 (typechecked): loss {gaps['loss_rel']:.1e}, "
          f"tied grad norm {gaps['grad_rel']:.1e}")
