"""Translate the legacy ``full_dtensor`` spellings into ``spmd_backend``.

This module is the only place in the library that knows the legacy names. The
core calls it at a few hook points, each marked ``# compat hook``. Deleting
``compat/`` together with those hooks removes legacy support and nothing else.

Every channel emits exactly one :class:`LegacySpellingWarning` (a
``DeprecationWarning``) that names the replacement spelling and the release in
which the legacy spelling will be removed, attributed to the user's line.
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from typing_extensions import deprecated

from torchtitan_spmd._errors import stacklevel_outside_library
from torchtitan_spmd._surface import get_surface

#: The release in which the legacy spellings will be removed.
REMOVAL_RELEASE = "0.3.0"

LEGACY_KEY = "full_dtensor"
_NEW_KEY = "spmd_backend"


class LegacySpellingWarning(DeprecationWarning):
    """A legacy ``full_dtensor`` spelling was used; the message names its replacement."""


def deprecation_message(old: str, new: str) -> str:
    """The text of every legacy-spelling warning."""
    return (
        f"{old} is deprecated and will be removed in torchtitan_spmd {REMOVAL_RELEASE}; "
        f"use {new} instead."
    )


def backend_for(full_dtensor: bool) -> str:
    """The ``spmd_backend`` value that a legacy ``full_dtensor`` boolean means.

    Spelled in the fork's surface: ``False`` is ``"default"`` under ``june`` and
    ``"partial_dtensor"`` under ``august`` (the same backend).
    """
    return "full_dtensor" if full_dtensor else get_surface().spellings["default"]


def _check_bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: expected bool, got {type(value).__name__} {value!r}.")
    return value


def resolve_backend(where: str, full_dtensor: bool, spmd_backend: str | None) -> str:
    """Combine a legacy flag with an explicit ``spmd_backend``; raise if they disagree."""
    legacy_backend = backend_for(full_dtensor)
    if spmd_backend is None:
        return legacy_backend
    disagree = (spmd_backend == "full_dtensor") != full_dtensor
    if disagree:
        raise ValueError(
            f"{where}: conflicting settings full_dtensor={full_dtensor!r} (means "
            f"spmd_backend={legacy_backend!r}) and spmd_backend={spmd_backend!r}; "
            "drop the deprecated full_dtensor."
        )
    return spmd_backend


def _warn_cli(old: str, new: str) -> None:
    """Warn about a legacy command-line flag (see :func:`_warn`)."""
    _warn(old, new)


def _warn(old: str, new: str) -> None:
    """Warn about a legacy spelling, blaming the user's line or the command line.

    When the parse was called from the user's own Python code, the warning points at that
    line, as every other channel. When nothing outside the library called it (the trainer run
    as ``python -m torchtitan_spmd.train``, under torchrun or not), the first such frame is
    Python's ``<frozen runpy>``, which means nothing to the user: the warning is then
    attributed to ``<command line>`` instead.
    """
    level = stacklevel_outside_library()
    frame = sys._getframe(0)  # stacklevel 1: this frame; stacklevel L: L - 1 frames up
    for _ in range(level - 1):
        if frame.f_back is None:
            break
        frame = frame.f_back
    if frame.f_code.co_filename.startswith("<frozen "):
        warnings.warn_explicit(deprecation_message(old, new), LegacySpellingWarning,
                               filename="<command line>", lineno=0,
                               module="torchtitan_spmd.command_line")
        return
    warnings.warn(deprecation_message(old, new), LegacySpellingWarning, stacklevel=level)


def warn_renamed(old: str, new: str) -> None:
    """One :class:`LegacySpellingWarning` for a field torchtitan renamed (``training.dataset`` is
    ``dataloader.dataset`` since a0c831c49), pointing at the user's line."""
    _warn(old, new)


#: The fields torchtitan moved: old ``(section, field)`` -> new ``(section, field)``, the
#: section ``""`` for the root config (upstream's ``Trainer.Config`` fields).
RENAMED_FIELDS: dict[tuple[str, str], tuple[str, str]] = {
    ("training", "dataset"): ("dataloader", "dataset"),
    ("training", "dataset_path"): ("dataloader", "dataset_path"),
    ("model", "hf_assets_path"): ("", "hf_assets_path"),
}


