"""Technique: context parallelism (CP) -- causal attention over sequence shards, chunk by chunk.

Each rank of the ``cp`` mesh axis holds a slice of every sequence; everything but
attention is pointwise along the sequence, so it runs on the slice unchanged.
Attention is torch's ring attention (``_templated_ring_attention`` and its backward,
from ``torch.distributed.tensor.experimental._context_parallel._attention``) on this
rank's local queries, keys and values and the ``cp`` process group: one key/value
chunk at a time with the fused SDPA kernel (``is_causal`` on the diagonal chunk,
chunks above it skipped, the others unmasked), the partial outputs merged by
log-sum-exp in float32. No mask exists, and nothing of size ``S x S/cp``.

The pieces, and who owns them:

- **layouts**: the plan's (``models/decoder_plan.py``): every activation is ``S(1)@cp``
  (``S(2)@cp`` heads-first), and so are the attention kernel's queries, keys and values:
  the key/value exchange is inside the kernel, not a plan boundary. Keys and values keep
  their ``n_kv_heads`` (grouped-query attention): they are exchanged before any repeat
  (the CPU flash kernel takes fewer key/value heads as they are). Tokens and labels are
  ``S(1)@cp`` (``distributed/inputs.py``).
- **the algorithm** (here): which tokens a rank holds (:meth:`ContextParallel.shard`),
  their global positions (:meth:`ContextParallel.positions`, which RoPE reads), and the
  attention body (:func:`apply_context_parallel`, :func:`ring_attention`).
- **the loss**: the token count and the loss sum over the ``(batch, cp)`` loss mesh
  (each representation's ``sum_over_batch``); FSDP shards over ``dp_shard x cp``
  (each representation's ``fsdp_spec``), which also sums the gradients over ``cp``.
- **typing** (``spmd_types``): the ring attention is one autograd Function whose
  ``spmd_typecheck`` declares its collectives: keys and values ``V@cp`` gathered
  (``-> R@cp``), attended by ``V@cp`` queries, the output ``V@cp``.

Load balancing (``parallelism.context_parallel_load_balancer``): ``"headtail"``
(torchtitan's default for SDPA) cuts a sequence into ``2 * cp`` chunks and gives
rank ``r`` chunks ``r`` and ``2 * cp - 1 - r`` (torch's round-robin layout), so every
rank does the same causal work; ``None`` gives rank ``r`` the ``r``-th contiguous
slice (ranks then skip the chunks above their diagonal: unequal work). Both are
exact: the numbers are those of one process up to float rounding.

Key/value exchange (``parallelism.context_parallel_rotate_method``), torch's rotaters:
``"allgather"`` gathers every rank's keys and values once per call (forward and
backward each), then computes chunk by chunk; ``"alltoall"`` passes the chunks around
the ring (a permute), holding at most the current and the next chunk. In backward
both rotate the key/value gradients back around the ring to their owners.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_spmd.distributed.context_parallel import (
    context_parallel_backends,
    validate_cp_backend,
)
from torchtitan_spmd.distributed.parallel_dims import seq_len_divisor as _seq_len_divisor
from torchtitan_spmd.distributed.plan import ShardingPlan, fqn_matches

try:  # torch >= 2.9
    from torch.distributed.tensor.experimental._context_parallel import _attention as _torch_cp
except ImportError:  # pragma: no cover - older torch kept it one level up
    from torch.distributed.tensor.experimental import _attention as _torch_cp  # type: ignore[no-redef]

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig, ParallelismConfig
    from torchtitan_spmd.distributed.parallel_dims import ParallelDims

__all__ = [
    "LOAD_BALANCERS",
    "ROTATE_METHODS",
    "ContextParallel",
    "apply_context_parallel",
    "context_parallel_backends",
    "ring_attention",
    "seq_len_divisor",
    "validate_context_parallel",
    "validate_cp_backend",
]

#: The load balancers this runtime implements (``"ptrr"`` needs FlexAttention masks).
LOAD_BALANCERS: tuple[str | None, ...] = ("headtail", None)
#: The key/value exchanges this runtime implements (torch's two rotaters).
ROTATE_METHODS: tuple[str, ...] = ("allgather", "alltoall")
_TORCH_ROTATE = {"allgather": _torch_cp._RotateMethod.ALL_GATHER, "alltoall": _torch_cp._RotateMethod.ALL_TO_ALL}


def seq_len_divisor(parallelism: ParallelismConfig) -> int:
    """What ``training.seq_len`` must be a multiple of under these CP and TP degrees.

    The config's view of :func:`torchtitan_spmd.distributed.parallel_dims.seq_len_divisor`
    (the one definition).
    """
    return _seq_len_divisor(
        cp=parallelism.context_parallel_degree, tp=parallelism.tensor_parallel_degree,
        load_balancer=parallelism.context_parallel_load_balancer,
        sequence_parallel=parallelism.enable_sequence_parallel,
    )


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
    if par.context_parallel_rotate_method not in ROTATE_METHODS:  # the config rejects it first
        raise ValueError(
            f"parallelism.context_parallel_rotate_method={par.context_parallel_rotate_method!r}; "
            f"valid values are {', '.join(map(repr, ROTATE_METHODS))}."
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


# --------------------------------------------------------------------------- torch's ring attention
@dataclass(frozen=True)
class _Kernel:
    """The fused SDPA op pair torch's ring attention runs per chunk on one device type."""

    forward: Any
    backward: Any
    #: The name of the output gradient in ``backward``'s schema.
    grad_out_name: str
    #: The number of ``forward`` outputs after ``(out, logsumexp)`` that ``backward`` needs.
    n_rest: int
    #: Whether the op takes fewer key/value heads than query heads (GQA) as they are.
    native_gqa: bool

    def forward_kwargs(self) -> dict[str, Any]:
        if self.forward is torch.ops.aten._scaled_dot_product_efficient_attention:
            return {"attn_bias": None, "compute_log_sumexp": True, "dropout_p": 0.0, "scale": None}
        return {"dropout_p": 0.0, "scale": None}

    def backward_kwargs(self, rest: tuple[torch.Tensor, ...]) -> dict[str, Any]:
        if self.backward is torch.ops.aten._scaled_dot_product_efficient_attention_backward:
            seed, offset = rest[:2]
            return {"attn_bias": None, "philox_seed": seed, "philox_offset": offset, "dropout_p": 0.0,
                    "grad_input_mask": (True, True, True, False), "scale": None}
        return {"dropout_p": 0.0, "scale": None}


