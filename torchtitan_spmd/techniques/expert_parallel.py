"""Technique: expert parallelism (EP) -- experts sharded over ``ep``, tokens exchanged all-to-all.

As upstream torchtitan (a0c831c49), ``ep`` borrows its ranks from ``dp_shard * cp * tp``
(:class:`~torchtitan_spmd.distributed.parallel_dims.ParallelDims`); ``efsdp`` is the rest:

- every MoE block's grouped expert weights ``w1, w2, w3`` (``[num_experts, ...]``) are
  ``Shard(0)`` on ``ep``: rank ``r`` of the ``ep`` group holds experts
  ``r * E/ep ... (r + 1) * E/ep - 1`` (:meth:`TensorRepresentation.distribute_experts`, a
  DTensor or a typed local shard per backend); their checkpointed shape is the global one;
- FSDP2 shards those weights over ``efsdp`` (``dp_replicate x efsdp`` for HSDP), one
  ``fully_shard`` per expert module before the blocks' (:func:`~torchtitan_spmd.techniques.fsdp.apply_fsdp`
  shards the experts first); every other
  parameter is FSDP-sharded over ``fsdp`` as without EP;
- in the forward, each rank routes its own tokens, sorts the (token, choice) rows by global
  expert, and :class:`AllToAllDispatcher` sends each row to the rank holding its expert: the
  counts per expert first (one ``all_to_all_single`` of ``E`` integers, no gradient), then the
  rows (``all_to_all_single`` of variable splits through torch's functional collectives with
  autograd). The rows that arrive are reordered from source-rank-major to local-expert-major,
  run through this rank's experts, put back, and returned the same way (the combine). The
  weighted sum per token stays on the token's rank (:class:`~torchtitan_spmd.models.moe.GroupedExperts`).
  Backward is the transpose: the gradients take the same two all-to-alls in reverse.
- under ``spmd_types`` the exchange is typed
  (:class:`~torchtitan_spmd.distributed.representations.spmd_types.expert_exchange.TypedExpertExchange`):
  the rows go ``V -> V`` on ``ep`` (re-typed from ``dp`` onto ``(dp_replicate, efsdp, ep)``),
  the experts' output is a pending sum (``P@ep``: each rank's experts' share of its group's
  rows) and the combine the sparse reduce-scatter it is (``P -> S(0)``), so with
  ``--debug.spmd_typechecking`` a missing combine is an ``SpmdTypeError``.

With tensor parallelism (``expert_tensor_parallel_degree = 1``, upstream's default) ``ep`` takes
the ``tp`` ranks first (``ep = tp``: the TP group; ``ep = dp_shard * tp``: all of them). The
experts are not TP-sharded (:func:`expert_parallel_plan`); the MoE block keeps its TP
boundaries (the tokens gathered over ``tp``, the output a pending sum over ``tp`` reduced at
the block's output, as the MoE without EP); every TP rank routes all the gathered tokens (the
load-balancing counts are the same on every TP rank and summed over the data ranks only:
counted once) and dispatches only its own ``1/tp`` slice of them, so each token goes through
its experts once per TP group, and the output is zero outside the slice. The router gate's
gradient is then a share of a sum over ``tp`` (``Partial``). Upstream splits the same way
(``sp_size``/``sp_rank`` of its token dispatcher) but takes the sequence-parallel shard without
the gather; here the block's gather and reduce-scatter stay (one boundary for MoE with and
without EP).

With pipeline parallelism each stage's experts are exchanged within the stage's ``ep`` group
(``ep`` borrows from the stage's ``dp_shard * cp * tp``); nothing more is needed.

With context parallelism each CP rank routes its own sequence shard (its tokens differ from
its CP peers', as a data-parallel rank's), so ``ep`` over ``cp`` ranks needs nothing more; the
counts are summed over ``cp`` as without EP.

Not here yet (a setup error, :func:`validate_expert_parallel`): ``expert_tensor_parallel_degree``
other than 1.

Hand-rolled: the rank-major to expert-major permutation (torch has no op for it; upstream
computes it the same way) and the split bookkeeping around torch's ``all_to_all_single``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchtitan_spmd.config.activation_checkpoint import ac_section
from torchtitan_spmd.config.backends import backend as backend_record
from torchtitan_spmd.distributed.expert_exchange import ExpertExchange
from torchtitan_spmd.distributed.layout import S, SpmdLayout
from torchtitan_spmd.distributed.representation import StateLayout, TensorRepresentation
from torchtitan_spmd.models.moe import GroupedExperts

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims
    from torchtitan_spmd.distributed.plan import ShardingPlan

__all__ = [
    "EXPERT_LAYOUT",
    "EXPERT_WEIGHTS",
    "AllToAllDispatcher",
    "DispatchState",
    "ExpertExchange",
    "apply_expert_parallel",
    "expert_modules",
    "expert_parallel_plan",
    "validate_expert_parallel",
]

#: The grouped weights of :class:`GroupedExperts` that EP shards (dim 0: the expert).
EXPERT_WEIGHTS: tuple[str, ...] = ("w1", "w2", "w3")
#: Their layout: ``Shard(0)`` on ``ep``.
EXPERT_LAYOUT = SpmdLayout({"ep": S(0)})

def expert_modules(model: nn.Module) -> list[tuple[str, GroupedExperts]]:
    """``(fqn, module)`` of every :class:`GroupedExperts` of ``model``, in model order."""
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, GroupedExperts)]


# ======================================================================================
# Setup errors
# ======================================================================================
def _moe_flavors() -> str:
    from torchtitan_spmd.models import get_model_spec, model_families

    names = []
    for family in model_families():
        spec = get_model_spec(family)
        names += [f"{family} {flavor!r}" for flavor, c in spec.flavors.items() if getattr(c, "moe_enabled", False)]
    return ", ".join(names) or "none"


def validate_expert_parallel(model_config: Any, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """Raise ValueError at setup for what expert parallelism cannot run.

    ``expert_tensor_parallel_degree`` must be 1 or ``tensor_parallel_degree`` (upstream's rule);
    only 1 runs here. With ``expert_parallel_degree > 1``: a dense model (the MoE flavours are
    named) and experts not divisible by ``ep``. (EP composes with TP, CP and PP; ``ep`` not dividing ``dp_shard * cp * tp`` is :class:`ParallelDims`' error.)
    """
    par, pd = job_config.parallelism, parallel_dims
    etp = getattr(par, "expert_tensor_parallel_degree", 1)
    if etp != 1:
        valid = "1" if pd.tp == 1 else f"1 or tensor_parallel_degree={pd.tp}"
        what = ("tensor parallelism of the experts is not implemented yet" if etp == pd.tp
                else f"it must be {valid} (as upstream)")
        raise ValueError(f"parallelism.expert_tensor_parallel_degree={etp}: {what}; set it to 1.")
    if not pd.ep_enabled:
        return
    ep = f"parallelism.expert_parallel_degree={pd.ep}"
    if not getattr(model_config, "moe_enabled", False):
        raise ValueError(f"{ep} needs a mixture-of-experts model, and model.name={job_config.model.name!r} "
                         f"model.flavor={job_config.model.flavor!r} is dense; the MoE flavours: {_moe_flavors()}. "
                         "Or set parallelism.expert_parallel_degree=1.")
    typechecked = job_config.debug.spmd_typechecking and backend_record(job_config.parallelism.spmd_backend).typechecking
    if typechecked and ac_section(job_config.activation_checkpoint).mode == "selective":
        # Measured: the typed combine's all-to-all is not found again by selective AC's recompute
        # ("all_to_all_single ... invocation index 1 ... not found in storage"); full AC runs.
        raise ValueError(f"{ep} with debug.spmd_typechecking=True and activation_checkpoint.mode='selective' "
                         "does not run (selective AC's recompute does not replay the typed all-to-all); "
                         "use activation_checkpoint.mode 'full' or 'none', or debug.spmd_typechecking=False.")
    if model_config.num_experts % pd.ep:
        divisors = [d for d in range(1, model_config.num_experts + 1) if model_config.num_experts % d == 0]
        raise ValueError(f"{ep}: the model's num_experts={model_config.num_experts} is not divisible by it "
                         f"(model.flavor={job_config.model.flavor!r}); valid degrees divide it: {divisors}.")


# ======================================================================================
# The token exchange
# ======================================================================================
@dataclass(frozen=True)
class DispatchState:
    """What :meth:`AllToAllDispatcher.combine` needs from its dispatch.

    ``perm``: the arrived rows' positions in local-expert-major order; ``sent`` / ``received``:
    rows sent to / received from each rank of the ``ep`` group.
    """

    perm: torch.Tensor
    sent: list[int]
    received: list[int]


class AllToAllDispatcher:
    """The expert-parallel token exchange of one MoE block over the ``ep`` group
    (the :class:`~torchtitan_spmd.models.moe.TokenDispatcher` of its :class:`GroupedExperts`).

    ``exchange``: the collectives (the representation's, :meth:`TensorRepresentation.expert_exchange`);
    ``num_experts``: the global count (a multiple of the group size); ``tp`` (tensor parallelism:
    ``(rank, size)`` in the ``tp`` group, whose ranks hold the same, gathered tokens): this rank
    dispatches only its contiguous ``1/size`` of the block's tokens (:meth:`token_slice`).
    """

    def __init__(self, exchange: ExpertExchange, num_experts: int, tp: tuple[int, int] | None = None) -> None:
        self.exchange, self.num_experts, self.tp = exchange, num_experts, tp
        self.ep = exchange.group.size()
        if num_experts % self.ep:
            raise ValueError(f"expert parallelism: num_experts={num_experts} is not divisible by ep={self.ep}.")
        self.local_experts = num_experts // self.ep

    @property
    def partial_axes(self) -> tuple[str, ...]:
        """See :attr:`TokenDispatcher.partial_axes`: ``("tp",)`` under tensor parallelism."""
        return ("tp",) if self.tp is not None else ()

    def token_slice(self, num_tokens: int) -> slice | None:
        """See :meth:`TokenDispatcher.token_slice`: TP rank ``r`` of ``n`` takes tokens
        ``r*T//n ... (r+1)*T//n - 1``; None without tensor parallelism."""
        if self.tp is None:
            return None
        rank, size = self.tp
        return slice(rank * num_tokens // size, (rank + 1) * num_tokens // size)

    def sliced_output(self, out: torch.Tensor) -> torch.Tensor:
        """See :meth:`TokenDispatcher.sliced_output` (the exchange's :meth:`ExpertExchange.sliced_output`)."""
        return self.exchange.sliced_output(out)

    def counts_from_every_rank(self, counts: torch.Tensor) -> torch.Tensor:
        """``[ep, local_experts]``: how many rows each rank sends to each of this rank's experts
        (one all-to-all of the ``num_experts`` counts; no gradient)."""
        with torch.no_grad():
            received = self.exchange.counts(counts)
        return received.view(self.ep, self.local_experts)

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """See :meth:`TokenDispatcher.dispatch`: the rows of this rank's experts, local-expert-major."""
        counts = self.exchange.expert_counts(counts)
        by_rank = self.counts_from_every_rank(counts)
        sent = counts.view(self.ep, self.local_experts).sum(dim=1).tolist()
        received = by_rank.sum(dim=1).tolist()
        arrived = self.exchange.rows(rows, received, sent, combine=False)
        # Arrived rows are (source rank, local expert)-major; the experts want (local expert, rank).
        segment = torch.arange(self.ep * self.local_experts, device=rows.device)
        key = (segment % self.local_experts) * self.ep + segment // self.local_experts
        perm = torch.argsort(key.repeat_interleave(by_rank.reshape(-1)), stable=True)
        return arrived[perm], by_rank.sum(dim=0), DispatchState(perm=perm, sent=sent, received=received)

    def combine(self, out: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """See :meth:`TokenDispatcher.combine`: the experts' rows back, in dispatch's order."""
        back = self.exchange.expert_output(out[torch.argsort(state.perm)])
        return self.exchange.rows(back, state.sent, state.received, combine=True)

    def run(self, rows: torch.Tensor, counts: torch.Tensor,
            experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """See :meth:`TokenDispatcher.run`: dispatch, this rank's ``experts``, combine (in the
        exchange's :meth:`ExpertExchange.expert_side`)."""
        with self.exchange.expert_side():
            local_rows, local_counts, state = self.dispatch(rows, counts)
            return self.combine(experts(local_rows, local_counts), state)


# ======================================================================================
# Applying it
# ======================================================================================
def expert_parallel_plan(plan: ShardingPlan, parallel_dims: ParallelDims) -> ShardingPlan:
    """``plan`` without tensor parallelism of the experts when EP runs with TP or CP
    (``expert_tensor_parallel_degree = 1``, upstream's default): the ``*.experts`` entries go
    (with CP: their declared output, replicated over ``cp``, is not what the exchange returns), so
    the grouped weights stay whole over ``tp`` until :func:`apply_expert_parallel` shards them
    over ``ep``; the MoE block keeps its boundaries (tokens gathered over ``tp``, its output a
    pending sum over ``tp``: each TP rank dispatches its slice, :meth:`AllToAllDispatcher.token_slice`).
    ``plan`` itself otherwise."""
    if not (parallel_dims.ep_enabled and (parallel_dims.tp_enabled or parallel_dims.cp_enabled)):
        return plan
    modules = {k: v for k, v in plan.modules.items() if not k.endswith(".experts")}
    return dataclasses.replace(plan, modules=modules)


def apply_expert_parallel(model: nn.Module, representation: TensorRepresentation,
                          states: MutableMapping[str, StateLayout]) -> None:
    """Shard every expert module's weights ``Shard(0)`` on ``ep`` and install its dispatcher.

    After :func:`~torchtitan_spmd.distributed.apply_plan.apply_plan` (on the meta device):
    ``states`` (its result) records the experts' layout and global shape for initialisation and
    checkpoints. No-op without expert parallelism.
    """
    pd = representation.parallel_dims
    if not pd.ep_enabled:
        return
    group = pd.get_mesh("ep").get_group()  # its timeout (comm.set_pg_timeouts) governs every exchange
    tp = (pd.get_mesh("tp").get_local_rank(), pd.tp) if pd.tp_enabled else None
    for fqn, experts in expert_modules(model):
        for name in EXPERT_WEIGHTS:
            key = f"{fqn}.{name}"
            states[key] = StateLayout(EXPERT_LAYOUT, states[key].global_shape)
            experts._parameters[name] = representation.distribute_experts(experts._parameters[name])  # type: ignore[arg-type]
        experts.dispatcher = AllToAllDispatcher(representation.expert_exchange(group), experts.num_experts, tp)
