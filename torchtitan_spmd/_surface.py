"""The surfaces' data and the process's choice; see :mod:`torchtitan_spmd.config.surface`.

A top-level module (no import of the config package) so that ``compat/`` can spell legacy
values in the fork's surface without an import circle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from torchtitan_spmd._errors import suggest

__all__ = ["ENV_VAR", "SURFACES", "Surface", "UpstreamRemovedWarning", "UpstreamRenamedWarning", "get_surface",
           "set_surface"]

#: The environment variable that declares a fork's surface (``june`` or ``august``).
ENV_VAR = "TORCHTITAN_SPMD_SURFACE"


class UpstreamRenamedWarning(DeprecationWarning):
    """A spelling that the fork's upstream generation renamed (e.g. ``"default"`` under ``august``)."""


class UpstreamRemovedWarning(DeprecationWarning):
    """A value the fork's upstream generation removed, kept here as this library's extension."""


@dataclass(frozen=True)
class Surface:
    """One upstream generation's spellings and defaults over the one registry."""

    name: str
    """``"june"`` or ``"august"``."""

    commit: str
    """The upstream commit it follows."""

    default_backend: str
    """The default of ``parallelism.spmd_backend`` / ``ParallelDims.spmd_backend``, as spelled there."""

    spellings: dict[str, str]
    """The spelling of each canonical backend name on this surface (what the codemod writes)."""

    deprecated: dict[str, tuple[type[Warning], str]] = field(default_factory=dict)
    """Spellings accepted with a warning: ``spelling -> (category, message)``."""

    num_pp_microbatches: int | None = None
    """The default of ``parallelism.num_pp_microbatches``: None (June has no such field) or
    upstream b5bcd76's ``1`` (its trainer compares the value with 0 and multiplies by it)."""

    activation_checkpoint_policies: bool = False
    """The default of a root's ``activation_checkpoint``: June's section (``mode="selective"``), or
    upstream b5bcd76's policy config ``SelectiveAC.Config()`` (#3674): the same policy."""


SURFACES: dict[str, Surface] = {
    "june": Surface(
        name="june",
        commit="a0c831c49",
        default_backend="default",
        spellings={"default": "default", "full_dtensor": "full_dtensor", "spmd_types": "spmd_types"},
    ),
    "august": Surface(
        name="august",
        commit="b5bcd76",
        default_backend="spmd_types",
        spellings={"default": "partial_dtensor", "full_dtensor": "full_dtensor", "spmd_types": "spmd_types"},
        num_pp_microbatches=1,
        activation_checkpoint_policies=True,
        deprecated={
            "default": (
                UpstreamRenamedWarning,
                "parallelism.spmd_backend='default' is upstream's June spelling; upstream renamed it "
                "'partial_dtensor' (pytorch/torchtitan#4085): write 'partial_dtensor'. The value reads "
                "back as 'default', as written.",
            ),
            "full_dtensor": (
                UpstreamRemovedWarning,
                "parallelism.spmd_backend='full_dtensor' was removed upstream (pytorch/torchtitan#4217); "
                "it keeps training here as torchtitan_spmd's extension, and upstream's code at b5bcd76 "
                "does not know it (use 'spmd_types' or 'partial_dtensor' to stay on upstream's surface).",
            ),
        },
    ),
}

_current: Surface | None = None


def _from_env() -> Surface:
    raw = os.environ.get(ENV_VAR, "june").strip().lower() or "june"
    if raw not in SURFACES:
        raise ValueError(
            f"{ENV_VAR}={raw!r}: invalid surface; valid choices are "
            f"{', '.join(map(repr, SURFACES))}.{suggest(raw, SURFACES)}"
        )
    return SURFACES[raw]


def get_surface() -> Surface:
    """The surface in effect: :func:`set_surface`'s, else ``$TORCHTITAN_SPMD_SURFACE``, else ``june``."""
    global _current
    if _current is None:
        _current = _from_env()
    return _current


def set_surface(name: str | None) -> Surface | None:
    """Declare the fork's surface (``"june"`` or ``"august"``); ``None`` goes back to the environment's.

    Call it once, before building any config section or ``ParallelDims``: the defaults of
    objects built earlier do not change. Returns the surface now in effect (None: the
    environment's, read on next use).
    """
    global _current
    if name is None:
        _current = None
        return None
    if not isinstance(name, str) or name not in SURFACES:
        raise ValueError(
            f"set_surface: invalid surface {name!r}; valid choices are "
            f"{', '.join(map(repr, SURFACES))}.{suggest(name, SURFACES)}"
        )
    _current = SURFACES[name]
    return _current
