"""Model converters under ``spmd_types`` (issue 42): float8 against torchao's own single-process model
and LoRA, at FSDP 2 x TP 2 (the checks are layer 3's ``float8_helpers``)."""

from __future__ import annotations

from typing import Any

import pytest
import spmd_helpers  # noqa: F401 - puts layer 3's helpers on the path

pytest.importorskip("torchao.float8", reason='float8 needs the float8 extra: pip install -e ".[float8]"')

from float8_helpers import check_float8_parity, check_lora  # noqa: E402


def test_float8_type_checked_matches_torchaos_single_process_model() -> None:
    """Type-checked (``debug.spmd_typechecking``): each amax a scale takes over a tp-sharded axis is
    reduced by a typed all-gather (``S(dim)@tp -> R@tp``), and the float8 matmul's type rule takes
    the scales with the operands, so a dropped reduction is an ``SpmdTypeError``."""
    check_float8_parity("spmd_types-fsdp2_tp2-typechecked", "spmd_types", (), spmd_typechecking=True)


def test_lora_trains_only_the_adapters_and_exports_merged_spmd_types(tmp_path: Any) -> None:
    check_lora(tmp_path, "spmd_types")
