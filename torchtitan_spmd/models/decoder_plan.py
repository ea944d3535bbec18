"""The sharding plan of a :class:`~torchtitan_spmd.models.common.Decoder`: Megatron TP + SP + loss parallel, CP.

Written once, applied by :mod:`torchtitan_spmd.distributed.apply_plan` under every backend:

- colwise ``wq``/``wk``/``wv``/``w1``/``w3`` (weight ``S(0)@tp``), rowwise ``wo``/``w2``
  (weight ``S(1)@tp``, partial output reduced to the residual layout);
- sequence-parallel norms (input and output ``S(1)@tp``, weight replicated);
- vocab-parallel ``output`` (weight ``S(0)@tp``, logits ``S(2)@tp``) with loss
  parallel; without it the logits are gathered to ``I@tp`` (every TP rank then
  computes the same loss);
- replicated RoPE tables; a vocab-parallel token embedding (``S(0)@tp``, tied or not: a tied
  model's table is the output's weight): each rank looks up the tokens its rows hold, a pending
  sum over ``tp`` reduced onto the residual stream (upstream's ``RowwiseParallel`` for an
  ``nn.Embedding``), so neither the table nor the output is whole on any TP rank;
- attention's SDPA kernel is a local region on local shards (heads ``S(1)@tp``);
- context parallelism: every activation is sequence-sharded on ``cp`` (``S(1)@cp``;
  heads-first ``S(2)@cp``), the SDPA kernel's queries, keys and values included: the
  kernel is the plan's ``attention``, whose body :mod:`torchtitan_spmd.techniques.context_parallel`
  replaces with ring attention, which exchanges the keys and values over ``cp`` itself
  (chunk by chunk; no gathered ``R@cp`` tensor crosses a boundary). With sequence
  parallelism the residual stream is sharded on the sequence by ``cp``, then by ``tp``.
  An axis of size 1 is ignored, so the plan is the same at every degree;
- pipeline stages pass the residual stream (the plan's ``stage_boundary``).

With sequence parallel off, the residual stream is replicated (``R@tp``) instead of
``S(1)@tp``, and rowwise outputs are all-reduced instead of reduce-scattered.
Families add the plans of their own modules (``extra``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from torchtitan_spmd.distributed.layout import I, P, S, SpmdLayout, V
from torchtitan_spmd.distributed.plan import ModulePlan, Redistribute, ShardingPlan

__all__ = ["HEADS", "decoder_plan", "moe_plan"]

#: Attention heads after the split ``[batch, seq/cp, heads/tp, head_dim]``.
HEADS = SpmdLayout({"cp": S(1), "tp": S(2)})


def decoder_plan(*, sequence_parallel: bool = True, loss_parallel: bool = True,
                 extra: Mapping[str, ModulePlan] | None = None, tied: bool = False) -> ShardingPlan:
    """The TP/SP/CP plan of a decoder, plus the family's ``extra`` module plans.

    The embedding (a :class:`~torchtitan_spmd.models.common.VocabShardedEmbedding`) is
    vocab-parallel (``S(0)@tp``), as the output (vocab-sharded logits ``S(2)@tp``, into loss
    parallel when it is on): a local region that looks up the tokens of this rank's rows (the
    others zero: a pending sum over ``tp``), reduce-scattered onto the residual stream
    (all-reduced without sequence parallelism). One mechanism for both: ``tied``
    (``enable_weight_tying``) changes nothing in the plan; the output projection's weight is then
    the embedding's, one tensor with one layout, and both uses' gradients add up in it.
    """
    replicated = SpmdLayout()
    sequence = SpmdLayout({"cp": S(1)})  # [batch, seq/cp, ...], replicated on tp
    # [batch, seq/(cp*tp), dim]: the sequence sharded by cp, then each cp slice by tp.
    residual = (SpmdLayout({"cp": V, "tp": V}, partition_spec=(None, ("cp", "tp"), None))
                if sequence_parallel else sequence)
    features = SpmdLayout({"cp": S(1), "tp": S(2)})  # [batch, seq/cp, features/tp]
    heads_first = SpmdLayout({"cp": S(2), "tp": S(1)})  # [batch, heads/tp, seq/cp, head_dim]
    partial = SpmdLayout({"cp": S(1), "tp": P})
    vocab = SpmdLayout({"cp": S(1), "tp": S(2)})  # [batch, seq/cp, vocab/tp]
    vocab_rows = SpmdLayout({"tp": S(0)})  # [vocab/tp, dim]: the output's weight (and a tied embedding's)
    colwise = ModulePlan(params={"weight": SpmdLayout({"tp": S(0)})}, inputs=(sequence,), output=features)
    rowwise = ModulePlan(
        params={"weight": SpmdLayout({"tp": S(1)})},
        inputs=(features,),
        output=Redistribute(partial, residual),
    )
    norm = ModulePlan(params={"weight": replicated}, inputs=(residual,), output=residual)
    gather_residual = Redistribute(residual, sequence)
    modules: dict[str, ModulePlan] = {
        "": ModulePlan(params={"rope_cos": replicated, "rope_sin": replicated}),
        "tok_embeddings": ModulePlan(
            params={"weight": vocab_rows, "vocab_ids": vocab_rows},
            inputs=(sequence,),
            output=Redistribute(partial, residual),
            local_compute=True,
        ),
        "layers.*.attention_norm": norm,
        "layers.*.ffn_norm": norm,
        # RoPE tables: [seq, head_dim/2] (replicated), or per token [batch, seq/cp, head_dim/2].
        "layers.*.attention": ModulePlan(inputs=(gather_residual, sequence, sequence), output=residual),
        "layers.*.attention.wq": colwise,
        "layers.*.attention.wk": colwise,
        "layers.*.attention.wv": colwise,
        "layers.*.attention.sdpa": ModulePlan(
            inputs=(heads_first, heads_first, heads_first), output=heads_first, local_compute=True
        ),
        "layers.*.attention.wo": rowwise,
        "layers.*.feed_forward": ModulePlan(inputs=(gather_residual,), output=residual),
        "layers.*.feed_forward.w1": colwise,
        "layers.*.feed_forward.w3": colwise,
        "layers.*.feed_forward.w2": rowwise,
        "norm": norm,
        "output": ModulePlan(
            params={"weight": vocab_rows},
            inputs=(gather_residual,),
            output=vocab if loss_parallel else Redistribute(vocab, SpmdLayout({"cp": S(1), "tp": I})),
        ),
        **(extra or {}),
    }
    return ShardingPlan(modules=modules, mesh_axes=("cp", "tp"), output_module="output", fsdp_units=("layers.*",),
                        attention=("layers.*.attention.sdpa",), stage_boundary=residual)


def moe_plan(plan: ShardingPlan, *, keep_dense: bool = False, shared_experts: bool = False) -> ShardingPlan:
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

    ``keep_dense``: the dense ``feed_forward`` entries stay too (a model whose first blocks are
    dense, DeepSeek-V3's ``first_k_dense_replace``). ``shared_experts``: the MoE blocks have
    DeepSeek's shared experts, tensor-parallel as the dense feed-forward (``w1``/``w3``
    column-wise, ``w2`` row-wise) inside the block's local region: their output is a pending sum
    over ``tp`` like the routed experts'.
    """
    dense = plan.modules["layers.*.feed_forward"]
    rowwise_out = plan.modules["layers.*.feed_forward.w2"].output
    assert isinstance(rowwise_out, Redistribute)
    partial = rowwise_out.src  # [batch, seq/cp, dim], a pending sum over tp
    modules = {k: v for k, v in plan.modules.items() if keep_dense or not k.startswith("layers.*.feed_forward")}
    modules["layers.*.moe"] = ModulePlan(inputs=dense.inputs, output=Redistribute(partial, dense.output),
                                         local_compute=True)
    # The experts' rows ([tokens routed, dim], sorted by expert) are partial over tp too, and, as
    # the block's tokens, vary over cp (each CP rank routes its own chunk of the sequence).
    rows_partial = SpmdLayout({"cp": S(0), "tp": P})
    modules["layers.*.moe.experts"] = ModulePlan(
        params={"w1": SpmdLayout({"tp": S(1)}), "w2": SpmdLayout({"tp": S(2)}), "w3": SpmdLayout({"tp": S(1)})},
        output=rows_partial,
    )
    if shared_experts:
        modules["layers.*.moe.shared_experts"] = ModulePlan(
            params={"w1": SpmdLayout({"tp": S(0)}), "w2": SpmdLayout({"tp": S(1)}), "w3": SpmdLayout({"tp": S(0)})},
            output=rows_partial,
        )
    return dataclasses.replace(plan, modules=modules)
