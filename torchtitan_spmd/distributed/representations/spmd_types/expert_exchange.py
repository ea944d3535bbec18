"""Expert parallelism's token exchange under ``spmd_types``, typed for the checker.

See :class:`TypedExpertExchange`; the untyped exchange is
:class:`~torchtitan_spmd.distributed.expert_exchange.ExpertExchange`.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import spmd_types as st  # the library (absolute import), not this package
import torch
import torch.distributed as dist
from spmd_types import P, R, V
from torch.distributed.device_mesh import DeviceMesh

from ...expert_exchange import ExpertExchange

__all__ = ["TypedExpertExchange"]


class _TypedCombine(torch.autograd.Function):
    """The combine's all-to-all (``all_to_all_single`` of variable splits; backward: the transposed
    one), typed for the checker as the sparse reduce-scatter it is: ``P -> S(0)`` on ``ep``."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, group: dist.ProcessGroup, output_splits: list[int],
                input_splits: list[int]) -> torch.Tensor:
        ctx.comm = (group, output_splits, input_splits)
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        group, output_splits, input_splits = ctx.comm
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=group)
        return out, None, None, None

    @staticmethod
    def spmd_typecheck(*, rows: Any, group: dist.ProcessGroup) -> Any:
        from spmd_types import rules

        return rules.reduce_scatter(rows, group, src=P, dst=st.S(0))


class TypedExpertExchange(ExpertExchange):
    """Expert parallelism's exchange, typed for ``--debug.spmd_typechecking``.

    The block's tokens are typed on ``home`` (``dp``, and ``cp`` and ``tp`` when active); ``ep``
    is a sub-axis of ``dp_shard x cp x tp`` (``= efsdp x ep``), and one tensor cannot be typed on
    both. So from the dispatch to the combine the expert side runs on the orthogonal
    ``(dp_replicate, efsdp, ep)`` (``spmd_types.reinterpret_mesh``: a no-op on the data, checked to
    span the same ranks). Under TP (``split``: the ``tp`` group) the rows and counts, replicated
    over ``tp`` as the gathered tokens are, are first re-typed ``R -> V`` on it: each TP rank
    sends only its own slice of them (``AllToAllDispatcher.token_slice``):

    - dispatch: ``all_to_all(V -> V)`` of the rows on ``ep`` (the checker's rule of the collective);
    - the experts' output: ``P`` on ``ep`` (``reinterpret``): each rank holds its experts' share
      of the group's combined rows;
    - combine: the sparse reduce-scatter ``P -> S(0)`` on ``ep`` (:class:`_TypedCombine`), then
      back to ``dp``;
    - under TP, the block's routed output (this rank's slice, zero elsewhere) ``V -> P`` on ``tp``
      (:meth:`sliced_output`): the pending sum over ``tp`` it is, which the shared experts' row-wise
      output (``P`` on ``tp``) adds to, and which the block's output layout declares.

    So a combine left out hands a pending sum (``P@ep``) to the block's ``dp``-typed arithmetic, an
    ``SpmdTypeError``. Without the checker it is the untyped exchange.
    """

    def __init__(self, group: dist.ProcessGroup, home: list[dist.ProcessGroup], sparse: list[dist.ProcessGroup],
                 sparse_mesh: DeviceMesh, split: dist.ProcessGroup | None = None) -> None:
        super().__init__(group)
        self.home, self.sparse, self.sparse_mesh, self.split = home, sparse, sparse_mesh, split

    def _to(self, x: torch.Tensor, axes: list[dist.ProcessGroup]) -> torch.Tensor:
        """``x`` re-typed onto ``axes`` (its types carried over: ``V`` stays ``V``, ``R`` stays ``R``);
        under TP (``split``) first ``R -> V`` on ``tp``: each TP rank's slice of the gathered tokens."""
        if self.split is not None and st.get_local_type(x).get(st.MeshAxis.of(self.split)) is R:
            x = st.reinterpret(x, self.split, src=R, dst=V, expert_mode=True)
        return st.reinterpret_mesh(x, axes)

    def expert_counts(self, counts: torch.Tensor) -> torch.Tensor:
        # An op on the block's counts (typed on ``home``) under the expert side's mesh would
        # auto-reinterpret them, which fails when ``ep`` spans ``dp_shard`` (V) and ``tp`` (R:
        # the gathered tokens' counts): re-typed here first, as the rows are (``_to``).
        return self._to(counts, self.sparse) if st.is_type_checking() else counts

    def sliced_output(self, out: torch.Tensor) -> torch.Tensor:
        if self.split is None or not st.is_type_checking():
            return out
        return st.reinterpret(out, self.split, src=V, dst=P)

    def expert_side(self) -> AbstractContextManager[None]:
        return st.set_current_mesh(self.sparse_mesh) if st.is_type_checking() else contextlib.nullcontext()

    def expert_output(self, out: torch.Tensor) -> torch.Tensor:
        return st.reinterpret(out, self.group, src=V, dst=P) if st.is_type_checking() else out

    def counts(self, counts: torch.Tensor) -> torch.Tensor:
        if not st.is_type_checking():
            return super().counts(counts)
        by_rank = self._to(counts, self.sparse).contiguous().view(self.group.size(), -1)
        if st.get_local_type(by_rank).get(st.MeshAxis.of(self.group)) is R:  # moe_force_load_balance: equal everywhere
            by_rank = st.reinterpret(by_rank, self.group, src=R, dst=V, expert_mode=True)  # each rank its own copy
        # V -> V transposes the axis with dim 0: rank r gets row r of every rank's counts
        return st.all_to_all(by_rank, self.group, src=V, dst=V).reshape(-1)

    def rows(self, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], *,
             combine: bool) -> torch.Tensor:
        if not st.is_type_checking():
            return super().rows(rows, output_splits, input_splits, combine=combine)
        if not combine:
            return super().rows(self._to(rows, self.sparse), output_splits, input_splits, combine=False)
        out = _TypedCombine.apply(rows, self.group, output_splits, input_splits)
        return st.reinterpret_mesh(out, self.home)
