"""An experiment whose root config holds a subclass of the library's CompileConfig (as upstream's graph_trainer)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.config import ForkTrainerConfig, GraphCompileConfig


@dataclass(kw_only=True)
class GraphTrainerConfig(ForkTrainerConfig):
    """The experiment's root: the fork's root with the compile section subclassed."""

    compile: GraphCompileConfig = field(default_factory=GraphCompileConfig)


def graph_debug() -> GraphTrainerConfig:
    """Compile through the fork's own section subclass."""
    return GraphTrainerConfig(compile=GraphCompileConfig(enable=True, passes=["fuse"]))
