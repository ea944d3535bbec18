"""The Llama 3 sharding plan: the decoder plan (:mod:`torchtitan_spmd.models.decoder_plan`) as it is."""

from __future__ import annotations

from torchtitan_spmd.distributed.plan import ShardingPlan
from torchtitan_spmd.models.decoder_plan import decoder_plan

from .model import LlamaConfig

__all__ = ["llama3_plan"]


def llama3_plan(config: LlamaConfig | None = None, *, sequence_parallel: bool = True,
                loss_parallel: bool = True) -> ShardingPlan:
    """The TP plan of :class:`~torchtitan_spmd.models.llama3.model.Transformer` (any flavour)."""
    return decoder_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                        tied=config is not None and config.enable_weight_tying)