def _kernel(device_type: str) -> _Kernel:
    aten = torch.ops.aten
    if device_type == "cpu":
        return _Kernel(aten._scaled_dot_product_flash_attention_for_cpu,
                       aten._scaled_dot_product_flash_attention_for_cpu_backward, "grad_out", 0, True)
    if device_type == "cuda":  # the memory-efficient kernel: fp32 as well as bf16 (flash is half only)
        return _Kernel(aten._scaled_dot_product_efficient_attention,
                       aten._scaled_dot_product_efficient_attention_backward, "grad_out_", 2, False)
    raise ValueError(f"context parallelism: no ring-attention kernel for device type {device_type!r} "
                     "(cpu and cuda have one).")


def _takes_mesh(fn: Callable[..., Any]) -> bool:
    """Whether torch's ring function takes a DeviceMesh first (older torch) rather than a group."""
    return next(iter(inspect.signature(fn).parameters)) == "mesh"


@contextlib.contextmanager
def _torch_cp_options(rotate_method: str, load_balance: bool) -> Iterator[None]:
    """Torch's ring attention reads process-global options (``_cp_options``): set them for one
    call and restore them after, so nothing of this run leaks into another user of torch's CP."""
    opts = _torch_cp._cp_options
    saved = (opts.convert_to_f32, opts.enable_load_balance, opts.rotate_method)
    opts.convert_to_f32, opts.enable_load_balance, opts.rotate_method = (
        True, load_balance, _TORCH_ROTATE[rotate_method])
    try:
        yield
    finally:
        opts.convert_to_f32, opts.enable_load_balance, opts.rotate_method = saved


