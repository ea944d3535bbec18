"""The representation interface under the DTensor backends: layout-independent init through
the DTensor views (sharing storage), local regions with keyword arguments, upstream's names."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import closing

import pytest
from representation_helpers import (
    check_default_module_bodies_compute_on_local_shards,
    check_local_region_passes_keyword_arguments,
    check_views_match_single_process_init,
)

from torchtitan_spmd.config import JobConfig
from torchtitan_spmd.distributed.parallel_dims import ParallelDims
from torchtitan_spmd.distributed.utils import get_spmd_backend, get_train_context, set_spmd_backend


@pytest.mark.multiproc
@pytest.mark.parametrize(("config_name", "model"), [("tp2_sp", "llama3"), ("fsdp2_tp2", "llama3"),
                                                    ("fsdp2_tp2", "qwen3")])
@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_weights_are_the_single_process_ones_under_every_layout(backend: str, config_name: str,
                                                                model: str) -> None:
    kinds = check_views_match_single_process_init(backend, config_name, model)
    assert ("DTensor", "DTensor") in kinds  # the sharded states really are sharded


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_local_region_passes_keyword_arguments(backend: str) -> None:
    check_local_region_passes_keyword_arguments(backend)


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["default"])
def test_default_module_bodies_compute_on_local_shards(backend: str) -> None:
    check_default_module_bodies_compute_on_local_shards()


@pytest.fixture
def fake_world(fake_pg: Callable[[int], None]) -> Iterator[None]:
    """One fake rank; the process default backend restored afterwards."""
    fake_pg(1)
    try:
        yield
    finally:
        set_spmd_backend("default")


def test_train_context_follows_parallel_dims_not_the_process_default(fake_world: None) -> None:
    pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1,
                      spmd_backend="full_dtensor", device_type="cpu")
    pd.build_mesh()
    assert get_spmd_backend() == "default"
    set_spmd_backend("default")  # a fork's call; must not override what the dims say
    context = get_train_context(enable_loss_parallel=False, parallel_dims=pd)
    with context():
        assert get_spmd_backend() == "full_dtensor"
    assert get_spmd_backend() == "default"
    set_spmd_backend("full_dtensor")
    with get_train_context(enable_loss_parallel=False)():  # no dims: the process default
        assert get_spmd_backend() == "full_dtensor"
    with pytest.raises(ValueError, match="valid choices are"):
        set_spmd_backend("full")


def test_the_trainer_ignores_the_process_default(fake_world: None) -> None:
    """A trainer's backend is its config's, during setup and in every step, whatever was set globally."""
    from torchtitan_spmd.models import _REGISTERED, ModelSpec, get_model_spec, register_model_spec
    from torchtitan_spmd.train import Trainer

    seen: list[str] = []
    llama3 = get_model_spec("llama3")

    def build(config: object) -> object:
        seen.append(get_spmd_backend())  # what a fork's model code would read at build time
        return llama3.build(config)

    register_model_spec(ModelSpec(name="probe", flavors=llama3.flavors, build=build,
                                  sharding_plan=llama3.sharding_plan, validate=llama3.validate))
    try:
        set_spmd_backend("full_dtensor")
        cfg = JobConfig.from_dict({
            "model": {"name": "probe", "flavor": "tiny"},
            "training": {"steps": 1, "local_batch_size": 1, "seq_len": 16, "device": "cpu"},
            "parallelism": {"spmd_backend": "default", "data_parallel_shard_degree": 1},
        })
        with closing(Trainer(cfg)) as trainer:
            # every build (the model, and the meta copy the FLOPs count reads) sees the config's backend
            assert trainer.representation.name == "default" and seen and set(seen) == {"default"}
            built = len(seen)
            trainer.model.register_forward_pre_hook(lambda *_: seen.append(get_spmd_backend()))
            trainer.step(1)
        assert seen[built:] == ["default"]
        assert get_spmd_backend() == "full_dtensor"
    finally:
        _REGISTERED.pop("probe", None)
