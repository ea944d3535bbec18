"""Layer 4: Hugging Face weights in and out under ``spmd_types``, against transformers.

The same checks as ``tests/layer3_runtime/test_hf_checkpoint.py`` (see
``hf_helpers.check_round_trip``): here every parameter is a plain local shard, which
reaches DCP's HF reader and writer through the representation's DTensor views.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from spmd_helpers import requires_torch  # first: it puts layer 3's helpers on the path

# isort: split
from hf_helpers import FAMILIES, LAYOUTS, check_round_trip, save_source

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = [pytest.mark.backend("spmd_types"), pytest.mark.multiproc,
              requires_torch("2.14", "Hugging Face checkpoints (DCP's CheckpointableTensor) and spmd_types with FSDP")]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {f: save_source(f, tmp_path_factory.mktemp(f"hf-{f}")) for f in FAMILIES}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hf_weights_in_and_out_match_transformers(layout: str, sources: dict[str, Path], tmp_path: Path) -> None:
    check_round_trip("spmd_types", layout, tmp_path, sources)