def _gqa_op(op: Any, n_rep: int, backward: bool) -> Callable[..., Any]:
    """``op`` for a kernel without native GQA: the chunk's keys and values are repeated *after*
    the exchange (the exchanged tensors keep ``n_kv_heads``); in backward the repeated key/value
    gradients are summed back over each group of query heads."""

    def rep(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(n_rep, dim=1)

    def fold(g: torch.Tensor) -> torch.Tensor:
        b, h, s, d = g.shape
        return g.view(b, h // n_rep, n_rep, s, d).sum(2)

    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs["key"], kwargs["value"] = rep(kwargs["key"]), rep(kwargs["value"])
        out = op(*args, **kwargs)
        if backward:
            dq, dk, dv, *rest = out
            return (dq, fold(dk), fold(dv), *rest)
        return out

    def forward_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
        return call(query=query, key=key, value=value, **kwargs)

    return call if backward else forward_call


class _RingAttention(torch.autograd.Function):
    """Causal attention over ``cp`` sequence shards: torch's ``_templated_ring_attention`` forward,
    ``_templated_ring_attention_backward`` backward, on local heads-first tensors.

    Saved for backward: this rank's queries, keys, values, output and log-sum-exp (the
    tensors one process saves for ``S/cp`` tokens); keys and values are exchanged again
    in backward rather than kept.
    """

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                group: dist.ProcessGroup, rotate_method: str, load_balance: bool,
                where: Any = None) -> torch.Tensor:
        kernel = _kernel(query.device.type)
        n_rep = query.shape[1] // key.shape[1]
        op = kernel.forward if kernel.native_gqa or n_rep == 1 else _gqa_op(kernel.forward, n_rep, False)
        target = where if where is not None else group
        with _torch_cp_options(rotate_method, load_balance):
            out, lse, *rest = _torch_cp._templated_ring_attention(
                target, 2, op, query, key, value, is_causal=True, **kernel.forward_kwargs())
        rest = tuple(rest[: kernel.n_rest])
        ctx.save_for_backward(query, key, value, out, lse, *rest)
        ctx.cp = (group, rotate_method, load_balance, target, n_rep)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse, *rest = ctx.saved_tensors
        _, rotate_method, load_balance, target, n_rep = ctx.cp
        kernel = _kernel(query.device.type)
        op = kernel.backward if kernel.native_gqa or n_rep == 1 else _gqa_op(kernel.backward, n_rep, True)
        with _torch_cp_options(rotate_method, load_balance):
            dq, dk, dv, *_ = _torch_cp._templated_ring_attention_backward(
                target, 2, op, grad_out.contiguous(), kernel.grad_out_name, query, key, value, out, lse,
                is_causal=True, **kernel.backward_kwargs(tuple(rest)))
        return dq, dk.contiguous(), dv.contiguous(), None, None, None, None

    @staticmethod
    def spmd_typecheck(*, query: Any, key: Any, value: Any, group: dist.ProcessGroup) -> Any:
        """The types (spmd_types' checker): the keys and values of every ``cp`` rank are
        exchanged (``V -> R`` on ``cp``: gathered, or rotated through every rank) and attended
        by this rank's queries (``V@cp``): the output is ``V@cp``, and the queries' type elsewhere."""
        from spmd_types import R, V, rules

        k_all = rules.all_gather(key, group, src=V, dst=R)
        v_all = rules.all_gather(value, group, src=V, dst=R)
        scores = rules.einsum("bhqd,cbgkd->bhqk", query, k_all)
        return rules.einsum("bhqk,cbgke->bhqe", scores, v_all)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup, *,
                   rotate_method: str = "allgather", load_balance: bool = True,
                   mesh: Any = None) -> torch.Tensor:
    """Causal attention of this rank's ``query`` over every ``group`` rank's ``key``/``value``.

    Heads-first local tensors ``[batch, heads, seq/cp, head_dim]``; ``key``/``value`` may have
    fewer heads (a divisor: grouped-query attention), and keep them through the exchange.
    ``load_balance``: the tokens are laid out headtail (rank ``r`` holds chunks ``r`` and
    ``2 * cp - 1 - r``); otherwise rank ``r`` holds the ``r``-th contiguous slice.
    ``mesh``: the 1-D ``cp`` DeviceMesh, for a torch whose ring function takes a mesh.
    """
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"ring_attention: rotate_method={rotate_method!r}; valid values are "
                         f"{', '.join(map(repr, ROTATE_METHODS))}.")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"ring_attention: {query.shape[1]} query heads are not a multiple of "
                         f"{key.shape[1]} key/value heads.")
    where = None
    if _takes_mesh(_torch_cp._templated_ring_attention):  # pragma: no cover - torch < 2.9
        if mesh is None:
            raise ValueError("ring_attention: this torch's ring attention takes the cp DeviceMesh; pass mesh=.")
        where = mesh
    if torch.compiler.is_compiling() and where is None:
        return _traced()(query, key, value, group.group_name, rotate_method, load_balance)
    return _RingAttention.apply(query, key, value, group, rotate_method, load_balance, where)


