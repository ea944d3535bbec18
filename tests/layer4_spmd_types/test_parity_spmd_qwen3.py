"""Layer 4 parity for the second model family: qwen3 under the spmd_types backend.

Same harness, tolerance and layouts as ``tests/layer3_runtime/test_parity_qwen3.py``;
as in ``test_parity_spmd.py``, the first step of each run is type-checked.
"""

from __future__ import annotations

import pytest
from spmd_helpers import (  # first: it puts layer 3's helpers on the path
    PARITY_CONFIGS,
    data_parallel_degree,
    job_config,
    run_mixed,
    torch_at_least,
)

# isort: split
from parity_helpers import QWEN3_CONFIGS, check_parity

pytestmark = [pytest.mark.multiproc, pytest.mark.backend("spmd_types")]

TYPED_STEPS = 1


@pytest.mark.parametrize("config_name", QWEN3_CONFIGS)
def test_qwen3_spmd_types_parity_with_single_process(config_name: str) -> None:
    world, parallelism = PARITY_CONFIGS[config_name]
    if data_parallel_degree(parallelism, world) > 1 and not torch_at_least("2.14"):
        pytest.skip("FSDP over spmd_types-annotated tensors needs torch >= 2.14")
    cfg = job_config("spmd_types", parallelism, model="qwen3", spmd_typechecking=True)
    got = run_mixed(cfg, world, typed_steps=TYPED_STEPS)
    assert [g[3] for g in got] == [True] * TYPED_STEPS + [False] * (len(got) - TYPED_STEPS)
    loss_diff, norm_diff = check_parity(got, config_name, model="qwen3")
    print(f"\nqwen3 spmd_types {config_name}: max rel diff loss {loss_diff:.1e} grad_norm {norm_diff:.1e}")
