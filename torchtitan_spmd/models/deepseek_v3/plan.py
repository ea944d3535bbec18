"""The DeepSeek-V3 sharding plan: the decoder plan with MLA's projections, and the MoE blocks.

As upstream's ``deepseek_v3/sharding.py`` shards MLA under tensor parallelism: the low-rank
projections (``wkv_a``, ``wq_a``) and their norms (``kv_norm``, ``q_norm``) are replicated over
``tp``; the up-projections (``wq`` or ``wq_b``, ``wkv_b``) are column-wise, so each TP rank holds
``n_heads / tp`` whole heads; the shared rope key (one head) is replicated and expanded to the
local heads; ``wo`` is row-wise. Unlike the decoder plan, the attention is one local region (as an
MoE block) that sees the sequence gathered over ``tp`` and returns a pending sum over ``tp``: the
replicated projections feed only this rank's heads, so their gradients are pending sums over
``tp``, which a per-module boundary (replicated in, replicated out) cannot say under the DTensor
backends. The attention kernel (``sdpa``) stays the plan's ``attention``, whose body context
parallelism replaces (ring attention on the region's local tensors). The dense blocks (``first_k_dense_replace``) keep the decoder's
feed-forward plan; the MoE blocks get :func:`~torchtitan_spmd.models.decoder_plan.moe_plan`'s,
with the shared experts tensor-parallel inside the block's local region.
"""

from __future__ import annotations

import dataclasses

from torchtitan_spmd.distributed.layout import S, SpmdLayout
from torchtitan_spmd.distributed.plan import ModulePlan, Redistribute, ShardingPlan
from torchtitan_spmd.models.decoder_plan import decoder_plan, moe_plan

from .model import DeepSeekV3Config

__all__ = ["deepseek_v3_plan"]


def deepseek_v3_plan(config: DeepSeekV3Config | None = None, *, sequence_parallel: bool = True,
                     loss_parallel: bool = True) -> ShardingPlan:
    """The TP/SP/CP plan of :class:`~torchtitan_spmd.models.deepseek_v3.model.DeepSeekV3Model` (any flavour)."""
    base = decoder_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    modules = {k: v for k, v in base.modules.items()
               if k != "layers.*.attention" and not k.startswith("layers.*.attention.")}
    gathered = base.modules["layers.*.attention"].inputs  # the sequence gathered over tp, the RoPE tables
    wo_out = base.modules["layers.*.attention.wo"].output
    assert isinstance(wo_out, Redistribute)
    partial = wo_out.src  # [batch, seq/cp, dim], a pending sum over tp
    features = SpmdLayout({"cp": S(1), "tp": S(2)})
    colwise = ModulePlan(params={"weight": SpmdLayout({"tp": S(0)})}, output=features)
    q_lora = config is not None and config.q_lora_rank > 0
    modules.update({
        # One local region, as an MoE block: heads sharded over tp, its output a pending sum there.
        "layers.*.attention": ModulePlan(inputs=gathered, output=wo_out, local_compute=True),
        ("layers.*.attention.wq_b" if q_lora else "layers.*.attention.wq"): colwise,
        "layers.*.attention.wkv_b": colwise,
        "layers.*.attention.wo": ModulePlan(params={"weight": SpmdLayout({"tp": S(1)})}, output=partial),
    })
    plan = dataclasses.replace(base, modules=modules)
    if config is None or not config.moe_enabled:
        return plan
    return moe_plan(plan, keep_dense=config.first_k_dense_replace > 0, shared_experts=config.n_shared_experts > 0)


