"""Layer 2: the meshes' process groups on 4 and 8 real gloo ranks (forked).

dp_shard 2 x tp 2, with ep 1 and ep 2, under each backend: which ranks each axis
groups, which axes are real (gloo) and which fake, and an all-reduce on every
real axis (so a group shared by two views is a working group). On 8 ranks, four
shapes built one after the other in the same processes, against the spec: each
rank creates only its own groups, so this checks that the members of each group
found each other under one name (a wrong name hangs or mixes groups up), that
two groups over one rank set (a real and a fake one) stay apart, and that new
groups get the default group's timeout.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from mesh_spec_helpers import Cfg, expected_active, expected_groups

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
        # torchtitan's #4068: the 1-D meshes reported are those with a real group
        seen["one_d"] = sorted((n, dist.get_backend(m.get_group()), m.size())  # type: ignore[assignment]
                               for n, m in pd.get_all_one_dimensional_meshes().items())
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
            seen = dict(per_rank[index])
            # every real axis of size > 1, each on gloo; never fake-backed efsdp (size 4 at ep 1)
            assert seen.pop("one_d") == sorted(
                (n, "gloo", len(groups[rank])) for n, (real, groups) in expected.items()
                if real and len(groups[rank]) > 1
            ), (ep, rank)
            assert set(seen) == set(expected), (ep, rank)
            for name, (real, groups) in expected.items():
                pg_backend, ranks, total = seen[name]
                assert pg_backend == ("gloo" if real else "fake"), (ep, rank, name)
                assert ranks == groups[rank], (ep, rank, name)
                if real:
                    assert total == sum(groups[rank]), (ep, rank, name)


# 8 ranks, each built in turn in the same processes (so group names must stay apart):
# every axis is checked against the spec (mesh_spec_helpers), and every real one
# sums the ranks of its members.
WORLD8 = {
    # All of batch, loss, fsdp flattened over non-adjacent ranks; ep has tp's ranks
    # and efsdp dp_shard's (real groups shared by two axes).
    "dp_replicate2-dp_shard2-tp2-ep2": Cfg(dp_replicate=2, dp_shard=2, tp=2, ep=2),
    # efsdp (fake, ep = 1) has exactly the ranks of the real dp_shard / fsdp axis:
    # two groups over one rank set, a real and a fake one.
    "dp_replicate2-dp_shard4": Cfg(dp_replicate=2, dp_shard=4),
    # pp strided by 4; ep spans dp_shard * cp (the ranks of fsdp); efsdp real at size 1.
    "pp2-dp_shard2-cp2-ep4": Cfg(pp=2, dp_shard=2, cp=2, ep=4),
    # FSDP only: the data-parallel axes span the world, five axes have size 1.
    "dp_shard8": Cfg(dp_shard=8),
}


def _probe_world8(rank: int, world_size: int, backend: str) -> dict[str, dict[str, list]]:
    default_timeout = dist.distributed_c10d._get_default_group()._get_backend(
        torch.device("cpu")).options._timeout
    out: dict[str, dict[str, list]] = {}
    for key, cfg in WORLD8.items():
        pd = cfg.dims(backend)
        pd.build_mesh()
        seen: dict[str, list] = {}
        for name in pd.mesh_axis_names:
            group = pd.get_optional_mesh(name, include_singleton_axes=True).get_group()
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=group)  # a fake group leaves it as it is
            kind = dist.get_backend(group)
            timeout_ok = kind == "fake" or (
                group._get_backend(torch.device("cpu")).options._timeout == default_timeout)
            seen[name] = [kind, dist.get_process_group_ranks(group), t.item(), timeout_ok]
        out[key] = seen
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_axis_communicates_over_its_ranks_on_8_gloo_ranks(backend: str) -> None:
    results = run_forked(_probe_world8, 8, backend, timeout_s=120)
    for key, base in WORLD8.items():
        for rank, per_rank in enumerate(results):
            cfg = dataclasses.replace(base, rank=rank)
            groups, active = expected_groups(cfg), expected_active(cfg, backend)
            seen = per_rank[key]
            assert set(seen) == set(cfg.dims(backend).mesh_axis_names), (key, rank)
            for name, (kind, ranks, total, timeout_ok) in seen.items():
                where = (key, rank, name)
                assert kind == ("gloo" if active[name] else "fake"), where
                assert ranks == sorted(groups[name]), where
                # Real: the members' sum. Fake: nothing sent, the rank itself.
                assert total == (sum(groups[name]) if active[name] else rank), where
                assert timeout_ok, f"{where}: not the default group's timeout"
