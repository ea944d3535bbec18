"""Layer 2: SpmdLayout, the one layout language of every backend."""

from __future__ import annotations

import pytest
import spmd_types
from torch.distributed.tensor import Partial, Replicate, Shard

from torchtitan_spmd.distributed.layout import I, P, R, S, V, spmd_layout_to_dtensor_placements
from torchtitan_spmd.distributed.parallel_dims import MeshAxisName, SpmdLayout


def test_unlisted_axes_are_replicated() -> None:
    layout = SpmdLayout({"tp": S(0)})
    assert layout.per_axis_spmd_types() == {"tp": S(0)}
    assert layout.placements(["dp", "tp"]) == (Replicate(), Shard(0))
    assert layout.shard_dims() == {"tp": 0}


def test_placements_per_type() -> None:
    layout = SpmdLayout({"dp": S(0), "tp": P, "cp": I})
    assert layout.placements(["dp", "cp", "tp", "ep"]) == (Shard(0), Replicate(), Partial(), Replicate())


def test_partition_spec_shards_one_dim_over_two_axes_in_order() -> None:
    layout = SpmdLayout({"dp": V, "tp": V}, partition_spec=(("dp", "tp"), None))
    assert layout.shard_order(0) == ("dp", "tp") and layout.shard_order(1) == ()
    assert layout.placements(["dp", "tp"]) == (Shard(0), Shard(0))
    with pytest.raises(ValueError, match="mesh orders those axes"):
        layout.placements(["tp", "dp"])


def test_spec_axes_default_to_varying() -> None:
    layout = SpmdLayout(partition_spec=(None, "tp"))
    assert layout.per_axis_spmd_types() == {"tp": S(1)}
    assert layout.shard_dims() == {"tp": 1}


def test_shard_mixed_with_spec_is_an_error() -> None:
    with pytest.raises(ValueError, match="S\\(0\\) and a partition_spec"):
        SpmdLayout({"tp": S(0)}, partition_spec=("dp",))


def test_two_axes_on_one_dim_need_a_spec() -> None:
    with pytest.raises(ValueError, match="both shard tensor dim 0; give a partition_spec"):
        SpmdLayout({"dp": S(0), "tp": S(0)})


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        ({"axis_types": {"tp": "S(0)"}}, TypeError, "expected one of spmd_types R, I, V, P or S(dim)"),
        ({"axis_types": {0: R}}, TypeError, "mesh axes must be names (str) or spmd_types MeshAxis objects, got int 0"),
        ({"axis_types": ["tp"]}, TypeError, "must be a mapping"),
        ({"axis_types": {"tp": R}, "partition_spec": ("tp",)}, ValueError, "spec axes must be V"),
        ({"partition_spec": ("tp", "tp")}, ValueError, "appears twice"),
        ({"partition_spec": (3,)}, TypeError, "partition_spec[0]"),
    ],
)
def test_validation(kwargs: dict, exc: type[Exception], needle: str) -> None:
    with pytest.raises(exc) as err:
        SpmdLayout(**kwargs)
    assert needle in str(err.value)


def test_keys_from_spmd_types_get_local_type() -> None:
    """Upstream b5bcd76 builds ``SpmdLayout(axis_types=spmd.get_local_type(buf), ...)`` itself.

    (``protocols/module.py``, across ``to_empty``: its trainer stopped here under spmd_types.)
    The keys are spmd_types ``MeshAxis`` objects; a fake process group gives real ones.
    """
    import torch
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    from spmd_types import PartitionSpec, assert_type, get_local_type, normalize_axis
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = (normalize_axis(mesh.get_group(n)) for n in ("dp", "tp"))
        t = torch.zeros(4, 2)
        assert_type(t, {dp: R, tp: V}, partition_spec=PartitionSpec(tp, None))
        layout = SpmdLayout(axis_types=get_local_type(t), partition_spec=PartitionSpec(tp, None))
        assert dict(layout.axis_types) == {dp: R, tp: V} and layout.partition_spec == (tp, None)
    finally:
        dist.destroy_process_group()


def test_v_has_no_dtensor_placement() -> None:
    with pytest.raises(ValueError, match="V with no shard dim"):
        SpmdLayout({"tp": V}).placements(["tp"])


def test_frozen_and_hashable() -> None:
    a, b = SpmdLayout({"tp": S(0)}), SpmdLayout({"tp": S(0)})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != SpmdLayout({"tp": S(1)})
    with pytest.raises(AttributeError):
        a.types = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        a.types["tp"] = R  # type: ignore[index]


def test_with_types() -> None:
    layout = SpmdLayout({"tp": S(0), "dp": R})
    assert layout.with_types(tp=P) == SpmdLayout({"tp": P, "dp": R})
    spec = SpmdLayout(partition_spec=(("dp", "tp"), "cp"))
    assert spec.with_types(dp=V).partition_spec == spec.partition_spec


# ------------------------------------------------------------------ torchtitan's names
def test_axis_types_is_torchtitans_field_and_types_its_alias() -> None:
    layout = SpmdLayout(axis_types={"tp": S(0), "dp": R})
    assert layout.types is layout.axis_types
    assert dict(layout.axis_types) == {"tp": S(0), "dp": R}
    assert layout.axes() == ("tp", "dp")  # in the order given
    assert SpmdLayout(partition_spec=("tp",)).axes() == ()  # spec-only axes are not named


def test_per_axis_spmd_types_writes_spec_axes_as_shards() -> None:
    dp, cp, tp = MeshAxisName.DP, MeshAxisName.CP, MeshAxisName.TP
    layout = SpmdLayout({dp: R, cp: V, tp: V}, partition_spec=spmd_types.PartitionSpec(None, (cp, tp)))
    got = layout.per_axis_spmd_types()
    assert got == {"dp": R, "cp": S(1), "tp": S(1)}
    assert all(type(k) is MeshAxisName for k in got)  # the caller's key objects are kept
    # An axis only in the spec (implicitly V) is included too; S(d) types pass through.
    assert SpmdLayout(partition_spec=(None, None, "tp")).per_axis_spmd_types() == {"tp": S(2)}
    assert SpmdLayout({"tp": S(0), "cp": P}).per_axis_spmd_types() == {"tp": S(0), "cp": P}


def test_spmd_layout_to_dtensor_placements() -> None:
    spec = SpmdLayout({"tp": V}, partition_spec=spmd_types.PartitionSpec("tp"))
    assert spmd_layout_to_dtensor_placements(spec) == {"tp": Shard(0)}
    mixed = SpmdLayout({"dp": S(0), "cp": I, "tp": P})
    # the logical dp axis stands for both storage axes
    assert spmd_layout_to_dtensor_placements(mixed) == {
        "dp_replicate": Shard(0), "dp_shard": Shard(0), "cp": Replicate(), "tp": Partial(),
    }
    with pytest.raises(ValueError, match="axis 'tp' is V with no shard dim"):
        spmd_layout_to_dtensor_placements(SpmdLayout({"tp": V}))
