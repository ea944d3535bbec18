"""The representation interface under spmd_types: layout-independent init through the DTensor
views of plain local shards (sharing storage), local regions with keyword arguments, and
upstream's get_train_context setting the forward mesh."""

from __future__ import annotations

import pytest
import spmd_helpers  # noqa: F401  (puts the layer-3 helpers on the path)
from representation_helpers import (
    check_local_region_passes_keyword_arguments,
    check_views_match_single_process_init,
)
from spmd_helpers import torch_at_least

pytestmark = pytest.mark.backend("spmd_types")


@pytest.mark.multiproc
@pytest.mark.parametrize(("config_name", "model"), [("tp2_sp", "llama3"), ("tp2_sp", "qwen3"),
                                                    ("fsdp2_tp2", "qwen3")])
def test_weights_are_the_single_process_ones_under_every_layout(config_name: str, model: str) -> None:
    if config_name == "fsdp2_tp2" and not torch_at_least("2.14"):
        pytest.skip("FSDP over spmd_types-annotated tensors needs torch >= 2.14")
    kinds = check_views_match_single_process_init("spmd_types", config_name, model)
    if config_name == "tp2_sp":  # no FSDP: plain typed shards, viewed as DTensors
        assert kinds == {("Parameter", "DTensor"), ("Tensor", "DTensor")}, kinds


@pytest.mark.multiproc
def test_local_region_passes_keyword_arguments() -> None:
    check_local_region_passes_keyword_arguments("spmd_types")


def test_get_train_context_sets_the_forward_mesh() -> None:
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"

    from torchtitan_spmd.distributed.parallel_dims import ParallelDims
    from torchtitan_spmd.distributed.representations.spmd_types.mesh_context import (
        current_spmd_mesh,
    )
    from torchtitan_spmd.distributed.utils import get_spmd_backend, get_train_context

    dist.init_process_group("fake", rank=0, world_size=4)
    try:
        pd = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=4,
                          spmd_backend="spmd_types", device_type="cpu")
        pd.build_mesh()
        with get_train_context(enable_loss_parallel=True, parallel_dims=pd)():
            mesh = current_spmd_mesh()
            assert mesh is not None and mesh.mesh_dim_names == ("dp", "tp")
            assert get_spmd_backend() == "spmd_types"
        assert current_spmd_mesh() is None
    finally:
        dist.destroy_process_group()
