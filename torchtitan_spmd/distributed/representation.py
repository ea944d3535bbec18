"""How an SPMD backend represents tensors: the narrow interface, and its registry.

Every ``parallelism.spmd_backend`` is one :class:`TensorRepresentation`: the
answer to "what is this rank's copy of a tensor laid out as ``SpmdLayout`` L?".
``default`` answers "a DTensor on the ``tp`` mesh inside the modules that compute
with parameters, a plain local tensor between them"; ``full_dtensor`` "a DTensor
on the dense mesh, always"; ``spmd_types`` "a plain local shard, typed with
``spmd_types``". Everything else -- applying the plan, FSDP, the loss, gradient
clipping, inputs, initialisation -- is a technique written once against this
interface (``distributed/apply_plan.py``, ``fsdp.py``, ``loss.py``, ...).

The interface, in the order a train step meets it:

================================  ==================================================
``forward_mesh``                  the mesh forward and backward run on (None: nothing
                                  is distributed)
``validate(job_config)``          setup-time errors for what this backend cannot run
``check_plan(plan)``              setup-time errors for plans it cannot interpret
``distribute(tensor, layout)``    a full parameter/buffer -> this rank's value
``from_local(x, layout)``         a local data shard (batch-sharded on DP) -> value
``arrive(x, layout, ...)``        a value entering a plan boundary
``redistribute(x, src, dst)``     between two layouts of the plan
``depart(x, layout)``             a value leaving a module's output boundary
``local_region(fn, layout)``      run a module body on local shards
``to_local(x)``                   this rank's shard as a plain tensor
``sum_over_batch(x)``             sum a per-rank partial value over the DP ranks
``fsdp_spec()``                   what ``fully_shard`` shards (mesh, dp_mesh_dims)
``grad_shard_groups(param)``      the groups a plain gradient is sharded over
``materialize(model, states, d)`` allocate a meta-built, sharded model
``to_dtensor(tensor, state)``     a DTensor view sharing storage (state dicts, init)
``train_context(mesh, ...)``      the context forward, loss and backward run in
================================  ==================================================

Layouts name only the model-parallel axes (``tp``, later ``cp``/``ep``); the
data-parallel axes are the representation's business: data is batch-sharded on
them and parameters replicated (FSDP shards storage separately). The registry
(:func:`get_representation`) imports ``distributed/representations/<name>`` on
first use and is the only place that maps a backend name to code.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.torch_version import TorchVersion

from torchtitan_spmd.config.backends import backend, backend_names

from .layout import SpmdLayout

if TYPE_CHECKING:
    from torch.distributed.fsdp import DataParallelMeshDims

    from torchtitan_spmd.config import JobConfig

    from .expert_exchange import ExpertExchange
    from .parallel_dims import ParallelDims
    from .plan import ShardingPlan

__all__ = [
    "FsdpSpec",
    "StateLayout",
    "TensorRepresentation",
    "as_parameter_like",
    "build_representation",
    "describe_unsupported",
    "get_representation",
    "representation_module_name",
    "torch_at_least",
]


@dataclass(frozen=True)
class FsdpSpec:
    """What FSDP2's ``fully_shard`` shards under one representation.

    Attributes:
        mesh: the mesh passed to ``fully_shard``.
        dp_mesh_dims: which of its dims are data-parallel (``fully_shard(...,
            dp_mesh_dims=...)``); None when every dim of ``mesh`` is.

    Gradients are always *summed* across the data-parallel ranks: the loss
    technique makes every rank's loss its share of the global mean.
    """

    mesh: DeviceMesh
    dp_mesh_dims: DataParallelMeshDims | None = None


@dataclass(frozen=True)
class StateLayout:
    """The layout and the full (global) shape of one parameter or buffer.

    Recorded by :func:`~torchtitan_spmd.distributed.apply_plan.apply_plan` for every
    state of the model; what :meth:`TensorRepresentation.to_dtensor` needs to view a
    plain local shard as the global tensor it is part of.
    """

    layout: SpmdLayout
    global_shape: torch.Size


def describe_unsupported(backend: str, what: str, alternative: str) -> str:
    """Uniform wording for setup-time errors about unsupported combinations."""
    return f"spmd_backend={backend!r} does not support {what}; {alternative}"


def torch_at_least(minimum: str) -> bool:
    """Whether the running torch is release ``minimum`` (``"2.14"``) or newer.

    Pre-releases, dev and source builds of ``minimum`` count as it (``2.14.0a0+git...``,
    ``2.14.0.dev2026...``). Read at call time, so a setup check sees the torch of the process.
    """
    return TorchVersion(torch.__version__) >= f"{minimum}.dev0"


def as_parameter_like(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` as an ``nn.Parameter`` with ``old``'s ``requires_grad`` if ``old`` is one."""
    if isinstance(old, nn.Parameter):
        return nn.Parameter(new, requires_grad=old.requires_grad)
    return new