def _ring_attention_by_name(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group_name: str,
                            rotate_method: str, load_balance: bool) -> torch.Tensor:
    """:class:`_RingAttention` with the group by name: under ``torch.compile`` (a block compiled
    with ``fullgraph``) it is marked ``nonstrict_trace``, so Dynamo does not step into torch's
    ring loop (Python control flow over a process group); AOT autograd traces its functional
    collectives and the autograd Function into the block's graph instead."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _RingAttention.apply(query, key, value, _resolve_process_group(group_name), rotate_method,
                                load_balance, None)


#: :func:`_ring_attention_by_name` marked ``nonstrict_trace``; made on first use (by
#: :func:`apply_context_parallel`, before any compile): marking imports all of Dynamo, about a
#: second of CPU on every rank and every ``torchrun`` start that never compiles.
_traced_ring_attention: Callable[..., torch.Tensor] | None = None


def _traced() -> Callable[..., torch.Tensor]:
    global _traced_ring_attention
    if _traced_ring_attention is None:
        import torch._dynamo  # noqa: PLC0415 - heavy: only for CP

        _traced_ring_attention = torch._dynamo.nonstrict_trace(_ring_attention_by_name)
    return _traced_ring_attention


# --------------------------------------------------------------------------- one rank's share
@dataclass(frozen=True)
class ContextParallel:
    """One rank's share of context parallelism: which tokens it holds, and its attention.

    Attributes:
        degree: the ``cp`` degree (> 1).
        rank: this rank's index on the ``cp`` mesh axis.
        load_balancer: ``"headtail"`` or None (see the module docstring).
        rotate_method: ``"allgather"`` or ``"alltoall"`` (see the module docstring).
        group: the ``cp`` process group (None: only the token layout is usable, not attention).
        mesh: the 1-D ``cp`` DeviceMesh (what an older torch's ring function takes).
    """

    degree: int
    rank: int
    load_balancer: str | None = "headtail"
    rotate_method: str = "allgather"
    group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    mesh: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.degree < 2 or not 0 <= self.rank < self.degree:
            raise ValueError(f"ContextParallel: need degree > 1 and 0 <= rank < degree, got "
                             f"degree={self.degree}, rank={self.rank}.")
        if self.load_balancer not in LOAD_BALANCERS:
            raise ValueError(f"ContextParallel.load_balancer={self.load_balancer!r}; valid values are "
                             f"{', '.join(map(repr, LOAD_BALANCERS))}.")
        if self.rotate_method not in ROTATE_METHODS:
            raise ValueError(f"ContextParallel.rotate_method={self.rotate_method!r}; valid values are "
                             f"{', '.join(map(repr, ROTATE_METHODS))}.")

    @classmethod
    def from_config(cls, job_config: JobConfig, parallel_dims: ParallelDims) -> ContextParallel | None:
        """Validate the CP config (:func:`validate_context_parallel`) and build this rank's share.

        None without context parallelism. ``parallel_dims`` must have built its meshes.
        """
        validate_context_parallel(job_config)
        if not parallel_dims.cp_enabled:
            return None
        mesh = parallel_dims.get_mesh("cp")
        par = job_config.parallelism
        return cls(degree=parallel_dims.cp, rank=mesh.get_local_rank(),
                   load_balancer=par.context_parallel_load_balancer,
                   rotate_method=par.context_parallel_rotate_method, group=mesh.get_group(), mesh=mesh)

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
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's local heads-first ``q`` over every rank's ``k``/``v``
        (:func:`ring_attention` on the ``cp`` group, this share's balancer and rotate method)."""
        if self.group is None:
            raise ValueError("ContextParallel.attention needs the cp process group (ContextParallel.group); "
                             "build it with ContextParallel.from_config.")
        if k.shape[-2] != q.shape[-2]:
            raise ValueError(
                f"context-parallel attention got {q.shape[-2]} queries and {k.shape[-2]} keys on this rank; "
                "keys and values must be this rank's slice (S(2)@cp), exchanged inside the kernel: "
                "do not gather them in the plan."
            )
        return ring_attention(q, k, v, self.group, rotate_method=self.rotate_method,
                              load_balance=self.load_balancer == "headtail", mesh=self.mesh)

    def attention_forward(self, forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """The body replacing an attention kernel's ``forward(q, k, v)`` (heads-first
        ``[batch, heads, seq, head_dim]``, the kernel's own causal SDPA): :meth:`attention`."""

        @functools.wraps(forward)
        def cp_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            if kwargs:
                raise TypeError(f"context-parallel attention takes (q, k, v) only, got {sorted(kwargs)}.")
            return self.attention(q, k, v)

        return cp_forward


def apply_context_parallel(model: nn.Module, plan: ShardingPlan, cp: ContextParallel | None) -> None:
    """Give each of the plan's attention kernels (``plan.attention``) the context-parallel body.

    Call before :func:`~torchtitan_spmd.distributed.apply_plan.apply_plan`, so that the
    representation's local region wraps the CP body. No-op without CP. Raises
    ValueError when the plan names no attention kernel or a pattern matches nothing.
    """
    if cp is None:
        return
    _traced()  # outside any compile: Dynamo reads the marked function as a global
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
