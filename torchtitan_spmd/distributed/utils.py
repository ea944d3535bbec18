"""Upstream's names in ``torchtitan.distributed.utils``, for forks: the backend and the train context.

- :func:`get_train_context` takes the backend from ``parallel_dims.spmd_backend``
  (as upstream does), so it always agrees with the trainer that owns those dims;
- :func:`maybe_enable_amp` is the compute dtype of a model FSDP does not wrap
  (``torch.autocast``); FSDP's ``MixedPrecisionPolicy`` sets it otherwise;
- :func:`get_spmd_backend` answers, inside a trainer's setup or train context,
  that trainer's backend (a context-local scope, see :func:`spmd_backend_scope`);
  elsewhere the process default that :func:`set_spmd_backend` sets. The trainer
  itself never reads the process default.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from torchtitan_spmd.config.surface import get_surface

from .representation import get_representation

if TYPE_CHECKING:
    from .parallel_dims import ParallelDims
    from .representation import TensorRepresentation

__all__ = ["get_spmd_backend", "get_train_context", "maybe_enable_amp", "set_spmd_backend", "spmd_backend_scope"]

_process_default: str | None = None  # None: the fork's surface's default backend
_scoped: contextvars.ContextVar[str | None] = contextvars.ContextVar("torchtitan_spmd_backend", default=None)


def set_spmd_backend(name: str) -> None:
    """Set the backend :func:`get_spmd_backend` reports outside any trainer.

    Raises ValueError for an unknown name, or a backend with no runtime in this build.
    """
    global _process_default
    get_representation(name)  # validated; the runtime exists
    _process_default = name  # as written: a fork reads back its own spelling


def get_spmd_backend() -> str:
    """The backend of the innermost :func:`spmd_backend_scope` (a trainer's), else the process default."""
    scoped = _scoped.get()
    if scoped is not None:
        return scoped
    return _process_default if _process_default is not None else get_surface().default_backend


def spmd_backend_scope(name: str) -> AbstractContextManager[None]:
    """Within this context (and this thread/task), :func:`get_spmd_backend` returns ``name``."""
    get_representation(name)  # validated; the runtime exists
    return _scope(name)  # as written: a fork reads back its own spelling (e.g. "partial_dtensor")


@contextlib.contextmanager
def _scope(name: str) -> Iterator[None]:
    """:func:`spmd_backend_scope` of a name already validated."""
    token = _scoped.set(name)
    try:
        yield
    finally:
        _scoped.reset(token)


def get_train_context(
    *,
    enable_loss_parallel: bool,
    parallel_dims: ParallelDims | None = None,
    spmd_typechecking: bool = False,
    representation: TensorRepresentation | None = None,
) -> Callable[[], AbstractContextManager[None]]:
    """A factory of the context to run forward, loss and backward in.

    Usage, as in torchtitan::

        train_context = get_train_context(enable_loss_parallel=True, parallel_dims=pd)
        with train_context():
            loss = loss_fn(model(inputs), labels)
            loss.backward()

    The backend is ``parallel_dims.spmd_backend`` (without ``parallel_dims``: the
    process default, and no mesh). What the context does belongs to that backend's
    representation: torch's ``loss_parallel()`` for the DTensor backends; the
    forward mesh and optional type checking for ``spmd_types``. ``representation``
    (this library's keyword; the trainer passes its own): use that instance and its
    forward mesh instead of looking the backend up.
    """
    if representation is not None:
        cls: type[TensorRepresentation] = type(representation)
        mesh = representation.forward_mesh
    else:
        cls = get_representation(parallel_dims.spmd_backend if parallel_dims is not None else get_spmd_backend())
        mesh = cls.resolve_forward_mesh(parallel_dims) if parallel_dims is not None else None
    backend = cls.name

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with _scope(backend), cls.train_context(
            mesh, loss_parallel=enable_loss_parallel, typechecking=spmd_typechecking
        ):
            yield

    return context


def maybe_enable_amp(parallel_dims: ParallelDims, mixed_precision_param: str,
                     device_type: str) -> AbstractContextManager[Any]:
    """The context the model's forward runs in for ``training.mixed_precision_param``.

    With data parallelism FSDP2's ``MixedPrecisionPolicy`` gathers the parameters in
    that dtype (:mod:`torchtitan_spmd.techniques.fsdp`), so nothing is needed here.
    Without it (one rank, or tensor parallelism only) the forward runs under
    ``torch.autocast(device_type, dtype)``: matmuls compute in that dtype, parameters,
    gradients and optimizer state stay float32. ``"float32"``: no context.
    """
    if mixed_precision_param == "float32" or parallel_dims.dp_enabled:
        return contextlib.nullcontext()
    import torch

    from torchtitan_spmd.config import TORCH_DTYPE_MAP

    dtype = TORCH_DTYPE_MAP.get(mixed_precision_param)
    if dtype is None:
        raise ValueError(
            f"training.mixed_precision_param={mixed_precision_param!r}; valid choices are "
            f"{', '.join(map(repr, TORCH_DTYPE_MAP))}."
        )
    return torch.autocast(device_type=device_type, dtype=dtype)  # type: ignore[arg-type]
