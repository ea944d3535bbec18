"""Where a fork imports torchtitan's ``validate_cp_backend`` (b5bcd76:
``torchtitan.distributed.context_parallel``): the one check of the backend that runs context
parallelism, shared with :mod:`torchtitan_spmd.techniques.context_parallel` (which runs it at
setup, with the rest of CP's checks).

Which backends run CP is their registry record's ``context_parallel`` flag
(:mod:`torchtitan_spmd.config.backends`), read through each backend's representation, so a
stack prefix without a backend's runtime does not offer it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan_spmd.config.backends import backend_names, resolve_backend
from torchtitan_spmd.distributed.representation import get_representation

if TYPE_CHECKING:
    from torchtitan_spmd.config import ParallelismConfig

__all__ = ["context_parallel_backends", "validate_cp_backend"]


def context_parallel_backends() -> tuple[str, ...]:
    """The ``spmd_backend`` values whose representation runs context parallelism (in this build)."""
    names = []
    for name in backend_names():
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
    if resolve_backend(parallelism.spmd_backend) not in backends:  # a spelling such as partial_dtensor
        wanted = " or ".join(f"parallelism.spmd_backend={b!r}" for b in backends) or "a backend with CP"
        raise ValueError(
            f"Context Parallel requires {wanted}, got {parallelism.spmd_backend!r} "
            f"(parallelism.context_parallel_degree={parallelism.context_parallel_degree}); "
            "or set parallelism.context_parallel_degree=1."
        )
