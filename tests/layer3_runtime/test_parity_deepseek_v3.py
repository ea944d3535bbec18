"""Layer 3 parity of ``deepseek_v3`` (``tiny``: MLA with q_lora_rank 16 and value heads narrower than the
query/key heads, YaRN, 8 experts in 4 groups, sigmoid routing scaled by 2.5, one shared expert, one
dense block) under ``default`` and ``full_dtensor`` on 4 real forked gloo ranks, 4 steps, fp32, against
the float64 reference: loss within 1e-5, gradient norm within 1e-4 at every step, every parameter's
step-1 gradient norm within 1e-5 and the expert biases after every step (:mod:`grad_probe`, as the
``spmd_types`` cells). The spmd_types cells are layer 4's
(``tests/layer4_spmd_types/test_parity_spmd_deepseek_v3.py``).

Context parallelism runs under ``full_dtensor`` (``default`` refuses CP at setup): ring attention on
MLA's heads, whose values are zero-padded to the query/key width (the fused CPU kernel needs one width).
"""

from __future__ import annotations

import pytest
from deepseek_helpers import LAYOUTS, check_probed, deepseek_config
from parity_helpers import run_config, skip_full_dtensor_on_old_torch

pytestmark = pytest.mark.multiproc

#: The issue's cells under each backend (CP does not run under ``default``).
CELLS = [("default", lay) for lay in ("fsdp4", "fsdp2_tp2", "fsdp4_ep4", "fsdp2_tp2_ep4", "pp2_fsdp2_ep2")] + [
    ("full_dtensor", lay) for lay in ("fsdp4", "fsdp2_tp2", "fsdp4_ep4", "fsdp2_tp2_ep4", "pp2_fsdp2_ep2", "fsdp2_cp2")]


@pytest.mark.parametrize(("backend", "layout"), CELLS, ids=[f"{b}-{lay}" for b, lay in CELLS])
def test_deepseek_v3_parity_with_the_reference(backend: str, layout: str) -> None:
    skip_full_dtensor_on_old_torch(backend, "fsdp4")
    world, _ = LAYOUTS[layout]
    got = run_config(deepseek_config(backend, layout), world)
    loss_diff, norm_diff, grad_diff = check_probed(got, layout, f"deepseek_v3 {backend} {layout}")
    print(f"\ndeepseek_v3 {backend} {layout}: max rel diff loss {loss_diff:.1e} grad_norm {norm_diff:.1e} "
          f"per-tensor grads {grad_diff:.1e} ({len(got.trace.grad_norms)} tensors)")
