"""Layer 2: ParallelDims validation errors and mesh-lookup errors, with their messages."""

from __future__ import annotations

import re

import pytest

from torchtitan_spmd.distributed import ParallelDims
from torchtitan_spmd.distributed.parallel_dims import ParallelDimsError

BACKENDS = ("default", "full_dtensor", "spmd_types")


def dims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=None, **kw) -> ParallelDims:
    if world_size is None:
        world_size = max(1, dp_replicate * max(dp_shard, 1) * cp * tp * pp)
    return ParallelDims(dp_replicate, dp_shard, cp, tp, pp, ep, world_size, device_type="cpu", **kw)


@pytest.mark.parametrize("name", ["dp_replicate", "cp", "tp", "pp", "ep", "world_size"])
@pytest.mark.parametrize("value", [0, -1, -3])
def test_degree_below_one(name: str, value: int) -> None:
    kwargs = {"world_size": 4, "dp_shard": -1, name: value}
    with pytest.raises(ParallelDimsError, match=rf"{name} must be >= 1, got {value}\."):
        dims(**kwargs)


@pytest.mark.parametrize("value", [0, -2])
def test_dp_shard_only_minus_one_infers(value: int) -> None:
    with pytest.raises(ValueError, match=rf"dp_shard must be >= 1, or -1 to infer it, got {value}\."):
        dims(dp_shard=value, world_size=4)


def test_invalid_degrees_are_value_errors_that_upstream_asserts_catch() -> None:
    """torchtitan asserts its degrees; code (and tests) that catch AssertionError keep working."""
    for bad in (dict(dp_replicate=0), dict(dp_shard=0), dict(dp_shard=2, world_size=3),
                dict(dp_shard=-1, tp=3, world_size=8), dict(dp_shard=2, ep=3)):
        with pytest.raises(ValueError) as as_value:
            dims(**bad)
        with pytest.raises(AssertionError):
            dims(**bad)
        assert type(as_value.value) is ParallelDimsError, bad


def test_dp_shard_inferred() -> None:
    pd = dims(dp_replicate=2, dp_shard=-1, cp=2, tp=2, pp=2, world_size=64)
    assert pd.dp_shard == 4


def test_product_must_equal_world_size_and_lists_every_factor() -> None:
    with pytest.raises(ValueError) as err:
        dims(dp_replicate=2, dp_shard=3, cp=5, tp=2, pp=7, world_size=8)
    msg = str(err.value)
    for factor in ("dp_replicate (2)", "dp_shard (3)", "cp (5)", "tp (2)", "pp (7)", "= 420", "world_size is 8"):
        assert factor in msg, msg
    assert "ep is not a factor" in msg


def test_dp_shard_cannot_be_inferred() -> None:
    with pytest.raises(ValueError, match=re.escape("cannot infer dp_shard (-1)")) as err:
        dims(dp_shard=-1, tp=3, world_size=8)
    assert "tp (3)" in str(err.value) and "world_size (8)" in str(err.value)


def test_ep_is_not_a_factor_but_must_divide_dp_shard_cp_tp() -> None:
    pd = dims(dp_shard=2, tp=2, ep=4)  # ep reuses the 4 ranks of dp_shard*tp
    assert pd.world_size == 4
    with pytest.raises(ValueError, match=re.escape("ep (3) must divide dp_shard * cp * tp = 2 * 1 * 2 = 4")) as info:
        dims(dp_shard=2, tp=2, ep=3)
    # upstream b5bcd76 rejects it too, in these words (its test_parallel_dims.py matches them)
    assert "expert_parallel_degree (3) must divide dp_shard * cp * tp (4)" in str(info.value)
    with pytest.raises(ValueError, match=re.escape("ep (8) must divide")):
        dims(dp_shard=2, tp=2, ep=8)


