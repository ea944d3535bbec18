"""Technique: the cross-entropy loss, vocab-parallel where the logits are vocab-sharded.

Written once for every representation, on local shards:

- the logits' layout is the plan's output layout: sharded on the last dim over an
  active axis (loss parallel on), the per-token losses come from
  :class:`VocabParallelCrossEntropy` (two all-reduces forward, none backward);
  otherwise from ``F.cross_entropy`` on the full local vocabulary;
- ``loss = (sum of this rank's per-token losses) / (global count of non-ignored
  labels)``: every rank's loss is its share of the global mean, so the global
  mean is their *sum* over the data-parallel ranks, and FSDP sums (never
  averages) gradients;
- :func:`global_loss_value` is that sum, the same float on every rank.

Under gradient accumulation the denominator is the count over the whole global
batch (every microbatch of every data-parallel rank, :func:`global_token_count`),
passed in as ``token_count``: the microbatch losses then add up to the global mean,
and so do their gradients.

Packed documents (``attn_mask_type="block_causal"``): :func:`mask_document_boundaries` ignores
the label of each EOS token, the next document's first token, as upstream HEAD (#4075) does
(there the dataset shifts inputs and labels within each document, so no input predicts across
a boundary; here the EOS stays an input, attends within its own document, and its label is
ignored: the same pairs count).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_spmd.distributed.layout import SpmdLayout
from torchtitan_spmd.distributed.representation import TensorRepresentation

__all__ = [
    "IGNORE_INDEX",
    "VocabParallelCrossEntropy",
    "cross_entropy_loss",
    "cross_entropy_per_token",
    "global_loss_value",
    "global_token_count",
    "mask_document_boundaries",
    "vocab_parallel_cross_entropy",
]

#: Labels equal to this are ignored (torch's default).
IGNORE_INDEX = -100


def mask_document_boundaries(labels: torch.Tensor, tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``labels`` with :data:`IGNORE_INDEX` wherever the input token is ``eos_id`` (a new tensor):
    the prediction that crosses a document boundary, from one document's EOS to the next one's
    first token, is not trained (upstream #4075)."""
    return labels.masked_fill(tokens == eos_id, IGNORE_INDEX)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocab-sharded logits, on local tensors.

    ``logits``: ``[..., V_local]`` (this rank's contiguous vocab chunk in ``torch.chunk``
    order, like DTensor's ``Shard``, so uneven splits work); ``labels``: ``[...]`` global
    ids, the same on every rank of ``group``; rows whose label is ``ignore_index``
    give 0. Returns ``[...]`` float32 losses, identical on every rank of ``group``, so
    the backward needs no collective. Forward: one MAX all-reduce (row maxima and
    the chunk size) and one SUM all-reduce (exp-sums and target logits).
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor,
                group: dist.ProcessGroup, ignore_index: int) -> torch.Tensor:
        ctx.input_dtype, ctx.input_shape = logits.dtype, logits.shape
        out_shape = labels.shape
        logits, labels = logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1)
        n, v_local = logits.shape
        rank = dist.get_rank(group)
        # One MAX all-reduce: the row maxima and the chunk size (rank 0's, the largest).
        packed = torch.cat([
            logits.amax(dim=1) if v_local else logits.new_full((n,), float("-inf")),
            logits.new_tensor([float(v_local)]),
        ])
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
        # The chunk size stays a tensor (no host sync, nothing for torch.compile to break on).
        row_max, start = packed[:n], (packed[n] * rank).to(labels.dtype)
        shifted = logits - row_max.unsqueeze(1)
        exp = shifted.exp()
        in_range = (labels >= start) & (labels < start + v_local)
        local_idx = torch.where(in_range, labels - start, torch.zeros_like(labels))
        target = shifted.gather(1, local_idx.unsqueeze(1)).squeeze(1) if v_local else shifted.new_zeros(n)
        target = torch.where(in_range, target, torch.zeros_like(target))
        sums = torch.stack([exp.sum(dim=1), target])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target = sums[0], sums[1]
        valid = labels != ignore_index
        loss = torch.where(valid, sum_exp.log() - target, torch.zeros_like(target))
        softmax = exp.div_(sum_exp.unsqueeze(1))
        ctx.save_for_backward(softmax, in_range & valid, local_idx, valid)
        return loss.view(out_shape)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, hit, local_idx, valid = ctx.saved_tensors
        grad = softmax.clone()
        if grad.shape[1]:
            grad.scatter_add_(1, local_idx.unsqueeze(1), -hit.to(grad.dtype).unsqueeze(1))
        grad.mul_((grad_out.reshape(-1) * valid.to(grad.dtype)).unsqueeze(1))
        return grad.to(ctx.input_dtype).view(ctx.input_shape), None, None, None

    @staticmethod
    def spmd_typecheck(out: torch.Tensor, *, logits: torch.Tensor, labels: torch.Tensor,
                       group: dist.ProcessGroup) -> None:
        """The ``spmd_types`` typing rule: vocab-sharded logits, invariant labels -> invariant losses."""
        import spmd_types as st

        st.assert_type(logits, {group: st.S(-1)})
        st.assert_type(labels, {group: st.I})
        st.assert_type_like(out, labels)


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                                 group: dist.ProcessGroup, *,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token losses ``[...]`` of vocab-sharded ``logits [..., V_local]`` (see the class)."""
    return VocabParallelCrossEntropy.apply(logits, labels, group, ignore_index)


def _vocab_group(representation: TensorRepresentation, logits_layout: SpmdLayout | None,
                 ndim: int) -> dist.ProcessGroup | None:
    """The group the logits' last dim is sharded over, or None (full vocabulary locally)."""
    mesh = representation.forward_mesh
    if mesh is None or logits_layout is None:
        return None
    names = mesh.mesh_dim_names or ()
    for axis, dim in logits_layout.shard_dims().items():
        if dim % ndim == ndim - 1 and axis in names and mesh.size(names.index(axis)) > 1:
            return mesh.get_group(axis)
    return None


