"""Layer 4 parity of the MoE flavour (``moe_tiny``) under ``spmd_types``.

Same harness, reference and tolerance as ``tests/layer3_runtime/test_parity_moe.py``; the first
step of each run is type-checked (the MoE body is a local region: its boundaries are checked).
"""

from __future__ import annotations

import pytest
from spmd_helpers import run_mixed, torch_at_least  # first: puts tests/layer3_runtime on sys.path

# isort: split
from moe_helpers import MOE_LAYOUTS, check_moe_parity, moe_config  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.backend("spmd_types")]

TYPED_STEPS = 1


@pytest.mark.parametrize("layout", ["single", "fsdp4"])
def test_moe_spmd_types_parity_with_the_reference(layout: str) -> None:
    world, _ = MOE_LAYOUTS[layout]
    if world > 1 and not torch_at_least("2.14"):
        pytest.skip("FSDP over spmd_types-annotated tensors needs torch >= 2.14")
    got = run_mixed(moe_config("spmd_types", layout, spmd_typechecking=True), world, typed_steps=TYPED_STEPS)
    assert [g[3] for g in got] == [True] * TYPED_STEPS + [False] * (len(got) - TYPED_STEPS)
    loss_diff, norm_diff = check_moe_parity(got, layout)
    print(f"\nmoe spmd_types {layout}: max rel diff loss {loss_diff:.1e} grad_norm {norm_diff:.1e}")
