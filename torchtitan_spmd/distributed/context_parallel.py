"""Technique: context parallelism (CP) -- causal attention over sequence shards.

Each rank of the ``cp`` mesh axis holds a slice of every sequence; everything but
attention is pointwise along the sequence, so it runs on the slice unchanged.
Attention gathers keys and values over ``cp``; each rank attends with its own
queries to the whole sequence, under a causal mask over *global* token indices.

The pieces, and who owns them:

- **layouts**: the plan's (``models/decoder_plan.py``): every activation is ``S(1)@cp``
  (``S(2)@cp`` heads-first), and the attention kernel's keys and values arrive as
  ``Redistribute(S(2)@cp -> R@cp)``, so the gather is a plan boundary. Each
  representation runs it as its own collective: ``spmd_types`` one typed
  ``all_gather`` (backward: ``reduce_scatter``), ``full_dtensor`` a DTensor
  redistribution. Tokens and labels are ``S(1)@cp`` (``distributed/inputs.py``).
- **the algorithm** (here): which tokens a rank holds (:meth:`ContextParallel.shard`),
  their global positions (:meth:`ContextParallel.positions`, which RoPE reads), and
  the attention body (:func:`apply_context_parallel`): the plan's attention kernels
  get the mask of :meth:`ContextParallel.attention_mask` instead of ``is_causal``.
- **the loss**: the token count and the loss sum over the ``(batch, cp)`` loss mesh
  (each representation's ``sum_over_batch``); FSDP shards over ``dp_shard x cp``
  (each representation's ``fsdp_spec``), which also sums the gradients over ``cp``.

Load balancing (``parallelism.context_parallel_load_balancer``): ``"headtail"``
(torchtitan's default for SDPA) cuts a sequence into ``2 * cp`` chunks and gives
rank ``r`` chunks ``r`` and ``2 * cp - 1 - r``, so every rank does the same causal
work; ``None`` gives rank ``r`` the ``r``-th contiguous slice. Both are exact: the
numbers are those of one process up to float rounding.

Keys and values are exchanged by all-gather (``context_parallel_rotate_method =
"allgather"``); ``"alltoall"`` (a ring) is not implemented and is a setup error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .plan import ShardingPlan, fqn_matches

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig, ParallelismConfig

    from .parallel_dims import ParallelDims

__all__ = [
    "LOAD_BALANCERS",
    "ROTATE_METHODS",
    "ContextParallel",
    "apply_context_parallel",
    "context_parallel_backends",
    "seq_len_divisor",
    "validate_context_parallel",
    "validate_cp_backend",
]

#: The load balancers this runtime implements (``"ptrr"`` needs FlexAttention masks).
LOAD_BALANCERS: tuple[str | None, ...] = ("headtail", None)
#: The key/value exchanges this runtime implements.
ROTATE_METHODS: tuple[str, ...] = ("allgather",)


def context_parallel_backends() -> tuple[str, ...]:
    """The ``spmd_backend`` values whose representation runs context parallelism (in this build)."""
    from torchtitan_spmd.config import SPMD_BACKENDS

    from .representation import get_representation

    names = []
    for name in SPMD_BACKENDS:
        try:
            cls = get_representation(name)
        except ValueError:  # a stack prefix without that backend's runtime
            continue
        if cls.supports_context_parallel:
            names.append(name)
    return tuple(names)


def validate_cp_backend(parallelism: ParallelismConfig) -> None:
    """Raise ``ValueError`` when ``context_parallel_degree > 1`` under a backend without CP.

    torchtitan's function of that name; here ``full_dtensor`` runs CP as well as
    ``spmd_types`` (torchtitan removed its DTensor CP path with the ``full_dtensor``
    backend, #4217/#4218).
    """
    if parallelism.context_parallel_degree <= 1:
        return
    backends = context_parallel_backends()
    if parallelism.spmd_backend not in backends:
        wanted = " or ".join(f"parallelism.spmd_backend={b!r}" for b in backends) or "a backend with CP"
        raise ValueError(
            f"Context Parallel requires {wanted}, got {parallelism.spmd_backend!r} "
            f"(parallelism.context_parallel_degree={parallelism.context_parallel_degree}); "
            "or set parallelism.context_parallel_degree=1."
        )


def seq_len_divisor(parallelism: ParallelismConfig) -> int:
    """What ``training.seq_len`` must be a multiple of under these CP and TP degrees.

    ``headtail`` cuts a sequence into ``2 * cp`` chunks (no balancing: ``cp``); sequence
    parallelism then splits each rank's slice over ``tp`` (without it, TP does not
    split the sequence). torchtitan's ``seq_len_divisor`` is the first case, ``tp * 2 * cp``.
    """
    cp = parallelism.context_parallel_degree
    divisor = 2 * cp if parallelism.context_parallel_load_balancer == "headtail" and cp > 1 else cp
    if parallelism.enable_sequence_parallel:
        divisor *= parallelism.tensor_parallel_degree
    return divisor


def validate_context_parallel(job_config: JobConfig) -> None:
    """Setup-time errors for a CP config this runtime cannot run (no-op when ``cp == 1``).

    The backend (:func:`validate_cp_backend`), the load balancer, the rotate method and
    ``training.seq_len`` (:func:`seq_len_divisor`). Each error names the field, the value
    and the valid ones.
    """
    par = job_config.parallelism
    if par.context_parallel_degree <= 1:
        return
    validate_cp_backend(par)
    if par.context_parallel_load_balancer not in LOAD_BALANCERS:
        raise ValueError(
            f"parallelism.context_parallel_load_balancer={par.context_parallel_load_balancer!r} is not "
            f"implemented for SDPA attention; valid values are {', '.join(map(repr, LOAD_BALANCERS))} "
            "('ptrr' needs FlexAttention block masks)."
        )
    if par.context_parallel_rotate_method not in ROTATE_METHODS:
        raise ValueError(
            f"parallelism.context_parallel_rotate_method={par.context_parallel_rotate_method!r} needs ring "
            f"attention, which is not implemented; use {' or '.join(map(repr, ROTATE_METHODS))} "
            "(keys and values are all-gathered over cp)."
        )
    seq_len, divisor = job_config.training.seq_len, seq_len_divisor(par)
    if seq_len % divisor:
        cp, tp = par.context_parallel_degree, par.tensor_parallel_degree
        parts = [f"context_parallel_degree ({cp})"]
        if par.context_parallel_load_balancer == "headtail":
            parts.insert(0, "2")
        if par.enable_sequence_parallel and tp > 1:
            parts.insert(0, f"tensor_parallel_degree ({tp}, sequence parallel)")
        raise ValueError(
            f"training.seq_len={seq_len} is not divisible by {divisor} = {' x '.join(parts)}: "
            f"each of the {cp} context-parallel ranks holds "
            + ("two of 2 x cp equal chunks (headtail load balancing)"
               if par.context_parallel_load_balancer == "headtail" else "an equal slice")
            + (", split again over tp by sequence parallelism." if par.enable_sequence_parallel and tp > 1
               else ".")
        )


@dataclass(frozen=True)
class ContextParallel:
    """One rank's share of context parallelism: which tokens it holds, and their attention mask.

    Attributes:
        degree: the ``cp`` degree (> 1).
        rank: this rank's index on the ``cp`` mesh axis.
        load_balancer: ``"headtail"`` or None (see the module docstring).
    """

    degree: int
    rank: int
    load_balancer: str | None = "headtail"
    _masks: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.degree < 2 or not 0 <= self.rank < self.degree:
            raise ValueError(f"ContextParallel: need degree > 1 and 0 <= rank < degree, got "
                             f"degree={self.degree}, rank={self.rank}.")
        if self.load_balancer not in LOAD_BALANCERS:
            raise ValueError(f"ContextParallel.load_balancer={self.load_balancer!r}; valid values are "
                             f"{', '.join(map(repr, LOAD_BALANCERS))}.")

    @classmethod
    def from_config(cls, job_config: JobConfig, parallel_dims: ParallelDims) -> ContextParallel | None:
        """Validate the CP config (:func:`validate_context_parallel`) and build this rank's share.

        None without context parallelism. ``parallel_dims`` must have built its meshes.
        """
        validate_context_parallel(job_config)
        if not parallel_dims.cp_enabled:
            return None
        mesh = parallel_dims.get_mesh("cp")
        return cls(degree=parallel_dims.cp, rank=mesh.get_local_rank(),
                   load_balancer=job_config.parallelism.context_parallel_load_balancer)

    # ------------------------------------------------------------------ which tokens
    @property
    def chunks(self) -> int:
        """How many equal chunks a sequence is cut into."""
        return 2 * self.degree if self.load_balancer == "headtail" else self.degree

    def chunk_ids(self, rank: int | None = None) -> tuple[int, ...]:
        """The chunks ``rank`` (default: this rank) holds, in the order it holds them."""
        r = self.rank if rank is None else rank
        return (r, self.chunks - 1 - r) if self.load_balancer == "headtail" else (r,)

    def _chunk_len(self, seq_len: int) -> int:
        if seq_len % self.chunks:
            raise ValueError(f"context parallelism: sequence length {seq_len} is not divisible by "
                             f"{self.chunks} ({'2 x ' if self.chunks != self.degree else ''}cp).")
        return seq_len // self.chunks

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of the full sequence dim ``dim`` of ``x`` (contiguous)."""
        size = self._chunk_len(x.shape[dim])
        return torch.cat([x.narrow(dim, c * size, size) for c in self.chunk_ids()], dim=dim).contiguous()

    def global_index(self, seq_len: int, rank: int | None = None, *, device: Any = None) -> torch.Tensor:
        """The global token indices (int64 ``[seq_len // cp]``) that ``rank`` holds, in its order."""
        size = self._chunk_len(seq_len)
        return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in self.chunk_ids(rank)])

    def positions(self, batch: int, seq_len: int, *, device: Any = None) -> torch.Tensor:
        """RoPE positions of this rank's tokens: ``[batch, seq_len // cp]``, the layout of its tokens."""
        return self.global_index(seq_len, device=device).unsqueeze(0).expand(batch, -1).contiguous()

    def shard_batch(self, tokens: torch.Tensor, labels: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's ``(tokens, labels, positions)`` of a full-sequence ``[batch, seq]`` batch."""
        batch, seq_len = tokens.shape
        return self.shard(tokens), self.shard(labels), self.positions(batch, seq_len, device=tokens.device)

    # ------------------------------------------------------------------ attention
    def attention_mask(self, q_len: int, kv_len: int, *, dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
        """The additive causal mask ``[q_len, kv_len]`` of this rank's queries over the gathered keys.

        The gathered keys are every rank's slice in rank order; entry ``(i, j)`` is 0
        when key ``j``'s global index is at most query ``i``'s, else ``-inf``. One tensor
        per shape, shared by every layer (a float mask: SDPA would copy a boolean one
        into a float mask per call, and keep each copy for backward).
        """
        if kv_len != q_len * self.degree:
            raise ValueError(
                f"context-parallel attention got {q_len} queries and {kv_len} keys on this rank; "
                f"keys and values must be gathered over cp first ({self.degree} x {q_len}): declare "
                "them Redistribute(S(2)@cp -> R@cp) in the plan."
            )
        key = (q_len, kv_len, dtype, str(device))
        mask = self._masks.get(key)
        if mask is None:
            with torch.no_grad():
                q_pos = self.global_index(kv_len, device=device)
                k_pos = torch.cat([self.global_index(kv_len, r, device=device) for r in range(self.degree)])
                allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
                mask = torch.zeros(q_len, kv_len, dtype=dtype, device=device)
                mask.masked_fill_(~allowed, float("-inf"))
            self._masks.clear()  # one sequence length at a time
            self._masks[key] = mask
        return mask

    def attention_forward(self, forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """Wrap an attention kernel's ``forward(q, k, v, *, attn_mask=None)`` (heads-first
        ``[batch, heads, seq, head_dim]``): local queries, gathered keys, this rank's mask."""

        @functools.wraps(forward)
        def cp_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            mask = self.attention_mask(q.shape[-2], k.shape[-2], dtype=q.dtype, device=q.device)
            return forward(q, k, v, attn_mask=mask, **kwargs)

        return cp_forward


def apply_context_parallel(model: nn.Module, plan: ShardingPlan, cp: ContextParallel | None) -> None:
    """Give each of the plan's attention kernels (``plan.attention``) the context-parallel body.

    Call before :func:`~torchtitan_spmd.distributed.apply_plan.apply_plan`, so that the
    representation's local region wraps the CP body. No-op without CP. Raises
    ValueError when the plan names no attention kernel or a pattern matches nothing.
    """
    if cp is None:
        return
    if not plan.attention:
        raise ValueError("context parallelism: the sharding plan names no attention kernel "
                         "(ShardingPlan.attention); it cannot shard the sequence.")
    for pattern in plan.attention:
        hits = [m for fqn, m in model.named_modules() if fqn_matches(pattern, fqn)]
        if not hits:
            raise ValueError(f"context parallelism: plan attention pattern {pattern!r} matches no module "
                             f"of {type(model).__name__}.")
        for module in hits:
            module.forward = cp.attention_forward(module.forward)  # type: ignore[method-assign]
