"""The Qwen3 sharding plan: the decoder plan plus the per-head QK norms.

The QK norms see the heads after the split, ``[batch, seq, heads/tp, head_dim]``
(``S(2)@tp``, whether or not sequence parallelism is on), and normalise over the
unsharded ``head_dim`` with a replicated scale: no collective. An MoE flavour's ``moe``
takes the dense ``feed_forward``'s boundaries as a local region (:func:`moe_plan`).
"""

from __future__ import annotations

import dataclasses

from torchtitan_spmd.distributed.layout import P, S, SpmdLayout
from torchtitan_spmd.distributed.plan import ModulePlan, Redistribute, ShardingPlan
from torchtitan_spmd.models.decoder_plan import HEADS, decoder_plan

from .model import Qwen3Config

__all__ = ["moe_plan", "qwen3_plan"]


def qwen3_plan(config: Qwen3Config | None = None, *, sequence_parallel: bool = True,
               loss_parallel: bool = True) -> ShardingPlan:
    """The TP plan of :class:`~torchtitan_spmd.models.qwen3.model.Qwen3Model` (any flavour)."""
    qk_norm = ModulePlan(params={"weight": SpmdLayout()}, inputs=(HEADS,), output=HEADS)
    plan = decoder_plan(
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        extra={"layers.*.attention.q_norm": qk_norm, "layers.*.attention.k_norm": qk_norm},
    )
    if config is None or not config.moe_enabled:
        return plan
    return moe_plan(plan)


def moe_plan(plan: ShardingPlan) -> ShardingPlan:
    """``plan`` with every block's dense ``feed_forward`` replaced by an MoE block (no expert parallelism).

    As upstream's MoE with ``ep = 1`` and ``tp > 1``: the block is a local region that sees
    every token of its data-parallel / context-parallel shard, gathered over ``tp`` (the dense
    feed-forward's input boundary); the router's gate is replicated, so every TP rank routes
    the same tokens to the same experts; each expert is tensor-parallel as a dense SwiGLU,
    ``w1``/``w3`` column-wise (``[E, hidden, dim]`` sharded on ``hidden``: ``S(1)@tp``) and ``w2``
    row-wise (``[E, dim, hidden]``: ``S(2)@tp``), so the block's output is a pending sum over
    ``tp`` (the row-wise ``w2``'s partial layout), reduced to the residual stream at the block's
    output, once for all experts. Every replicated tensor feeding that partial output (the
    gathered tokens, the gate) gets a partial gradient over ``tp``. The tokens-per-expert counts
    are the same on every TP rank and summed over the data ranks only
    (:func:`~torchtitan_spmd.techniques.moe.update_expert_bias`): counted once.
    """
    dense = plan.modules["layers.*.feed_forward"]
    rowwise_out = plan.modules["layers.*.feed_forward.w2"].output
    assert isinstance(rowwise_out, Redistribute)
    partial = rowwise_out.src  # [batch, seq/cp, dim], a pending sum over tp
    modules = {k: v for k, v in plan.modules.items() if not k.startswith("layers.*.feed_forward")}
    modules["layers.*.moe"] = ModulePlan(inputs=dense.inputs, output=Redistribute(partial, dense.output),
                                         local_compute=True)
    # The experts' rows ([tokens routed, dim], sorted by expert) are partial over tp too.
    rows_partial = SpmdLayout({"tp": P})
    modules["layers.*.moe.experts"] = ModulePlan(
        params={"w1": SpmdLayout({"tp": S(1)}), "w2": SpmdLayout({"tp": S(2)}), "w3": SpmdLayout({"tp": S(1)})},
        output=rows_partial,
    )
    return dataclasses.replace(plan, modules=modules)