class _FromRegistry:
    """A class attribute read from this backend's record in the backend registry."""

    def __init__(self, field: str, doc: str) -> None:
        self.field, self.__doc__ = field, doc

    def __get__(self, obj: object, owner: type[TensorRepresentation]) -> bool:
        return bool(getattr(backend(owner.name), self.field))


class TensorRepresentation(ABC):
    """How one SPMD backend represents tensors. One subclass per backend module.

    An instance is bound to one :class:`ParallelDims` (whose meshes are built): the
    trainer holds it, and nothing about it is process-global. What the library knows
    about the backend by name (its meshes, the two flags below) is its record in the
    backend registry (:mod:`torchtitan_spmd.config.backends`).
    """

    #: The ``parallelism.spmd_backend`` value this representation implements.
    name: ClassVar[str]
    supports_typechecking = _FromRegistry(
        "typechecking", "Whether ``debug.spmd_typechecking`` checks anything under this backend.")
    supports_context_parallel = _FromRegistry(
        "context_parallel", "Whether this backend runs context parallelism (``context_parallel_degree > 1``): "
        "sequence-sharded activations and ring attention over ``cp``.")
    supports_pipeline_parallel = _FromRegistry(
        "pipeline_parallel", "Whether this backend runs pipeline parallelism (``pipeline_parallel_degree > 1``): "
        "its stages meet torch's pipelining through ``from_local``/``to_local`` with the plan's stage_boundary.")
    supports_local_tensor = _FromRegistry(
        "local_tensor", "Whether ``comm.mode='local_tensor'`` simulates this backend in one process "
        "(torch's LocalTensorMode), its numbers measured equal to the multi-process run's.")

    def __init__(self, parallel_dims: ParallelDims) -> None:
        self.parallel_dims = parallel_dims

    @functools.cached_property
    def forward_mesh(self) -> DeviceMesh | None:
        """The mesh this backend's forward and backward run on (None: nothing is distributed),
        resolved on first use: a representation can be built, and :meth:`validate` run, before
        ``parallel_dims`` builds its meshes."""
        return self.resolve_forward_mesh(self.parallel_dims)

    # ------------------------------------------------------------------ setup
    @staticmethod
    @abstractmethod
    def resolve_forward_mesh(parallel_dims: ParallelDims) -> DeviceMesh | None:
        """The mesh this backend's forward and backward run on; None: nothing is distributed."""

    def validate(self, job_config: JobConfig) -> None:
        """Raise ``ValueError`` at setup for what this backend cannot run.

        Pipeline parallelism runs only under the backends whose registry record says so
        (expert parallelism's errors: ``expert_parallel.validate_expert_parallel``).
        (Context parallelism under a backend without :attr:`supports_context_parallel` is
        rejected earlier, once, by ``context_parallel.validate_context_parallel``.)
        """
        pd, name = self.parallel_dims, self.name
        if pd.pp_enabled and not self.supports_pipeline_parallel:
            running = [b for b in backend_names() if backend(b).pipeline_parallel]
            raise ValueError(describe_unsupported(
                name, "pipeline parallelism in this runtime",
                f"it runs under parallelism.spmd_backend {', '.join(map(repr, running))}; or set "
                "parallelism.pipeline_parallel_degree=1."
            ))

    def require_torch(self, minimum: str, what: str, needs: str, instead: str, *,
                      available: bool | None = None) -> None:
        """Raise ``ValueError`` at setup unless this torch can run ``what``.

        ``available``: a feature check where torch has one; otherwise the running
        torch's version decides (:func:`torch_at_least`). The message names the
        backend, ``what``, the running torch, ``minimum`` and what ``needs`` it.
        """
        if available is None:
            available = torch_at_least(minimum)
        if not available:
            raise ValueError(describe_unsupported(
                self.name, f"{what} on torch {torch.__version__}",
                f"it needs torch >= {minimum} ({needs}). {instead}",
            ))

    def require_torch_for_data_parallel(self, minimum: str, needs: str, *,
                                        available: bool | None = None) -> None:
        """:meth:`require_torch` for FSDP, when data or context parallelism is on (FSDP shards
        over ``dp_shard x cp``)."""
        pd = self.parallel_dims
        if pd.dp_cp_enabled:
            self.require_torch(
                minimum, f"data-parallel sharding (dp_replicate={pd.dp_replicate}, dp_shard={pd.dp_shard}, "
                f"cp={pd.cp})",
                needs, f"Upgrade torch to {minimum} or newer, or use parallelism.spmd_backend='default'.",
                available=available,
            )

    def check_plan(self, plan: ShardingPlan) -> None:  # noqa: B027 - optional hook
        """Raise ``ValueError`` at setup for plan boundaries this backend cannot run."""

    # ------------------------------------------------------------------ tensors
    @abstractmethod
    def distribute(self, tensor: torch.Tensor, layout: SpmdLayout) -> torch.Tensor:
        """This rank's value of the full parameter or buffer ``tensor`` laid out as ``layout``.

        Replicated on the data-parallel axes. A parameter comes back as an
        ``nn.Parameter`` with the same ``requires_grad`` (see :func:`as_parameter_like`);
        ``tensor`` may be on the meta device.
        """

    @abstractmethod
    def from_local(self, x: torch.Tensor, layout: SpmdLayout) -> torch.Tensor:
        """Represent ``x``, this rank's shard of a batch-sharded value with ``layout``."""

    @abstractmethod
    def arrive(self, x: Any, layout: SpmdLayout, *, module: nn.Module, where: str) -> Any:
        """``x`` enters ``module`` at a boundary the plan declares as ``layout``.

        Returns what the module body computes with. A representation may check
        the declaration (``where`` names the boundary in errors).
        """

    @abstractmethod
    def redistribute(self, x: Any, src: SpmdLayout, dst: SpmdLayout, *, where: str) -> Any:
        """``x``, laid out as ``src``, laid out as ``dst`` instead."""

    def depart(self, x: Any, layout: SpmdLayout | None, *, where: str) -> Any:
        """``x`` leaves a module's output boundary with ``layout`` (None: undeclared)."""
        return x

    @abstractmethod
    def local_region(self, forward: Callable[..., Any], out_layout: SpmdLayout, *,
                     where: str) -> Callable[..., Any]:
        """Wrap a module's ``forward`` so that its body runs on local shards.

        The wrapped body sees plain local tensors (positional and keyword
        arguments) and returns one laid out as ``out_layout``.
        """

    def module_body(self, module: nn.Module, forward: Callable[..., Any], out_layout: SpmdLayout | None, *,
                    where: str) -> Callable[..., Any] | None:
        """The ``forward`` of a planned module that is not a local region, wrapped, or None
        to leave it as it is (the default). ``out_layout`` is the layout its body produces,
        before any redistribution of its output."""
        return None

    @abstractmethod
    def to_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``x`` as a tensor the local kernels accept (autograd-safe)."""

    @abstractmethod
    def sum_over_batch(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (a per-rank partial value, no gradient) over the ranks holding different data."""

    # ------------------------------------------------------------------ FSDP and gradients
    @abstractmethod
    def fsdp_spec(self) -> FsdpSpec | None:
        """What ``fully_shard`` shards, or None when there is no data parallelism."""

    def grad_shard_groups(self, param: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
        """The groups over which the plain (non-DTensor) gradient of ``param`` is sharded.

        A gradient norm sums its local squares over exactly these. DTensor
        gradients carry their own placements; plain ones are replicated unless a
        representation says otherwise.
        """
        return ()

    # ------------------------------------------------------------------ expert parallelism
    def distribute_experts(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a grouped expert weight ``[num_experts, ...]``: ``Shard(0)`` on the
        1-D ``ep`` mesh (a DTensor; ``spmd_types`` overrides it). May be on the meta device.
        ``tensor``: a plain full tensor, or (tensor parallelism) the plan's DTensor replicated on ``tp``."""
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        full = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        ep = self.parallel_dims.get_mesh("ep")
        return as_parameter_like(tensor, distribute_tensor(full.detach(), ep, [Shard(0)], src_data_rank=None))

    def expert_exchange(self, group: dist.ProcessGroup) -> ExpertExchange:
        """The collectives of expert parallelism over ``group`` (``ep``): torch's ``all_to_all_single``,
        the rows' with autograd (``spmd_types`` types them)."""
        from .expert_exchange import ExpertExchange

        return ExpertExchange(group)

    def expert_fsdp_spec(self) -> FsdpSpec | None:
        """What ``fully_shard`` shards the expert modules over under expert parallelism: ``efsdp``
        (``(dp_replicate, efsdp)`` for HSDP); None without EP."""
        pd = self.parallel_dims
        if not pd.ep_enabled:
            return None
        return FsdpSpec(mesh=pd.get_mesh(["dp_replicate", "efsdp"]) if pd.dp_replicate_enabled else pd.get_mesh("efsdp"))

    # ------------------------------------------------------------------ state
    def materialize(self, model: nn.Module, states: Mapping[str, StateLayout],
                    device: torch.device | str) -> None:
        """Allocate (uninitialised) storage for a model built on the meta device and sharded.

        ``states``: what :func:`~torchtitan_spmd.distributed.apply_plan.apply_plan` returned.
        """
        model.to_empty(device=device)

    @abstractmethod
    def to_dtensor(self, tensor: torch.Tensor, state: StateLayout) -> torch.Tensor:
        """A DTensor view of this rank's value of a state, sharing its storage.

        DTensors are returned unchanged; so is a plain tensor when nothing is
        distributed (one rank, no mesh): it is then the full tensor.
        """

    # ------------------------------------------------------------------ train step
    @classmethod
    def train_context(cls, forward_mesh: DeviceMesh | None, *, loss_parallel: bool,
                      typechecking: bool) -> AbstractContextManager[None]:
        """The context forward, loss and backward run in (a classmethod: usable without a trainer).

        ``loss_parallel``: torch's ``loss_parallel()`` for DTensor logits (forks' own
        losses); ``typechecking``: ``debug.spmd_typechecking``.
        """
        return contextlib.nullcontext()


# ======================================================================================
# The registry's runtime half: a backend's record names its module; import it once.
# ======================================================================================
def representation_module_name(name: str) -> str:
    """The module that implements backend ``name`` (its registry record's ``module``)."""
    return backend(name).module


_CACHE: dict[tuple[str, str], type[TensorRepresentation]] = {}


def get_representation(name: str) -> type[TensorRepresentation]:
    """The representation class of backend ``name``.

    Raises ValueError for a name the backend registry does not hold (the registry's
    error), and naming the missing module when the backend is valid but its runtime
    is not part of this build (e.g. a stack prefix without the ``spmd_types`` layer).
    """
    entry = backend(name)
    name = entry.name
    cached = _CACHE.get((name, entry.module))
    if cached is None:
        module_name = entry.module
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:
                raise
            raise ValueError(
                f"spmd_backend {name!r} has no runtime in this build ({module_name} is missing)."
            ) from err
        cls = getattr(module, "REPRESENTATION", None)
        if not (isinstance(cls, type) and issubclass(cls, TensorRepresentation)) or cls.name != name:
            raise TypeError(
                f"{module_name}.REPRESENTATION must be a TensorRepresentation subclass named {name!r}."
            )
        _CACHE[(name, entry.module)] = cached = cls
    return cached


def build_representation(parallel_dims: ParallelDims) -> TensorRepresentation:
    """The representation of ``parallel_dims.spmd_backend``, bound to ``parallel_dims``."""
    return get_representation(parallel_dims.spmd_backend)(parallel_dims)

