"""Layer 3 parity of the MoE flavour (``moe_tiny``) under ``default`` and ``full_dtensor``.

Real forked gloo ranks, fp32, deterministic, 6 steps, against the independent reference (the
MoE restated densely in float64: router, top-k by pairwise comparison, every expert on every
token, the expert-bias update from the global batch's counts): on one process and on FSDP 4,
and (``default``) HSDP 2 x 2 with two gradient-accumulation microbatches and selective
activation checkpointing (the counts summed over microbatches and ranks, once per forward).
The spmd_types cells are layer 4's (``test_parity_spmd_moe.py``).
"""

from __future__ import annotations

import pytest
from moe_helpers import MOE_LAYOUTS, check_moe_parity, moe_config
from parity_helpers import run_config, skip_full_dtensor_on_old_torch

pytestmark = pytest.mark.multiproc


CELLS = [(b, lay) for b in ("default", "full_dtensor") for lay in ("single", "fsdp4")] + [("default", "hsdp_accum_ac")]


@pytest.mark.parametrize(("backend", "layout"), CELLS, ids=[f"{b}-{lay}" for b, lay in CELLS])
def test_moe_parity_with_the_reference(backend: str, layout: str) -> None:
    if layout != "single":
        skip_full_dtensor_on_old_torch(backend, "fsdp4")
    world, _ = MOE_LAYOUTS[layout]
    got = run_config(moe_config(backend, layout), world)
    loss_diff, norm_diff = check_moe_parity(got, layout)
    print(f"\nmoe {backend} {layout}: max rel diff loss {loss_diff:.1e} grad_norm {norm_diff:.1e}")
