"""Layer 4: the spmd_types line gate (0.2.x, upstream b5bcd76's pin, vs 0.3.x).

On 0.2.x type checking is a setup error naming the installed version; on 0.3.x it is not.
The version is patched here; ``TORCHTITAN_SPMD_SPMD_TYPES=spmd-types==0.2.3 nox -s
cpu_tests -- --backend=spmd_types`` runs the whole layer on the real 0.2.3.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import torchtitan_spmd.distributed.representations.spmd_types as rep_module
from torchtitan_spmd.config import (
    ActivationCheckpointConfig,
    DebugConfig,
    JobConfig,
    ParallelismConfig,
)
from torchtitan_spmd.distributed import ParallelDims
from torchtitan_spmd.distributed.representation import get_representation

pytestmark = pytest.mark.backend("spmd_types")


def _validate(typechecking: bool) -> None:
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"

    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        pd = ParallelDims(1, 1, 1, 2, 1, 1, 2, spmd_backend="spmd_types", device_type="cpu")
        cfg = JobConfig(parallelism=ParallelismConfig(spmd_backend="spmd_types", tensor_parallel_degree=2),
                        debug=DebugConfig(spmd_typechecking=typechecking),
                        activation_checkpoint=ActivationCheckpointConfig(mode="none"))
        get_representation("spmd_types")(pd).validate(cfg)
    finally:
        dist.destroy_process_group()


def test_installed_line_is_read() -> None:
    text, numbers = rep_module.spmd_types_version()
    assert text.startswith(".".join(map(str, numbers[:2])))


def test_typechecking_on_0_2_is_a_setup_error_naming_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rep_module, "spmd_types_version", lambda: ("0.2.3", (0, 2, 3)))
    with pytest.raises(ValueError, match=r"spmd_typechecking=True needs spmd_types >= 0.3 \(installed: spmd-types 0.2.3\)"):
        _validate(True)
    _validate(False)  # untyped training is allowed on 0.2.x


def test_typechecking_on_0_3_passes_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rep_module, "spmd_types_version", lambda: ("0.3.1", (0, 3, 1)))
    _validate(True)