def global_token_count(labels: Sequence[torch.Tensor], representation: TensorRepresentation) -> torch.Tensor:
    """The number of non-ignored labels in ``labels`` (this rank's microbatches) over every
    data-parallel rank: the denominator of the global mean loss (float32, equal on every rank)."""
    counts = [(representation.to_local(x) != IGNORE_INDEX).to(torch.float32).sum() for x in labels]
    local = counts[0]
    for count in counts[1:]:  # tensor + tensor only: the type checker rejects ``0 + P``
        local = local + count
    return representation.sum_over_batch(local)


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, representation: TensorRepresentation,
                       *, logits_layout: SpmdLayout | None,
                       token_count: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's share of the global mean cross-entropy (see the module docstring).

    ``logits_layout``: the plan's output layout
    (:meth:`~torchtitan_spmd.distributed.plan.ShardingPlan.output_layout`);
    ``token_count``: the global count of non-ignored labels the mean divides by
    (:func:`global_token_count`), by default that of ``labels`` alone.
    """
    logits, labels = representation.to_local(logits), representation.to_local(labels)
    # Per token over [batch, seq], never flattened: under context parallelism both dims
    # are sharded (on dp and cp), and no layout describes their flattening.
    group = _vocab_group(representation, logits_layout, logits.dim())
    if group is not None:
        per_token = vocab_parallel_cross_entropy(logits, labels, group)
    else:
        per_token = cross_entropy_per_token(logits, labels)
    total = per_token.sum()
    if token_count is None:
        token_count = global_token_count([labels], representation)
    return total / token_count


def cross_entropy_per_token(logits: torch.Tensor, labels: torch.Tensor, *,
                            ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token cross-entropy ``[...]`` of full-vocabulary ``logits [..., V]`` (float32).

    ``F.cross_entropy(..., reduction="none")``'s values, bit for bit, without flattening
    the leading dims (0 where the label is ``ignore_index``).
    """
    logp = logits.float().log_softmax(-1)
    valid = labels != ignore_index
    picked = logp.gather(-1, torch.where(valid, labels, torch.zeros_like(labels)).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, -picked, torch.zeros_like(picked))


def global_loss_value(loss: torch.Tensor, representation: TensorRepresentation) -> float:
    """The global mean loss (the sum of every rank's share), the same float on every rank."""
    return float(representation.sum_over_batch(representation.to_local(loss.detach())))
