"""Layer 2: the meshes' process groups on 4 real gloo ranks (forked).

dp_shard 2 x tp 2, with ep 1 and ep 2, under each backend: which ranks each axis
groups, which axes are real (gloo) and which fake, and an all-reduce on every
real axis (so a group shared by two views is a working group).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torchtitan_spmd.distributed import ParallelDims  # imported before forking: cheap ranks
from torchtitan_spmd.launcher import run_forked

BACKENDS = ("default", "full_dtensor", "spmd_types")

# Rank r has coordinates (dp_shard, tp) = divmod(r, 2): tp groups are contiguous
# ranks, dp_shard groups are strided by tp.
TP = [[0, 1], [0, 1], [2, 3], [2, 3]]
DP = [[0, 2], [1, 3], [0, 2], [1, 3]]
ALL = [[0, 1, 2, 3]] * 4
ALONE = [[0], [1], [2], [3]]


def _probe(rank: int, world_size: int, backend: str) -> list[dict[str, tuple[str, list[int], float]]]:
    out = []
    for ep in (1, 2):
        pd = ParallelDims(1, 2, 1, 2, 1, ep, world_size, spmd_backend=backend, device_type="cpu")
        pd.build_mesh()
        seen: dict[str, tuple[str, list[int], float]] = {}
        for name in pd.mesh_axis_names:
            mesh = pd.get_optional_mesh(name, include_singleton_axes=True)
            group = mesh.get_group()
            total = float("nan")
            if pd.is_axis_active(name):
                t = torch.tensor([float(rank)])
                dist.all_reduce(t, group=group)
                total = t.item()
            seen[name] = (dist.get_backend(group), dist.get_process_group_ranks(group), total)
        out.append(seen)
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", BACKENDS)
def test_process_group_ranks_on_gloo(backend: str) -> None:
    results = run_forked(_probe, 4, backend, timeout_s=120)
    for ep, index in ((1, 0), (2, 1)):
        expected = {
            # name: (real?, per-rank ranks)
            "pp": (False, ALONE),
            "dp_replicate": (False, ALONE),
            "cp": (False, ALONE),
            "tp": (True, TP),
            "batch": (True, DP),
            "loss": (True, DP),
            # ep splits the dp_shard*tp = 4 ranks into (efsdp, ep): ep innermost.
            "ep": (ep > 1, TP if ep == 2 else ALONE),
            "efsdp": (ep > 1, DP if ep == 2 else ALL),
        }
        expected.update(
            {
                "default": {"fsdp": (True, DP)},
                "full_dtensor": {"dp_shard": (True, DP)},
                "spmd_types": {"dp_shard": (True, DP), "dp": (True, DP)},
            }[backend]
        )
        for rank, per_rank in enumerate(results):
            seen = per_rank[index]
            assert set(seen) == set(expected), (ep, rank)
            for name, (real, groups) in expected.items():
                pg_backend, ranks, total = seen[name]
                assert pg_backend == ("gloo" if real else "fake"), (ep, rank, name)
                assert ranks == groups[rank], (ep, rank, name)
                if real:
                    assert total == sum(groups[rank]), (ep, rank, name)
