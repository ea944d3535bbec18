"""Layer 4: real checkpoint shapes (Llama 3.1 RoPE scaling, Llama 3.2 and Qwen3-0.6B tied
embeddings) under ``spmd_types`` on FSDP 2 x TP 2 and (Llama 3.1) PP 2 x FSDP 2, against transformers (``hf_real_helpers.check``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from spmd_helpers import requires_torch  # first: it puts layer 3's helpers on the path

# isort: split
from hf_real_helpers import MODELS, check, save_source

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = [pytest.mark.backend("spmd_types"), pytest.mark.multiproc,
              requires_torch("2.14", "Hugging Face checkpoints (DCP's CheckpointableTensor) and spmd_types with FSDP")]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {n: save_source(n, tmp_path_factory.mktemp(f"hf-{n}")) for n in MODELS}


def test_real_shapes_fsdp2_tp2_match_transformers(sources: dict[str, Path], tmp_path: Path) -> None:
    check("spmd_types", "fsdp2_tp2", tmp_path, sources, MODELS)


def test_llama31_pp2_fsdp2_matches_transformers(sources: dict[str, Path], tmp_path: Path) -> None:
    """The Llama 3.1 shape at PP 2 x FSDP 2: each stage reads only its own tensors, step 1 gives
    transformers' loss, and the export writes the whole model once."""
    check("spmd_types", "pp2_fsdp2", tmp_path, sources, ("llama31",))
