"""Layer 4: a random transformers ``DeepseekV3ForCausalLM`` loaded sharded under ``spmd_types`` on 4 gloo
ranks, with EP (FSDP 2 x TP 2 x EP 4) and without (FSDP 4): the step-1 loss is transformers' own and an
export right after the load is the source, bit for bit (``deepseek_helpers.check_hf_training``; the
``default`` and ``full_dtensor`` cells are layer 3's, ``test_model_deepseek_v3.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from spmd_helpers import requires_torch  # first: it puts layer 3's helpers on the path

# isort: split
from deepseek_helpers import check_hf_training

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = [pytest.mark.backend("spmd_types"), pytest.mark.multiproc,
              requires_torch("2.14", "Hugging Face checkpoints (DCP's CheckpointableTensor) and spmd_types with FSDP")]


def test_sharded_hf_load_trains_on_transformers_loss(tmp_path: Path) -> None:
    check_hf_training("spmd_types", ("fsdp2_tp2_ep4", "fsdp4"), tmp_path)
