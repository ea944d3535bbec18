"""The fork's root config, shaped as upstream's ``Trainer.Config``: root ``dump_folder`` plus sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torchtitan_spmd.config import CompileConfig, ParallelismConfig, TrainingConfig


@dataclass(kw_only=True)
class GraphCompileConfig(CompileConfig):
    """A fork's subclass of a library section with its own fields (as upstream's graph_trainer)."""

    mode: Literal["jit", "aot"] = "jit"
    """How the graph is captured."""

    passes: list[str] = field(default_factory=list)
    """Graph passes to run."""

    def __post_init__(self) -> None:
        super().__post_init__()  # the library's checks of the inherited fields, and the types
        self._require(len(set(self.passes)) == len(self.passes), "passes", "must not repeat a pass")


@dataclass(kw_only=True)
class ForkTrainerConfig:
    """Upstream-style root: fields at the top level, not under ``job``."""

    dump_folder: str = "./outputs"
    """Where outputs go (upstream's root field)."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
