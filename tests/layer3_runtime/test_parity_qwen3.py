"""Layer 3 parity for the second model family: qwen3 (QK RMSNorm per head) under both backends.

The same harness, reference and tolerances as ``test_parity.py`` (real forked gloo ranks,
fp32, deterministic, 10 steps of the tiny flavour, against the independent reference on
the same global batch), on a subset of the layouts: FSDP 2 x TP 2 and TP 2 + SP.
"""

from __future__ import annotations

import pytest
from parity_helpers import (
    PARITY_CONFIGS,
    QWEN3_CONFIGS,
    check_parity,
    job_config,
    reference,
    run_config,
    skip_full_dtensor_on_old_torch,
)

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("config_name", QWEN3_CONFIGS)
@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_qwen3_parity_with_the_reference(backend: str, config_name: str) -> None:
    skip_full_dtensor_on_old_torch(backend, config_name)
    world, parallelism = PARITY_CONFIGS[config_name]
    got = run_config(job_config(backend, parallelism, model="qwen3"), world)
    loss_diff, norm_diff = check_parity(got, config_name, model="qwen3")
    print(f"\nqwen3 {backend} {config_name}: max rel diff loss {loss_diff:.1e} grad_norm {norm_diff:.1e}")


def test_qwen3_is_not_llama3() -> None:
    """The family really is selected by model.name: the two references differ."""
    qwen3, llama3 = reference(2, model="qwen3"), reference(2, model="llama3")
    assert abs(qwen3[0][0] - llama3[0][0]) > 1e-3 or abs(qwen3[0][1] - llama3[0][1]) > 1e-3
