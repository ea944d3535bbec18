"""Layer 3: Hugging Face weights in and out under ``default`` and ``full_dtensor``, against transformers.

See ``hf_helpers.check_round_trip`` for what each case asserts (step-1 loss = transformers'
cross-entropy, load -> export bit-identical, the trained export opens with
``from_pretrained`` with the trainer's logits). The ``spmd_types`` rows are in
``tests/layer4_spmd_types/test_hf_checkpoint_spmd.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_helpers import FAMILIES, LAYOUTS, check_round_trip, save_source
from parity_helpers import skip_full_dtensor_on_old_torch
from version_helpers import requires_torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = [pytest.mark.multiproc, requires_torch("2.14", "Hugging Face checkpoints (DCP's CheckpointableTensor)")]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {f: save_source(f, tmp_path_factory.mktemp(f"hf-{f}")) for f in FAMILIES}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_hf_weights_in_and_out_match_transformers(backend: str, layout: str, sources: dict[str, Path],
                                                  tmp_path: Path) -> None:
    if backend == "full_dtensor":
        skip_full_dtensor_on_old_torch(backend, "fsdp2_tp2" if layout == "fsdp2_tp2" else "tp2_sp")
    check_round_trip(backend, layout, tmp_path, sources)
