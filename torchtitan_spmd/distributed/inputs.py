"""Technique: input preparation -- a rank's local batch as the model and the loss consume it.

Tokens and labels are ``[batch, seq]``; the data loader already gives each
data-parallel rank its own rows. On the model axes tokens are replicated (every
TP rank embeds the same tokens) and labels invariant (every TP rank computes the
same loss); both are sequence-sharded on ``cp`` (each context-parallel rank holds
its slice, :meth:`~torchtitan_spmd.techniques.context_parallel.ContextParallel.shard_batch`),
and so are the RoPE positions of those tokens.

Packed documents (a family's ``attn_mask_type="block_causal"``): :func:`document_positions`
gives each token its index in its own document, documents split after each EOS token; the
model reads both its RoPE angles and its attention mask from them, so under every backend
and at every pipeline stage the mask is derived from a plain input laid out as the tokens.
"""

from __future__ import annotations

import torch

from .layout import I, S, SpmdLayout
from .representation import TensorRepresentation

__all__ = ["LABELS", "POSITIONS", "TOKENS", "document_positions", "prepare_inputs", "prepare_positions"]

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


def document_positions(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Each token's index in its own document (int64, ``tokens``' shape ``[batch, seq]``).

    A document ends with its EOS token (``eos_id``): the token after an EOS starts the next
    document at position 0, and so does the window's first token (a document cut by the
    window restarts there, as upstream's dataset normalises its positions per window).
    """
    seq = tokens.shape[-1]
    index = torch.arange(seq, device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = tokens[..., :-1] == eos_id
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first
