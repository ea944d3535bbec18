"""The collectives of expert parallelism, as a tensor representation provides them.

:class:`ExpertExchange` is the untyped exchange every representation starts from
(:meth:`~torchtitan_spmd.distributed.representation.TensorRepresentation.expert_exchange`);
``spmd_types`` types it (:class:`~torchtitan_spmd.distributed.representations.spmd_types.expert_exchange.TypedExpertExchange`).
It sits below the models: the technique that uses it, expert parallelism
(:mod:`torchtitan_spmd.techniques.expert_parallel`), sits above them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

__all__ = ["ExpertExchange"]


class ExpertExchange:
    """The collectives of expert parallelism over the ``ep`` group: torch's ``all_to_all_single``
    (the rows' through the functional collectives, with autograd: the backward is the transposed
    all-to-all). The group's timeout applies. A representation may type them (``spmd_types``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Rank ``r`` gets chunk ``r`` of every rank's ``counts`` (even chunks; no gradient)."""
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=self.group)
        return received

    def expert_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """The block's tokens per expert, as the expert side reads them (``spmd_types``: re-typed onto
        its mesh, before any op on them there)."""
        return counts

    def expert_side(self) -> AbstractContextManager[None]:
        """The context from dispatch to combine (``spmd_types``: the ``ep`` mesh current)."""
        return nullcontext()

    def expert_output(self, out: torch.Tensor) -> torch.Tensor:
        """The local experts' output rows, before the combine (``spmd_types``: typed ``P`` on ``ep``)."""
        return out

    def sliced_output(self, out: torch.Tensor) -> torch.Tensor:
        """A block's routed output from this rank's slice of tokens shared over ``tp`` (zero outside
        it): a pending sum over ``tp`` (``spmd_types``: typed so)."""
        return out

    def rows(self, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], *,
             combine: bool) -> torch.Tensor:
        """``input_splits[r]`` rows to rank ``r``, ``output_splits[r]`` from it (``combine``: the way
        back, after the experts)."""
        out = funcol.all_to_all_single_autograd(rows.contiguous(), output_splits, input_splits, self.group)
        return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out
