"""Which upstream torchtitan a fork follows: its *surface* (spellings and defaults only).

The library has one backend registry (:mod:`.backends`) and one runtime. A fork that
merged upstream up to a0c831c49 (June 2026) and a fork that merged up to b5bcd76
(August 2026) spell and default some things differently; a surface is that difference,
as data, and nothing else:

=====================  ==========================================  ==========================
                       ``june`` (a0c831c49; the default)           ``august`` (b5bcd76)
=====================  ==========================================  ==========================
default backend        ``"default"``                               ``"spmd_types"`` (#4085)
the DTensor backend    ``"default"`` (``"partial_dtensor"`` too)   ``"partial_dtensor"``
                                                                   (``"default"``: warns)
``full_dtensor``       a backend                                   this library's extension;
                                                                   warns (upstream #4217)
=====================  ==========================================  ==========================

A fork declares its surface in one line, either in the environment
(``TORCHTITAN_SPMD_SURFACE=august``, read on first use) or in code before it builds a
config (``torchtitan_spmd.config.set_surface("august")``). The value a fork writes to
``parallelism.spmd_backend`` (or ``ParallelDims.spmd_backend``) is the value its code
reads back; the runtime looks the canonical backend up with :func:`canonical_backend`.
"""

from __future__ import annotations

from typing import Any

from torchtitan_spmd._errors import warn_at_user_line
from torchtitan_spmd._surface import (
    ENV_VAR,
    SURFACES,
    Surface,
    UpstreamRemovedWarning,
    UpstreamRenamedWarning,
    get_surface,
    set_surface,
)

from .backends import resolve_backend

__all__ = [
    "ENV_VAR",
    "SURFACES",
    "Surface",
    "UpstreamRemovedWarning",
    "UpstreamRenamedWarning",
    "canonical_backend",
    "check_backend_spelling",
    "get_surface",
    "set_surface",
    "warn_backend_spelling",
]


def canonical_backend(spelling: Any, where: str = "parallelism.spmd_backend") -> str:
    """The registry's name of a backend spelling (``"partial_dtensor"`` -> ``"default"``)."""
    return resolve_backend(spelling, where)


def check_backend_spelling(value: Any, where: str = "parallelism.spmd_backend") -> str:
    """Validate a backend spelling against the registry; return it *as written*."""
    resolve_backend(value, where)
    return str(value)


def warn_backend_spelling(value: str, where: str = "parallelism.spmd_backend") -> None:
    """Warn when ``value`` is a spelling the current surface's upstream renamed or removed."""
    entry = get_surface().deprecated.get(value)
    if entry is not None:
        category, message = entry
        if where != "parallelism.spmd_backend":
            message = message.replace("parallelism.spmd_backend", where)
        warn_at_user_line(message, category)
