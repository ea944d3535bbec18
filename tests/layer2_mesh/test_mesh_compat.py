"""Layer 2: the DeviceMesh internals across torch versions (``distributed/_mesh_compat.py``).

The meshes themselves are checked against the spec by the other layer-2 tests on
whichever torch runs them (``TORCHTITAN_SPMD_TORCH=torch==2.11.0 nox -s cpu_tests``
for the fallback). Here: our views agree with what torch's own public-ish mesh
operations (``_flatten``, ``_unflatten``) build for the same ranks, and a torch
without the internals is refused with the version it needs.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from torchtitan_spmd.distributed import ParallelDims, _mesh_compat


@pytest.mark.parametrize("backend", ["default", "full_dtensor", "spmd_types"])
def test_views_match_torch_flatten_and_unflatten(fake_pg, backend: str) -> None:
    # 32 ranks: every base axis but pp > 1; ep=4 spans tp and half of cp.
    fake_pg(32, 21)
    pd = ParallelDims(2, 2, 2, 2, 2, 4, 32, spmd_backend=backend, device_type="cpu")
    world = pd.build_mesh()
    torch_made = {
        "batch": world["dp_replicate", "dp_shard"]._flatten("t_batch"),
        "loss": world["dp_replicate", "dp_shard", "cp"]._flatten("t_loss"),
        "tp": world["tp"],
    }
    if backend == "default":
        torch_made["fsdp"] = world["dp_shard", "cp"]._flatten("t_fsdp")
    region = world["dp_shard", "cp", "tp"]._flatten("t_region")
    split = region._unflatten(0, (2, 4), ("t_efsdp", "t_ep"))
    # Flattened axes (registered as torch flattened meshes) compare with torch's _flatten.
    torch_made["efsdp"] = split["t_efsdp"]._flatten("t_efsdp_flat")
    torch_made["ep"] = split["t_ep"]._flatten("t_ep_flat")
    for name, theirs in torch_made.items():
        ours = pd.get_optional_mesh(name, include_singleton_axes=True)
        assert ours.mesh.tolist() == theirs.mesh.tolist(), name
        # Equal layouts: torch's own lookups (_flatten of the same ranks) accept ours.
        assert ours._layout == theirs._layout, (name, ours._layout, theirs._layout)
    # Multi-axis views: same layout as torch's slicing of the world mesh.
    data = pd.get_optional_mesh(["pp", "cp", "tp"], include_singleton_axes=True)
    assert data._layout == world["pp", "cp", "tp"]._layout


def test_layout_helpers_split_row_major() -> None:
    # An axis over 2 x 4 ranks with strides (8, 1), split into (4, 2): outer then inner.
    span = _mesh_compat.axis_layout((2, 4), (8, 1))
    outer, inner = _mesh_compat.split_axis(span, 4, 2)
    rank_map = torch.arange(16, dtype=torch.int)
    # Ranks of the split axes as torch's mesh machinery lays them out.
    mesh = _mesh_compat.mesh_layout([outer, inner]).remap_to_tensor(rank_map)
    assert mesh[0].tolist() == [[0, 1], [2, 3], [8, 9], [10, 11]]
    with pytest.raises(ValueError, match="cannot split an axis of 8 ranks into 3 x 2"):
        _mesh_compat.split_axis(span, 3, 2)


def test_a_torch_without_mesh_layouts_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed._mesh_layout", None)  # as on torch < 2.11
    spec = importlib.util.spec_from_file_location("_mesh_compat_probe", _mesh_compat.__file__)
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(ImportError) as err:
        spec.loader.exec_module(module)
    msg = str(err.value)
    assert "needs torch >= 2.11" in msg and f"found torch {torch.__version__}" in msg, msg
