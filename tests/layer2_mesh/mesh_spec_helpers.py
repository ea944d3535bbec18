"""The layer-2 mesh spec, shared by the fake-PG and gloo tests: which ranks each axis groups.

Derived from the rules in the issue, independently of the code under test (no
``_mesh_compat``, no torch layout algebra): rank groups from a row-major
``arange(world).reshape(pp, dp_replicate, dp_shard, cp, tp)`` grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan_spmd.distributed import ParallelDims

BACKENDS = ("default", "full_dtensor", "spmd_types")
BASE = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Cfg:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    rank: int = 0  # the rank the fake process group simulates

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    def dims(self, backend: str) -> ParallelDims:
        return ParallelDims(
            self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, self.ep,
            self.world, spmd_backend=backend, device_type="cpu",
        )


def expected_groups(cfg: Cfg) -> dict[str, list[int]]:
    """The ordered ranks of ``cfg.rank``'s group on every axis."""
    grid = torch.arange(cfg.world).reshape(cfg.pp, cfg.dp_replicate, cfg.dp_shard, cfg.cp, cfg.tp)
    coord = [int(c) for c in (grid == cfg.rank).nonzero()[0]]

    def span(*axes: str) -> list[int]:
        index = tuple(slice(None) if BASE[i] in axes else coord[i] for i in range(5))
        return grid[index].flatten().tolist()

    groups = {name: span(name) for name in BASE}
    groups["batch"] = groups["dp"] = span("dp_replicate", "dp_shard")
    groups["loss"] = span("dp_replicate", "dp_shard", "cp")
    groups["fsdp"] = span("dp_shard", "cp")
    region = span("dp_shard", "cp", "tp")
    table = torch.tensor(region).reshape(len(region) // cfg.ep, cfg.ep)
    row, col = divmod(region.index(cfg.rank), cfg.ep)
    groups["ep"] = table[row].tolist()
    groups["efsdp"] = table[:, col].tolist()
    return groups


def expected_active(cfg: Cfg, backend: str) -> dict[str, bool]:
    """Whether each axis has a real process group under ``backend`` (else a fake one)."""
    sizes = {name: len(ranks) for name, ranks in expected_groups(cfg).items()}
    active = {name: size > 1 for name, size in sizes.items()}
    if backend == "default":
        active["fsdp"] = True
    else:
        active["dp_shard"] = True
    active["efsdp"] = cfg.ep > 1
    return active
