"""The backend registry: the one place that maps ``spmd_backend`` names to code.

Each backend lives in its own module, ``torchtitan_spmd.distributed.<name>``,
which defines ``BACKEND``, an instance of :class:`SpmdBackendRuntime`. The
registry imports that module on first use, so adding a backend means adding a
module; nothing else in the runtime branches on the backend's name.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from torchtitan_spmd.config import JobConfig

    from .parallel_dims import ParallelDims
    from .plan import ShardingPlan


class SpmdBackendRuntime(ABC):
    """What the trainer needs from a backend. One subclass per backend module."""

    #: The ``parallelism.spmd_backend`` value this runtime implements.
    name: ClassVar[str]

    @abstractmethod
    def validate_config(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        """Raise ``ValueError`` for combinations this backend does not support, at setup time."""

    @abstractmethod
    def parallelize(
        self,
        model: nn.Module,
        parallel_dims: ParallelDims,
        plan: ShardingPlan,
        job_config: JobConfig,
    ) -> nn.Module:
        """Shard the full, initialised CPU ``model`` per ``plan``; apply FSDP; return it."""

    @abstractmethod
    def prepare_inputs(
        self, tokens: torch.Tensor, labels: torch.Tensor, parallel_dims: ParallelDims
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Turn this rank's local batch (plain tensors) into what the model consumes."""

    @abstractmethod
    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy whose gradient, after FSDP's reduction, is the global mean's."""

    @abstractmethod
    def loss_value(self, loss: torch.Tensor, parallel_dims: ParallelDims) -> float:
        """The true global mean loss, as a float, identical on every rank."""

    @abstractmethod
    def train_context(
        self,
        *,
        enable_loss_parallel: bool,
        parallel_dims: ParallelDims | None,
        spmd_typechecking: bool,
    ) -> AbstractContextManager[None]:
        """The context for forward, loss and backward."""

    @abstractmethod
    def clip_grad_norm_(
        self, model: nn.Module, max_norm: float, parallel_dims: ParallelDims
    ) -> float:
        """Clip gradients to ``max_norm`` over the true global norm; return that norm."""


def backend_module_name(name: str) -> str:
    """The module that implements backend ``name`` (by convention)."""
    return f"{__package__}.{name}"


_CACHE: dict[str, SpmdBackendRuntime] = {}


def get_backend(name: str) -> SpmdBackendRuntime:
    """The runtime of backend ``name``.

    Raises ValueError for an unknown name, and naming the missing module when
    the backend is valid but its runtime is not part of this build (e.g. a
    stack prefix without the ``spmd_types`` layer).
    """
    from torchtitan_spmd.config import SPMD_BACKENDS

    if name not in SPMD_BACKENDS:
        raise ValueError(
            f"unknown spmd_backend {name!r}; valid choices are {', '.join(map(repr, SPMD_BACKENDS))}."
        )
    if name not in _CACHE:
        module_name = backend_module_name(name)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:
                raise
            raise ValueError(
                f"spmd_backend {name!r} has no runtime in this build ({module_name} is missing)."
            ) from err
        backend = getattr(module, "BACKEND", None)
        if not isinstance(backend, SpmdBackendRuntime) or backend.name != name:
            raise TypeError(f"{module_name}.BACKEND must be a SpmdBackendRuntime named {name!r}.")
        _CACHE[name] = backend
    return _CACHE[name]


def describe_unsupported(backend: str, what: str, alternative: str) -> str:
    """Uniform wording for setup-time errors about unsupported combinations."""
    return f"spmd_backend={backend!r} does not support {what}; {alternative}"


def reject_unimplemented_parallelism(
    backend: str,
    parallel_dims: ParallelDims,
    *,
    cp_what: str = "context parallelism in this runtime",
) -> None:
    """Raise ValueError for CP, PP or EP, which no runtime of this library implements yet.

    ``ParallelDims`` builds their meshes (layer 2); the trainer cannot use them.
    """
    if parallel_dims.cp_enabled:
        raise ValueError(describe_unsupported(
            backend, cp_what,
            "set parallelism.context_parallel_degree=1 (CP needs ring attention, not implemented).",
        ))
    if parallel_dims.pp_enabled:
        raise ValueError(describe_unsupported(
            backend, "pipeline parallelism in this runtime", "set parallelism.pipeline_parallel_degree=1."
        ))
    if parallel_dims.ep_enabled:
        raise ValueError(describe_unsupported(
            backend, "expert parallelism for the dense Llama model",
            "set parallelism.expert_parallel_degree=1 (EP needs an MoE model).",
        ))


ContextFactory = Callable[[], AbstractContextManager[None]]
