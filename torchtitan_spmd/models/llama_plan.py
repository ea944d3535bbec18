"""The Llama sharding plan: Megatron-style TP with sequence parallel and loss parallel.

Written once, interpreted by every backend (``torchtitan_spmd.distributed.<backend>``):

- colwise ``wq``/``wk``/``wv``/``w1``/``w3`` (weight ``S(0)@tp``), rowwise ``wo``/``w2``
  (weight ``S(1)@tp``, partial output reduced to the residual layout);
- sequence-parallel norms (input and output ``S(1)@tp``, weight replicated);
- vocab-parallel ``output`` (weight ``S(0)@tp``, logits ``S(2)@tp``) for loss parallel;
- replicated RoPE tables and a replicated token embedding;
- attention's SDPA kernel runs on local shards (heads ``S(1)@tp``).

With sequence parallel off, the residual stream is replicated (``R@tp``) instead of
``S(1)@tp``, and rowwise outputs are all-reduced instead of reduce-scattered.
"""

from __future__ import annotations

from torchtitan_spmd.distributed.layout import P, S, SpmdLayout
from torchtitan_spmd.distributed.plan import ModulePlan, Redistribute, ShardingPlan

__all__ = ["llama_plan"]


def llama_plan(*, sequence_parallel: bool = True) -> ShardingPlan:
    """The TP plan of :class:`torchtitan_spmd.models.llama.Transformer`."""
    replicated = SpmdLayout()
    residual = SpmdLayout({"tp": S(1)}) if sequence_parallel else replicated
    features = SpmdLayout({"tp": S(2)})  # [batch, seq, features/tp]
    heads = SpmdLayout({"tp": S(1)})  # [batch, heads/tp, seq, head_dim]
    partial = SpmdLayout({"tp": P})
    colwise = ModulePlan(params={"weight": SpmdLayout({"tp": S(0)})}, inputs=(replicated,), output=features)
    rowwise = ModulePlan(
        params={"weight": SpmdLayout({"tp": S(1)})},
        inputs=(features,),
        output=Redistribute(partial, residual),
    )
    norm = ModulePlan(params={"weight": replicated}, inputs=(residual,), output=residual)
    gather_residual = Redistribute(residual, replicated)
    return ShardingPlan(
        modules={
            "": ModulePlan(params={"rope_cos": replicated, "rope_sin": replicated}),
            "tok_embeddings": ModulePlan(
                params={"weight": replicated},
                inputs=(replicated,),
                output=Redistribute(replicated, residual),
            ),
            "layers.*.attention_norm": norm,
            "layers.*.ffn_norm": norm,
            "layers.*.attention": ModulePlan(
                inputs=(gather_residual, replicated, replicated), output=residual
            ),
            "layers.*.attention.wq": colwise,
            "layers.*.attention.wk": colwise,
            "layers.*.attention.wv": colwise,
            "layers.*.attention.sdpa": ModulePlan(
                inputs=(heads, heads, heads), output=heads, local_compute=True
            ),
            "layers.*.attention.wo": rowwise,
            "layers.*.feed_forward": ModulePlan(inputs=(gather_residual,), output=residual),
            "layers.*.feed_forward.w1": colwise,
            "layers.*.feed_forward.w3": colwise,
            "layers.*.feed_forward.w2": rowwise,
            "norm": norm,
            "output": ModulePlan(
                params={"weight": SpmdLayout({"tp": S(0)})},
                inputs=(gather_residual,),
                output=SpmdLayout({"tp": S(2)}),
            ),
        },
        mesh_axes=("tp",),
        output_module="output",
        fsdp_units=("layers.*",),
    )
