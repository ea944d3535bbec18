"""Layer 3: a tied model (``enable_weight_tying``) is vocab-parallel on both sides under TP.

One parameter serves the embedding and the output projection, laid out ``S(0)@tp`` (upstream's
``RowwiseParallel`` embedding and ``ColwiseParallel`` output): at FSDP 2 x TP 2 with sequence and
loss parallel, on real gloo ranks, each rank stores a quarter of the table and gets vocab-sharded
logits, and every step's loss and the tied table's gradient (the embedding's part plus the
output's) equal the float64 reference's (``tied_helpers.check_tied``). ``spmd_types``' row:
``tests/layer4_spmd_types/test_tied_vocab_parallel_spmd.py``.
"""

from __future__ import annotations

import pytest
from parity_helpers import skip_full_dtensor_on_old_torch
from tied_helpers import check_tied

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_tied_model_is_vocab_parallel_and_matches_the_reference(backend: str) -> None:
    skip_full_dtensor_on_old_torch(backend, "fsdp2_tp2")
    gaps = check_tied(backend)
    print(f"\ntied llama3 {backend} fsdp2_tp2: loss {gaps['loss_rel']:.1e}, tied grad norm {gaps['grad_rel']:.1e}")
