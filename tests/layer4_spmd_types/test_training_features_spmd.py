"""Layer 4: mixed precision, activation checkpointing, compile and gradient accumulation
under ``spmd_types`` (the checks of ``tests/layer3_runtime/test_training_features.py``).

4 forked gloo ranks, FSDP 2 x TP 2 over spmd_types-annotated plain tensors (torch >= 2.14),
each run against this backend's own fp32 eager run. What is special here:

- activation checkpointing recomputes the blocks in backward: the plan's collectives take
  their process groups from the representation's forward mesh (not from thread-local state),
  and the thread-local ``current_spmd_mesh()`` (upstream's API, for a fork's own code) is the
  forward mesh during the recompute too, as the probe checks (backward runs on the calling
  thread: autograd multithreading is off in the train context);
- compile traces the plan's collectives through a ``nonstrict_trace`` call (Dynamo does not
  step into spmd_types' Python); no types are asserted while it traces.
"""

from __future__ import annotations

import os
import sys

import pytest

_LAYER3 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "layer3_runtime")
if _LAYER3 not in sys.path:
    sys.path.insert(0, _LAYER3)

from feature_helpers import (  # noqa: E402
    check_accumulation,
    check_activation_checkpointing,
    check_bf16,
    check_compile,
)
from spmd_helpers import requires_torch  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.backend("spmd_types"),
              requires_torch("2.14", "FSDP over spmd_types-annotated tensors")]

BACKEND = "spmd_types"


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_changes_no_loss(mode: str) -> None:
    # both runs of the block, forward and recompute, see the forward mesh as current
    check_activation_checkpointing(BACKEND, mode, probe="spmd_probes:block_calls_on_mesh")


def test_compile_matches_eager() -> None:
    check_compile(BACKEND, "inductor", ["model", "loss"])  # compile's default backend, two steps


def test_bf16_parameters_track_fp32() -> None:
    check_bf16(BACKEND)


def test_gradient_accumulation_matches_the_big_batch() -> None:
    check_accumulation(BACKEND)
