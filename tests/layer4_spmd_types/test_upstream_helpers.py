"""Layer 4: torchtitan's spmd_types helpers on this library's ``ParallelDims`` and layouts.

torchtitan's ``get_train_context`` and ``annotate_input_spmd_types`` (a0c831c49,
``torchtitan/distributed/utils.py`` and ``spmd_types.py``) read
``parallel_dims._global_meshes["spmd_dense_for_fwdbwd"]``, make it spmd_types' current
mesh and assert types keyed by ``MeshAxisName``. Here the same calls run on this
library's ``ParallelDims`` (torch's fake process group: types only). Also
``spmd_distribute_tensor``'s partition-spec order, against torchtitan's rule
(``test_partition_spec_order_controls_state_shard``), written out here.
"""

from __future__ import annotations

import pytest
import spmd_types as st
import torch

from torchtitan_spmd.distributed.parallel_dims import MeshAxisName, ParallelDims, SpmdLayout
from torchtitan_spmd.distributed.spmd_types import set_current_spmd_mesh, spmd_distribute_tensor

pytestmark = pytest.mark.backend("spmd_types")
DP, CP, TP = MeshAxisName.DP, MeshAxisName.CP, MeshAxisName.TP


@pytest.mark.parametrize(("degrees", "world"), [((1, 2, 2, 2), 8), ((2, 2, 1, 1), 4), ((1, 1, 1, 1), 1)])
def test_torchtitans_input_annotation_on_our_mesh(fake_world, degrees: tuple[int, ...], world: int) -> None:
    fake_world(world)
    dp_replicate, dp_shard, cp, tp = degrees
    pd = ParallelDims(dp_replicate, dp_shard, cp, tp, 1, 1, world, spmd_backend="spmd_types", device_type="cpu")
    pd.build_mesh()
    mesh = pd._global_meshes["spmd_dense_for_fwdbwd"]
    assert mesh.mesh_dim_names == ("dp", "cp", "tp")
    assert mesh.shape == (dp_replicate * dp_shard, cp, tp)  # size-1 axes kept, as torchtitan's
    tokens = torch.zeros(2, 8, dtype=torch.long)
    labels = torch.zeros(2, 8, dtype=torch.long)
    # annotate_input_spmd_types' body, verbatim in meaning: MeshAxisName keys, resolved
    # by spmd_types against the current mesh's dim names
    with set_current_spmd_mesh(mesh), st.set_current_mesh(mesh):
        st.assert_type(tokens, {DP: st.S(0), CP: st.S(1), TP: st.R})
        st.assert_type(labels, {DP: st.S(0), CP: st.S(1), TP: st.I})
    for tensor, tp_type in ((tokens, st.R), (labels, st.I)):
        typed = st.get_local_type(tensor)
        want = {mesh.get_group("dp"): st.V, mesh.get_group("cp"): st.V, mesh.get_group("tp"): tp_type}
        # spmd_types keeps only the axes with more than one rank
        assert typed == {st.MeshAxis.of(g): kind for g, kind in want.items() if g.size() > 1}


@pytest.mark.parametrize("order", [(DP, CP), (CP, DP)])
def test_spmd_distribute_tensor_follows_partition_spec_order(fake_world, order: tuple[MeshAxisName, ...]) -> None:
    weight = torch.arange(8, dtype=torch.float32).reshape(8, 1)
    layout = SpmdLayout({DP: st.V, CP: st.V}, partition_spec=st.PartitionSpec(order, None))
    seen = []
    for rank in range(4):
        fake_world(4, rank)
        pd = ParallelDims(1, 2, 2, 1, 1, 1, 4, spmd_backend="spmd_types", device_type="cpu")
        mesh = pd._global_meshes["spmd_dense_for_fwdbwd"] if pd.build_mesh() else None
        # torchtitan's rule: the shard index is mixed radix over the spec's axes, outermost first
        coord = {DP: mesh.get_local_rank("dp"), CP: mesh.get_local_rank("cp")}
        size = {DP: mesh.size(0), CP: mesh.size(1)}
        index = 0
        for axis in order:
            index = index * size[axis] + coord[axis]
        local = spmd_distribute_tensor(weight.clone(), mesh, layout)
        torch.testing.assert_close(local, weight.narrow(0, index * 2, 2))
        seen.append(local.flatten().tolist())
    assert sorted(seen) == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]  # every slice once


def test_spmd_distribute_tensor_shard_types_and_size_one_axes(fake_world) -> None:
    fake_world(4, 3)
    pd = ParallelDims(1, 2, 1, 2, 1, 1, 4, spmd_backend="spmd_types", device_type="cpu")
    pd.build_mesh()
    mesh = pd._global_meshes["spmd_dense_for_fwdbwd"]  # (dp 2, cp 1, tp 2); rank 3 = (1, 0, 1)
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    local = spmd_distribute_tensor(full, mesh, SpmdLayout({TP: st.S(1), CP: st.S(0), DP: st.R}))
    torch.testing.assert_close(local, full[:, 3:])  # cp has one rank: it does not shard
