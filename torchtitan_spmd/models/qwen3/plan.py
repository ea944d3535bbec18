"""The Qwen3 sharding plan: the decoder plan plus the per-head QK norms.

The QK norms see the heads after the split, ``[batch, seq, heads/tp, head_dim]``
(``S(2)@tp``, whether or not sequence parallelism is on), and normalise over the
unsharded ``head_dim`` with a replicated scale: no collective. An MoE flavour's ``moe``
takes the dense ``feed_forward``'s boundaries as a local region (:func:`moe_plan`).
"""

from __future__ import annotations

from torchtitan_spmd.distributed.layout import SpmdLayout
from torchtitan_spmd.distributed.plan import ModulePlan, ShardingPlan
from torchtitan_spmd.models.decoder_plan import HEADS, decoder_plan, moe_plan

from .model import Qwen3Config

__all__ = ["moe_plan", "qwen3_plan"]  # moe_plan: re-exported from decoder_plan


def qwen3_plan(config: Qwen3Config | None = None, *, sequence_parallel: bool = True,
               loss_parallel: bool = True) -> ShardingPlan:
    """The TP plan of :class:`~torchtitan_spmd.models.qwen3.model.Qwen3Model` (any flavour)."""
    qk_norm = ModulePlan(params={"weight": SpmdLayout()}, inputs=(HEADS,), output=HEADS)
    plan = decoder_plan(
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        tied=config is not None and config.enable_weight_tying,
        extra={"layers.*.attention.q_norm": qk_norm, "layers.*.attention.k_norm": qk_norm},
    )
    if config is None or not config.moe_enabled:
        return plan
    return moe_plan(plan)
