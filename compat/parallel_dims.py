"""Legacy ``full_dtensor`` support for :class:`~torchtitan_spmd.distributed.ParallelDims`.

``ParallelDims`` applies :func:`legacy_parallel_dims` on one line marked
``# compat hook``. It adds the two legacy channels that upstream torchtitan's
``ParallelDims`` had:

- the constructor keyword: ``ParallelDims(..., full_dtensor=True)``;
- the attribute: reading and assigning ``pd.full_dtensor``.

Each emits one :class:`~torchtitan_spmd.compat.legacy.LegacySpellingWarning`
attributed to the user's line. Deleting this module together with the hook
lines leaves ``ParallelDims`` without legacy support and otherwise unchanged.
"""

from __future__ import annotations

from typing import TypeVar

from typing_extensions import deprecated

from .legacy import accept_legacy_backend_kwarg, read_legacy_attribute, write_legacy_attribute

__all__ = ["LegacyParallelDimsMixin", "legacy_parallel_dims"]


class LegacyParallelDimsMixin:
    """The deprecated ``full_dtensor`` attribute of ``ParallelDims``."""

    spmd_backend: str

    @property
    @deprecated("ParallelDims.full_dtensor is deprecated; use ParallelDims.spmd_backend", category=None)
    def full_dtensor(self) -> bool:
        """Deprecated: ``True`` when ``spmd_backend == "full_dtensor"``."""
        return read_legacy_attribute("ParallelDims", self)

    @full_dtensor.setter
    @deprecated("ParallelDims.full_dtensor is deprecated; use ParallelDims.spmd_backend", category=None)
    def full_dtensor(self, value: bool) -> None:
        write_legacy_attribute("ParallelDims", self, value)


_C = TypeVar("_C", bound=type)

#: The mixin's members that the decorator copies onto the class.
_MIXED_IN = tuple(
    name for name in vars(LegacyParallelDimsMixin) if not name.startswith("__")
)


def legacy_parallel_dims(cls: _C) -> _C:
    """Class decorator: mix in :class:`LegacyParallelDimsMixin` and accept ``full_dtensor=``.

    The members are copied rather than inherited so that the class statement of
    ``ParallelDims`` does not mention compat at all; only the decorator line does.
    """
    for name in _MIXED_IN:
        if name in vars(cls):
            raise TypeError(f"{cls.__name__} already defines {name!r}; cannot mix in the legacy one.")
        setattr(cls, name, vars(LegacyParallelDimsMixin)[name])
    return accept_legacy_backend_kwarg("ParallelDims")(cls)