def _spelled(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name


def move_renamed_fields(config: Any) -> None:
    """Move every set old spelling of :data:`RENAMED_FIELDS` of the root ``config`` to its new
    place, with one warning each; ``ValueError`` when both spellings are set to different values.
    A root without the new place (a fork's own root dataclass) keeps the old spelling, unwarned."""
    for (old_section, old_name), (new_section, new_name) in RENAMED_FIELDS.items():
        old_owner = getattr(config, old_section, None)
        new_owner = getattr(config, new_section, None) if new_section else config
        if (old_owner is None or new_owner is None or not hasattr(new_owner, new_name)
                or getattr(old_owner, old_name, None) is None):
            continue
        value, current = getattr(old_owner, old_name), getattr(new_owner, new_name)
        default = type(new_owner).__dataclass_fields__[new_name].default
        old, new = _spelled(old_section, old_name), _spelled(new_section, new_name)
        if current != default and current != value:
            raise ValueError(f"conflicting settings {old}={value!r} and {new}={current!r}: drop the deprecated {old}.")
        warn_renamed(old, new)
        object.__setattr__(new_owner, new_name, value)
        object.__setattr__(old_owner, old_name, None)


# --------------------------------------------------------------------------------------
# Channels 2 and 3: reading and assigning ``cfg.full_dtensor``.
# --------------------------------------------------------------------------------------
def read_legacy_attribute(owner: str, obj: Any) -> bool:
    """Channel 2 for any owner: warn, then return ``obj.spmd_backend == "full_dtensor"``."""
    _warn(f"Reading {owner}.full_dtensor", f'{owner}.spmd_backend == "full_dtensor"')
    return bool(obj.spmd_backend == "full_dtensor")


def write_legacy_attribute(owner: str, obj: Any, value: bool) -> None:
    """Channel 3 for any owner: warn, then set ``obj.spmd_backend`` from a legacy bool."""
    value = _check_bool(f"{owner}.full_dtensor", value)
    _warn(f"Assigning {owner}.full_dtensor", f"{owner}.spmd_backend = {backend_for(value)!r}")
    obj.spmd_backend = backend_for(value)


class LegacyParallelismMixin:
    """Adds the deprecated ``full_dtensor`` attribute to ``ParallelismConfig``.

    Written out (not generated) so type checkers see ``typing_extensions.deprecated``.
    """

    spmd_backend: str

    @property
    @deprecated("parallelism.full_dtensor is deprecated; use parallelism.spmd_backend", category=None)
    def full_dtensor(self) -> bool:
        """Deprecated: ``True`` when ``spmd_backend == "full_dtensor"``."""
        return read_legacy_attribute("ParallelismConfig", self)

    @full_dtensor.setter
    @deprecated("parallelism.full_dtensor is deprecated; use parallelism.spmd_backend", category=None)
    def full_dtensor(self, value: bool) -> None:
        write_legacy_attribute("ParallelismConfig", self, value)


# --------------------------------------------------------------------------------------
# Channel 1: ``ParallelismConfig(full_dtensor=True)``; also used by ``ParallelDims``.
# --------------------------------------------------------------------------------------
_C = TypeVar("_C", bound=type)


def accept_legacy_backend_kwarg(owner: str) -> Callable[[_C], _C]:
    """Class decorator: let ``__init__`` take ``full_dtensor=`` and map it to ``spmd_backend``."""

    def decorate(cls: _C) -> _C:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if LEGACY_KEY in kwargs:
                value = _check_bool(f"{owner}(full_dtensor=...)", kwargs.pop(LEGACY_KEY))
                kwargs[_NEW_KEY] = resolve_backend(
                    f"{owner}(...)", value, kwargs.get(_NEW_KEY)
                )
                _warn(
                    f"{owner}(full_dtensor={value!r})",
                    f"{owner}(spmd_backend={kwargs[_NEW_KEY]!r})",
                )
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        return cls

    return decorate


accept_legacy_parallelism_kwargs = accept_legacy_backend_kwarg("ParallelismConfig")


# --------------------------------------------------------------------------------------
# Channels 5 and 6: TOML files and plain dicts.
# --------------------------------------------------------------------------------------
def translate_legacy_section(
    section: str,
    data: dict[str, Any],
    *,
    location: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """Return ``data`` with a legacy ``full_dtensor`` key of ``[parallelism]`` translated.

    ``location`` (file, line) attributes the warning to a TOML file's line;
    otherwise the warning points at the first caller outside the library.
    """
    if section != "parallelism" or LEGACY_KEY not in data:
        return data
    data = dict(data)
    value = _check_bool("parallelism.full_dtensor", data.pop(LEGACY_KEY))
    data[_NEW_KEY] = resolve_backend("[parallelism]", value, data.get(_NEW_KEY))
    old = f"parallelism.full_dtensor = {str(value).lower()}"
    new = f'parallelism.spmd_backend = "{data[_NEW_KEY]}"'
    if location is None:
        _warn(old, new)
    else:
        warnings.warn_explicit(
            deprecation_message(old, new),
            LegacySpellingWarning,
            filename=location[0],
            lineno=location[1],
            module="torchtitan_spmd.config",
        )
    return data


_TOML_SECTION = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\-\"]+)\s*\]")
_TOML_LEGACY_KEY = re.compile(r"^\s*full[_-]dtensor\s*=")


def translate_legacy_toml(data: dict[str, Any], path: str, text: str) -> dict[str, Any]:
    """Translate legacy keys of a parsed TOML document, warning at the key's line."""
    table = data.get("parallelism")
    if not isinstance(table, Mapping):
        return data
    key = next((k for k in table if str(k).replace("-", "_") == LEGACY_KEY), None)
    if key is None:
        return data
    line = 1
    section = None
    for number, raw in enumerate(text.splitlines(), start=1):
        header = _TOML_SECTION.match(raw)
        if header:
            section = header.group(1).strip('"')
        elif section == "parallelism" and _TOML_LEGACY_KEY.match(raw):
            line = number
            break
    fixed = {(LEGACY_KEY if k == key else k): v for k, v in table.items()}
    return {**data, "parallelism": translate_legacy_section("parallelism", fixed, location=(path, line))}


# --------------------------------------------------------------------------------------
# Channel 4: the CLI flag.
# --------------------------------------------------------------------------------------
_CLI_LEGACY = re.compile(r"^--parallelism\.(no[-_])?full[-_]dtensor(?:=(.*))?$")
_CLI_BACKEND = re.compile(r"^--parallelism\.spmd[-_]backend(?:=(.*))?$")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def translate_legacy_cli_args(argv: Sequence[str]) -> list[str]:
    """Rewrite ``--parallelism.full_dtensor`` (and its variants) as ``--parallelism.spmd_backend``.

    Accepts ``--parallelism.full_dtensor``, ``--parallelism.full-dtensor``,
    ``--parallelism.full_dtensor=false``, ``--parallelism.full_dtensor false`` and
    the negative ``--parallelism.no-full_dtensor``.
    """
    out: list[str] = []
    legacy: tuple[str, bool] | None = None
    explicit: str | None = None
    i = 0
    args = list(argv)
    while i < len(args):
        arg = args[i]
        m = _CLI_LEGACY.match(arg)
        if m is None:
            b = _CLI_BACKEND.match(arg)
            if b is not None:
                explicit = b.group(1) if b.group(1) is not None else (
                    args[i + 1] if i + 1 < len(args) else None
                )
            out.append(arg)
            i += 1
            continue
        negative, inline = m.group(1) is not None, m.group(2)
        value = not negative
        spelled = arg
        if inline is not None or (i + 1 < len(args) and args[i + 1].lower() in _TRUE | _FALSE):
            raw = inline if inline is not None else args[i + 1]
            if inline is None:
                i += 1
                spelled = f"{arg} {raw}"
            if raw.lower() not in _TRUE | _FALSE or negative:
                raise ValueError(
                    f"{spelled}: invalid boolean {raw!r}; use --parallelism.spmd_backend "
                    "with one of 'default', 'full_dtensor', 'spmd_types'."
                )
            value = raw.lower() in _TRUE
        if legacy is not None:
            raise ValueError(f"{legacy[0]!r} and {spelled!r}: the legacy flag was given twice.")
        legacy = (spelled, value)
        i += 1
    if legacy is None:
        return out
    spelled, value = legacy
    backend = resolve_backend(spelled, value, explicit)
    _warn_cli(spelled, f"--parallelism.spmd_backend {backend}")
    if explicit is None:
        out += ["--parallelism.spmd_backend", backend]
    return out