def test_unknown_backend_lists_valid_ones() -> None:
    with pytest.raises(ValueError) as err:
        dims(spmd_backend="spmd_type")
    msg = str(err.value)
    assert "ParallelDims: spmd_backend: invalid value 'spmd_type'" in msg
    assert "'default', 'full_dtensor', 'spmd_types'" in msg
    assert "Did you mean 'spmd_types'?" in msg
    pd = dims()
    with pytest.raises(ValueError, match="spmd_backend: invalid value 'dtensor'"):
        pd.spmd_backend = "dtensor"
    assert dims(spmd_backend="partial_dtensor").spmd_backend == "partial_dtensor"  # upstream b5bcd76's spelling, as written


def test_degrees_must_be_ints() -> None:
    with pytest.raises(TypeError, match="tp must be an int, got float 2.0"):
        dims(tp=2.0, world_size=2)


@pytest.mark.parametrize(
    ("backend", "bad", "valid"),
    [
        ("default", "dp_shard", "'fsdp'"),
        ("full_dtensor", "fsdp", "'dp_shard'"),
        ("spmd_types", "fsdp", "'dp'"),
    ],
)
def test_unknown_mesh_name_lists_valid_names(backend: str, bad: str, valid: str) -> None:
    pd = dims(dp_shard=2, tp=2, spmd_backend=backend)
    with pytest.raises(ValueError) as err:
        pd.get_optional_mesh(bad)
    msg = str(err.value)
    assert f"Invalid mesh dim: {bad!r} under spmd_backend={backend!r}" in msg  # torchtitan's words
    assert valid in msg and "'tp'" in msg and "'efsdp'" in msg
    with pytest.raises(ValueError, match="Invalid mesh dim: 'tpp'.*Did you mean 'tp'"):
        pd.get_mesh(["tpp"])
    with pytest.raises(ValueError, match="repeat an axis"):
        pd.get_optional_mesh(["tp", "tp"])
    with pytest.raises(ValueError, match="no mesh axis requested"):
        pd.get_optional_mesh([])


@pytest.mark.parametrize("backend", BACKENDS)
def test_unavailable_mesh(fake_pg, backend: str) -> None:
    fake_pg(4)
    pd = dims(dp_shard=2, tp=2, spmd_backend=backend)  # cp == 1: inactive
    assert pd._single_axis_meshes == {}  # nothing built yet
    assert pd.get_optional_mesh("cp") is None
    assert pd._single_axis_meshes  # get_optional_mesh built the meshes (as torchtitan's)
    assert pd.get_optional_mesh(["cp", "tp"]) is None
    assert pd.get_activated_mesh("cp") is None
    with pytest.raises(ValueError, match=r"Mesh 'cp' is not available .* inactive axes cp \(size 1\)"):
        pd.get_mesh("cp")
    with pytest.raises(ValueError, match=r"inactive axes ep \(size 1\), efsdp \(size 4\)"):
        pd.get_mesh(["ep", "efsdp"])


@pytest.mark.backend("full_dtensor")
def test_resolve_mesh_full_dtensor_requires_a_complete_mesh(fake_pg) -> None:
    fake_pg(8)
    pd = dims(dp_shard=2, cp=2, tp=2, spmd_backend="full_dtensor")
    assert pd.resolve_mesh(["dp", "cp", "tp"]).mesh_dim_names == ("dp_shard", "cp", "tp")
    with pytest.raises(ValueError) as err:
        pd.resolve_mesh(["dp", "tp"])  # leaves out the active cp axis
    msg = str(err.value)
    assert "resolved to axes ('dp_shard', 'tp')" in msg
    assert "not one of the SPMD meshes of spmd_backend='full_dtensor'" in msg
    assert "('dp_shard', 'cp', 'tp')" in msg
    # default's name, not this backend's: dropped (as torchtitan), leaving tp alone
    with pytest.raises(ValueError, match=r"resolved to axes \('tp',\), which is not one of the SPMD"):
        pd.resolve_mesh(["fsdp", "tp"])
