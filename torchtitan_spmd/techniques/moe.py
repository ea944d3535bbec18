"""Technique: the MoE load-balancing state between steps (upstream's ``_update_expert_bias``).

Each MoE block counts, in its forward, the tokens each expert got on this rank
(``tokens_per_expert``). After the optimizer step, :func:`update_expert_bias` sums the counts
of every block over the ranks holding different tokens (``representation.sum_over_batch``: the
data-parallel and context-parallel ranks), moves each ``expert_bias`` by
``load_balance_coeff * sign(mean - count)``, centred to mean zero, as upstream, and clears the
counts. The sums are the same on every rank, so the biases stay replicated. Under pipeline
parallelism each stage updates the blocks it holds, and the logged extremes are taken over
every stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_spmd.distributed.representation import TensorRepresentation
from torchtitan_spmd.models.moe import MoE

__all__ = ["ExpertLoad", "moe_blocks", "set_force_load_balance", "update_expert_bias"]


@dataclass(frozen=True)
class ExpertLoad:
    """Tokens per expert in the step just done, over all ranks, every MoE block pooled:
    the fewest any expert of any block got, and the most."""

    min: int
    max: int


def moe_blocks(model: nn.Module) -> list[MoE]:
    """The model's MoE modules, in model order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_force_load_balance(model: nn.Module, enabled: bool) -> None:
    """``debug.moe_force_load_balance``: every router assigns experts round-robin (as upstream).

    Raises ValueError when it is asked of a dense model, naming the MoE flavours.
    """
    blocks = moe_blocks(model)
    if enabled and not blocks:
        raise ValueError("debug.moe_force_load_balance=True needs a mixture-of-experts model, and this model is "
                         "dense; the MoE flavours: model.name='qwen3' with model.flavor 'moe_tiny' or "
                         "'debugmodel_moe'.")
    for moe in blocks:
        moe.router.force_load_balance = enabled


@torch.no_grad()
def update_expert_bias(model: nn.Module, representation: TensorRepresentation,
                       stage_group: dist.ProcessGroup | None = None) -> ExpertLoad | None:
    """After the optimizer step: the load-balancing update of every MoE block (see the module
    docstring); returns the step's :class:`ExpertLoad`, or None for a dense model. One all-reduce
    (over the data-parallel ranks) of all blocks' counts together.

    ``stage_group`` (pipeline parallelism: the ``pp`` group, when the model has MoE blocks):
    ``model`` is this rank's stage part; each block's bias moves by its own counts as without
    PP, and the returned extremes are those of every stage's blocks (one more all-reduce, of
    two numbers; a stage holding no MoE block contributes none).
    """
    blocks = moe_blocks(model)
    if not blocks and stage_group is None:
        return None
    low, high = math.inf, -math.inf
    if blocks:
        local = torch.stack([representation.to_local(m.tokens_per_expert) for m in blocks])
        counts = representation.sum_over_batch(local)
        for moe, count in zip(blocks, counts, strict=True):
            if moe.expert_bias is not None and moe.load_balance_coeff is not None:
                delta = moe.load_balance_coeff * torch.sign(count.mean() - count)
                representation.to_local(moe.expert_bias).add_(delta - delta.mean())
            representation.to_local(moe.tokens_per_expert).zero_()
        low, high = float(counts.min()), float(counts.max())
    if stage_group is not None:
        device = next(iter(model.parameters())).device
        extremes = torch.tensor([-low, high], dtype=torch.float64, device=device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=stage_group)
        low, high = -float(extremes[0]), float(extremes[1])
        if high == -math.inf:  # no stage holds an MoE block
            return None
    return ExpertLoad(min=int(low), max=int(high))
