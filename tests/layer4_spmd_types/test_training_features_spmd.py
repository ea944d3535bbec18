"""Layer 4: mixed precision, activation checkpointing, compile and gradient accumulation
under ``spmd_types`` (the checks of ``tests/layer3_runtime/test_training_features.py``).

4 forked gloo ranks, FSDP 2 x TP 2 over spmd_types-annotated plain tensors (torch >= 2.14),
each run against this backend's own fp32 eager run. What is special here:

- activation checkpointing recomputes the blocks in backward, where the plan's spmd_types
  collectives need the forward mesh: it survives because the train context runs backward
  on the calling thread (autograd multithreading off), so a lost mesh would skip the TP
  collectives and change the loss;
- compile traces the plan's collectives through a ``nonstrict_trace`` call (Dynamo does not
  step into spmd_types' Python); no types are asserted while it traces.
"""

from __future__ import annotations

import pytest
from feature_helpers import (  # noqa: I001 - after spmd_helpers
    check_accumulation,
    check_activation_checkpointing,
    check_bf16,
    check_compile,
)
from spmd_helpers import requires_torch  # puts tests/layer3_runtime on sys.path

pytestmark = [pytest.mark.multiproc, pytest.mark.backend("spmd_types"),
              requires_torch("2.14", "FSDP over spmd_types-annotated tensors")]

BACKEND = "spmd_types"


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_changes_no_loss(mode: str) -> None:
    check_activation_checkpointing(BACKEND, mode)


def test_compile_matches_eager() -> None:
    check_compile(BACKEND, "aot_eager", ["model", "loss"])


def test_bf16_parameters_track_fp32() -> None:
    check_bf16(BACKEND)


def test_gradient_accumulation_matches_the_big_batch() -> None:
    check_accumulation(BACKEND)
