"""Runtime helpers whose names mirror ``torchtitan.distributed.utils``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from .backends import get_backend

if TYPE_CHECKING:
    from .parallel_dims import ParallelDims

__all__ = ["get_spmd_backend", "get_train_context", "set_spmd_backend"]

_current_backend = "default"


def set_spmd_backend(name: str) -> None:
    """Select the process-wide SPMD backend (``parallelism.spmd_backend``).

    Raises ValueError for an unknown name, or a backend with no runtime in this build.
    """
    global _current_backend
    get_backend(name)  # validates the name and that the runtime exists
    _current_backend = name


def get_spmd_backend() -> str:
    """The process-wide SPMD backend set by :func:`set_spmd_backend` (default ``"default"``)."""
    return _current_backend


def get_train_context(
    *,
    enable_loss_parallel: bool,
    parallel_dims: ParallelDims | None = None,
    spmd_typechecking: bool = False,
) -> Callable[[], AbstractContextManager[None]]:
    """A factory of the context to run forward, loss and backward in.

    Usage, as in torchtitan::

        train_context = get_train_context(enable_loss_parallel=True, parallel_dims=pd)
        with train_context():
            loss = loss_fn(model(inputs), labels)
            loss.backward()

    What the context does belongs to the current backend (loss parallel for the
    DTensor backends; the current mesh and optional type checking for ``spmd_types``).
    """
    backend = get_backend(get_spmd_backend())

    def context() -> AbstractContextManager[None]:
        return backend.train_context(
            enable_loss_parallel=enable_loss_parallel,
            parallel_dims=parallel_dims,
            spmd_typechecking=spmd_typechecking,
        )

    return context
