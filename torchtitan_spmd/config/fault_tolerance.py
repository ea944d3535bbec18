"""``[fault_tolerance]``: upstream's torchft section (a0c831c49, ``torchtitan/experiments/torchft``).

Upstream spreads it over two classes, ``TorchFTManager.Config`` (``enable`` ... ``semi_sync_method``)
and the experiment's ``FaultTolerance`` subclass (``sync_steps`` ... ``num_fragments``); this is
the two in one section, with upstream's field names, types, defaults and meaning, in upstream's
order. The runtime is :mod:`torchtitan_spmd.techniques.fault_tolerance` (torchft is the optional
extra ``.[ft]``); ``docs/fault_tolerance.md`` says how to launch replica groups.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from ._section import Section, invalid_choice

__all__ = ["FT_PROCESS_GROUPS", "FT_SEMI_SYNC_METHODS", "FaultToleranceConfig"]

#: Upstream's ``process_group`` values (``TorchFTManager.__init__``); its type is a plain ``str``.
FT_PROCESS_GROUPS: tuple[str, ...] = ("gloo", "nccl", "mccl")

#: Upstream's ``semi_sync_method`` values (compared lower-cased, as upstream does).
FT_SEMI_SYNC_METHODS: tuple[str, ...] = ("local_sgd", "diloco")


@dataclass(kw_only=True)
class FaultToleranceConfig(Section):
    """``[fault_tolerance]``: torchft replica groups that keep training when one dies (upstream's
    ``FaultTolerance``). Each replica group is its own launch; the data-parallel replicate axis
    across the groups is torchft's managed process group, coordinated by a Lighthouse
    (``TORCHFT_LIGHTHOUSE``)."""

    section_name: typing.ClassVar[str] = "fault_tolerance"

    enable: bool = False
    """Enable torchft: this launch is one replica group (``replica_id`` of ``group_size``); the
    replicate axis across groups is torchft's managed one, and the in-launch
    ``parallelism.data_parallel_replicate_degree`` must stay 1. Needs ``pip install -e ".[ft]"``."""

    process_group: str = "gloo"
    """The process group of the replicate axis across groups: ``"gloo"`` (CPU tensors) or
    ``"nccl"`` (CUDA); upstream's ``"mccl"`` needs torchcomms, which this library does not ship."""

    process_group_timeout_ms: int = 10000
    """Every operation of the cross-group process group (and torchft's manager RPCs) aborts after
    this long; a group that stops answering is dropped from the next quorum."""

    replica_id: int = 0
    """This launch's replica group id, ``0 <= replica_id < group_size``."""

    group_size: int = 0
    """The number of replica groups (the largest replicate size: live groups may be fewer). The
    data is split over ``group_size`` times the in-group data-parallel degree."""

    min_replica_size: int = 1
    """The fewest live groups a step may commit with."""

    semi_sync_method: str | None = None
    """None: every step synchronises the gradients across groups. ``"local_sgd"`` or ``"diloco"``:
    torchft's semi-synchronous training, the groups average (LocalSGD) or take an outer optimizer
    step on the averaged pseudo-gradient (DiLoCo) every ``sync_steps`` steps."""

    sync_steps: int = 5
    """Steps between two synchronisations (semi-synchronous training only)."""

    should_quantize: bool = False
    """Quantize the pseudo-gradients before their all-reduce (semi-synchronous only; torchft
    quantizes with Triton, so on CPU it is a setup error)."""

    fragment_sync_delay: int = 0
    """Inner steps between issuing a fragment's all-reduce and waiting for it (Streaming DiLoCo's
    tau); 0: wait at once. Must be below ``sync_steps``."""

    fragment_update_alpha: float = 0.0
    """How a fragment mixes its local and its synchronised parameters: 0.0 (the default) takes
    the synchronised ones, so every group holds the same parameters after a sync."""

    module_fqns_per_model_fragment: list[list[str]] = field(default_factory=list)
    """DiLoCo's fragments by module name, one list per fragment, e.g.
    ``[["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]``; empty: ``num_fragments``."""

    num_fragments: int = 1
    """DiLoCo: split the model into this many fragments of consecutive blocks (when
    ``module_fqns_per_model_fragment`` is empty); their syncs are staggered over ``sync_steps``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.process_group not in FT_PROCESS_GROUPS:
            raise invalid_choice("fault_tolerance.process_group", self.process_group, FT_PROCESS_GROUPS)
        if self.semi_sync_method is not None and self.semi_sync_method.lower() not in FT_SEMI_SYNC_METHODS:
            raise invalid_choice("fault_tolerance.semi_sync_method", self.semi_sync_method,
                                 (None, *FT_SEMI_SYNC_METHODS))
        self._require(self.process_group_timeout_ms > 0, "process_group_timeout_ms", "must be > 0")
        self._require(self.group_size >= 0, "group_size", "must be >= 0")
        self._require(self.replica_id >= 0, "replica_id", "must be >= 0")
        self._require(self.min_replica_size >= 1, "min_replica_size", "must be >= 1")
        self._require(self.sync_steps >= 1, "sync_steps", "must be >= 1")
        self._require(self.num_fragments >= 1, "num_fragments", "must be >= 1")
        self._require(0 <= self.fragment_sync_delay < self.sync_steps, "fragment_sync_delay",
                      f"must be >= 0 and below fault_tolerance.sync_steps (= {self.sync_steps})")
        self._require(0.0 <= self.fragment_update_alpha <= 1.0, "fragment_update_alpha", "must be in [0, 1]")
        if self.enable:
            self._require(self.group_size >= 1, "group_size",
                          "must be >= 1 with fault_tolerance.enable (the number of replica groups)")
            self._require(self.replica_id < self.group_size, "replica_id",
                          f"must be below fault_tolerance.group_size (= {self.group_size})")
            self._require(self.min_replica_size <= self.group_size, "min_replica_size",
                          f"must be <= fault_tolerance.group_size (= {self.group_size})")
