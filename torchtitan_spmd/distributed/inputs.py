"""Technique: input preparation -- a rank's local batch as the model and the loss consume it.

Tokens and labels are ``[batch, seq]``; the data loader already gives each
data-parallel rank its own rows. On the model axes tokens are replicated (every
TP rank embeds the same tokens) and labels invariant (every TP rank computes the
same loss); both are sequence-sharded on ``cp`` (each context-parallel rank holds
its slice, :meth:`~torchtitan_spmd.techniques.context_parallel.ContextParallel.shard_batch`),
and so are the RoPE positions of those tokens.
"""

from __future__ import annotations

import torch

from .layout import I, S, SpmdLayout
from .representation import TensorRepresentation

__all__ = ["LABELS", "POSITIONS", "TOKENS", "prepare_inputs", "prepare_positions"]

#: Layout of the token ids on the model axes.
TOKENS = SpmdLayout({"cp": S(1)})
#: Layout of the labels on the model axes.
LABELS = SpmdLayout({"cp": S(1), "tp": I})
#: Layout of the tokens' positions (``[batch, seq]``, context parallelism): the tokens'.
POSITIONS = TOKENS


def prepare_inputs(tokens: torch.Tensor, labels: torch.Tensor, representation: TensorRepresentation,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``tokens`` and ``labels`` in the representation's form."""
    return representation.from_local(tokens, TOKENS), representation.from_local(labels, LABELS)


def prepare_positions(positions: torch.Tensor, representation: TensorRepresentation) -> torch.Tensor:
    """This rank's token positions ``[batch, seq]`` in the representation's form (laid out as the tokens)."""
    return representation.from_local(positions, POSITIONS)
