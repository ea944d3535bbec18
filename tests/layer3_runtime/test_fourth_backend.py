"""A fourth backend is one representation module and one registry line, and it trains.

``toy`` (``toy_backend.py``: ``default``'s representation renamed) is registered with the
registry record of ``default`` under its own name and module; nothing else in the
library is told about it. It must then be a valid ``parallelism.spmd_backend`` in the
config, on the command line and in ``ParallelDims``, get ``default``'s meshes, and train
FSDP 2 x TP 2 on forked gloo ranks to the independent reference's losses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import grad_probe
import pytest
from parity_helpers import PARITY_CONFIGS, check_parity, job_config, warm_parent, with_trace

from torchtitan_spmd.config import (
    ConfigManager,
    DebugConfig,
    JobConfig,
    ParallelismConfig,
    backends,
)
from torchtitan_spmd.distributed.parallel_dims import ParallelDims
from torchtitan_spmd.launcher import run_forked, warm_worlds

pytestmark = pytest.mark.backend("default")  # it is default's runtime: run in that session


@pytest.fixture
def toy() -> Iterator[backends.Backend]:
    entry = backends.register_backend(  # the one registry line
        dataclasses.replace(backends.backend("default"), name="toy", module="toy_backend"))
    try:
        with warm_worlds(False):  # launches in fresh forks, which inherit the registration
            yield entry
    finally:
        backends.unregister_backend("toy")


def _train(rank: int, world: int, cfg: JobConfig) -> dict[str, object]:
    from torchtitan_spmd.train import Trainer

    trainer = Trainer(cfg)
    records = [(r.loss, r.grad_norm) for r in trainer.run()]
    rep = trainer.representation
    return {"records": records, "representation": type(rep).__name__, "distributed": type(rep).distributed,
            "meshes": trainer.parallel_dims._table is backends.backend("default").meshes}


def test_the_name_is_valid_everywhere_once_registered(toy: backends.Backend) -> None:
    assert backends.backend_names()[-1] == "toy"
    assert ParallelismConfig(spmd_backend="toy").spmd_backend == "toy"
    cfg = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_tiny",
                                      "--parallelism.spmd_backend", "toy"])
    assert cfg.parallelism.spmd_backend == "toy"
    assert ParallelDims(1, 1, 1, 1, 1, 1, 1, spmd_backend="toy", device_type="cpu").spmd_backend == "toy"
    # its record decides what it supports: no type checking, like default
    with pytest.warns(UserWarning, match=r"spmd_backend='toy'; only 'spmd_types' type-checks"):
        JobConfig(parallelism=ParallelismConfig(spmd_backend="toy"), debug=DebugConfig(spmd_typechecking=True))


def test_unregistered_it_is_an_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"parallelism\.spmd_backend: invalid value 'toy'; valid choices are "
                                         r"'default', 'full_dtensor', 'spmd_types'"):
        ParallelismConfig(spmd_backend="toy")
    with pytest.raises(ValueError, match="built in"):
        backends.unregister_backend("default")


def test_the_fourth_backend_trains(toy: backends.Backend) -> None:
    world, parallelism = PARITY_CONFIGS["fsdp2_tp2"]
    warm_parent()
    results = run_forked(grad_probe.probed(_train), world, job_config("toy", parallelism), timeout_s=300)
    per_rank = [r for r, _ in results]
    assert all(r == per_rank[0] for r in per_rank)  # every rank logged the same
    got = per_rank[0]
    assert got["representation"] == "ToyRepresentation" and got["distributed"] > 0 and got["meshes"]
    check_parity(with_trace(got["records"], [t for _, t in results]), "fsdp2_tp2")
