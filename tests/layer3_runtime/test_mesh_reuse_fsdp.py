"""Layer 3: fully_shard(dp_mesh_dims=...) over the meshes successive trainers' ParallelDims hand out
(distributed/mesh_reuse.py): "different mesh objects" is what an equal mesh of an earlier layout
coming back from DTensor's caches makes it raise, the reason the caches used to be cleared for
every trainer. Ranks forked from a new interpreter, as in tests/layer2_mesh/test_mesh_reuse.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "layer2_mesh"))
from test_mesh_reuse import _pd, in_a_clean_interpreter, results_of  # noqa: E402 - the layer-2 cases' helpers

pytestmark = pytest.mark.multiproc


def _two_trainers_fully_shard(rank: int, world: int) -> list[float]:
    """fully_shard(dp_mesh_dims=...) on full_dtensor parameters, twice in one process: each model on
    the meshes its ParallelDims handed out (the first trainer's kept, then another layout's, then
    the first layout again)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from torchtitan_spmd.distributed.representation import get_representation

    out = []
    for tp in (2, 2, 1, 2):
        pd = _pd(tp=tp, dp_shard=4 // tp)
        pd.build_mesh()
        spec = get_representation("full_dtensor")(pd).fsdp_spec()
        assert spec is not None and spec.dp_mesh_dims is not None
        model = nn.Linear(4, 4, bias=False)
        model.weight = nn.Parameter(distribute_tensor(torch.eye(4), spec.mesh, [Replicate()] * spec.mesh.ndim))
        fully_shard(model, mesh=spec.mesh, dp_mesh_dims=spec.dp_mesh_dims)
        y = model(distribute_tensor(torch.ones(2, 4), spec.mesh, [Replicate()] * spec.mesh.ndim))
        out.append(float((y.full_tensor() if isinstance(y, DTensor) else y).sum()))
    return out


def test_fully_shard_gets_each_trainers_own_mesh_objects() -> None:
    """"different mesh objects" is what an equal mesh of an earlier layout coming back from the
    caches makes fully_shard raise (the reason the caches were cleared for every trainer)."""
    runs = in_a_clean_interpreter(__file__, {"_two_trainers_fully_shard": ()}, timeout_s=180)
    for out in results_of(runs, "_two_trainers_fully_shard"):
        assert out == [8.0] * 4, out
