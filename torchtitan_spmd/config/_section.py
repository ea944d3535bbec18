"""The validation every config section shares: field types on construction, dict round-trips.

A bad value is rejected with a ``ValueError`` or ``TypeError`` that names the
field (``section.field``), the bad value and, for ``Literal`` fields, the valid
choices and the closest match, whether it came from Python, a TOML file, a
plain dict or the command line.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, get_args, get_origin

from torchtitan_spmd._errors import suggest

# Lines marked "compat hook" call into compat/ for the legacy `full_dtensor`
# spellings; deleting compat/ and those lines removes legacy support.
from torchtitan_spmd.compat import legacy as _legacy  # compat hook

__all__ = ["Section", "check_value", "invalid_choice", "reject_unknown_attribute"]


def _field_names(cls: type) -> tuple[str, ...]:
    """The dataclass fields of ``cls`` (its ``ClassVar`` entries left out)."""
    return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else ()


def _settable(cls: type, name: str) -> bool:
    """Whether ``name`` may be assigned on an instance of the dataclass ``cls``: one of its
    fields, or a class attribute with a setter (a property, such as a legacy spelling compat/ keeps)."""
    if name in _field_names(cls):
        return True
    for klass in cls.__mro__:
        if name in vars(klass):
            return hasattr(vars(klass)[name], "__set__")
    return False


def reject_unknown_attribute(obj: Any, name: str, where: str) -> None:
    """Raise ``AttributeError`` unless ``name`` may be assigned on the config ``obj``.

    Upstream's sections are ``slots=True`` dataclasses, so a typo such as
    ``job.training.step = 3`` raises there; this keeps that (the message names the section
    ``where``, the attribute and the closest field). Private names (``_x``) are the library's
    own bookkeeping and pass.
    """
    if name.startswith("_") or _settable(type(obj), name):
        return
    known = _field_names(type(obj))
    raise AttributeError(
        f"{type(obj).__name__} ({where}) has no field {name!r}.{suggest(name, known)} "
        f"Its fields are {', '.join(known)}."
    )


def invalid_choice(where: str, value: Any, choices: typing.Sequence[Any]) -> ValueError:
    """The error for a value outside ``choices``: the value, every choice, the closest one."""
    prefix = f"{where}: " if where else ""
    return ValueError(
        f"{prefix}invalid value {value!r}; valid choices are "
        f"{', '.join(repr(c) for c in choices)}.{suggest(value, choices)}"
    )


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _exact_member(value: Any, members: tuple[Any, ...]) -> bool:
    """Whether ``value`` already is an instance of one plain-class member (bool is not an int)."""
    for member in members:
        if not isinstance(member, type) or get_origin(member) is not None:
            continue
        if member in (int, float) and isinstance(value, bool):
            continue
        if isinstance(value, member):
            return True
    return False


def check_value(where: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (an int widened to float).

    ``where`` names the field in messages, e.g. ``"parallelism.spmd_backend"``.
    Supports plain classes, ``Literal``, unions (``X | None``) and ``list[...]``.
    """
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise invalid_choice(where, value, choices)
        return value
    if origin in (typing.Union, types.UnionType):
        members = get_args(tp)
        if value is None and type(None) in members:
            return None
        if _exact_member(value, members):
            return value
        others = [m for m in members if m is not type(None)]
        if len(others) == 1:  # X | None: X's own, more precise, error
            return check_value(where, value, others[0])
        for member in members:
            if member is type(None):
                continue
            try:
                return check_value(where, value, member)
            except (TypeError, ValueError):
                continue
        raise TypeError(
            f"{where}: expected {' or '.join(_type_name(m) for m in members)}, "
            f"got {type(value).__name__} {value!r}."
        )
    if origin is list:
        if not isinstance(value, list):
            raise TypeError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}.")
        (item,) = get_args(tp) or (Any,)
        return [check_value(f"{where}[{i}]", v, item) for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, bool):
        raise TypeError(f"{where}: expected {tp.__name__}, got bool {value!r}.")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise TypeError(f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r}.")
    return value


class Section:
    """Base of the config sections: field types checked on construction, dict round-trips.

    Subclasses are keyword-only dataclasses that set :attr:`section_name` and
    may extend ``__post_init__`` with range checks (calling ``super()`` first).
    """

    #: The section's name in TOML and on the command line, e.g. ``"parallelism"``.
    section_name: typing.ClassVar[str] = ""

    #: Fields checked by a function ``(value, where) -> value`` instead of their annotation
    #: (``parallelism.spmd_backend``: the backend registry, which may hold more names
    #: than its ``Literal``).
    _field_checks: typing.ClassVar[dict[str, typing.Callable[[Any, str], Any]]] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        reject_unknown_attribute(self, name, f"[{self.section_name}]" if self.section_name else "a config section")
        super().__setattr__(name, value)

    def _validate_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            where = f"{self.section_name}.{f.name}"
            custom = self._field_checks.get(f.name)
            checked = custom(value, where) if custom else check_value(where, value, hints[f.name])
            object.__setattr__(self, f.name, checked)

    def __post_init__(self) -> None:
        self._validate_types()

    def check(self) -> None:
        """Run this section's checks again (after its fields were assigned); raise as construction does."""
        self.__post_init__()

    def _require_finite(self, name: str, *, minimum: float, strict: bool) -> None:
        """Require ``section.name`` to be a finite number ``> minimum`` (``strict``) or ``>= minimum``."""
        value = getattr(self, name)
        ok = math.isfinite(value) and (value > minimum if strict else value >= minimum)
        self._require(ok, name, f"must be a finite number {'>' if strict else '>='} {minimum:g}")

    def _require(self, ok: bool, name: str, rule: str) -> None:
        """Raise ``ValueError`` naming ``section.name``, its value and ``rule`` unless ``ok``."""
        if not ok:
            raise ValueError(f"{self.section_name}.{name} {rule}, got {getattr(self, name)!r}.")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of this section's fields, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: typing.Mapping[str, Any]) -> Any:
        """Build the section from a plain mapping, rejecting unknown keys.

        Keys may use hyphens or underscores. Legacy keys are translated (with a
        ``DeprecationWarning``) by the compat layer.
        """
        if not isinstance(data, typing.Mapping):
            raise TypeError(
                f"[{cls.section_name}] must be a table/mapping, got {type(data).__name__}."
            )
        normalised = {str(k).replace("-", "_"): v for k, v in data.items()}
        normalised = _legacy.translate_legacy_section(cls.section_name, normalised)  # compat hook
        known = cls.field_names()
        for key in normalised:
            if key not in known:
                raise ValueError(
                    f"[{cls.section_name}]: unknown key {key!r}; valid keys are "
                    f"{', '.join(known)}.{suggest(key, known)}"
                )
        return cls(**normalised)

    def to_dict(self) -> dict[str, Any]:
        """This section's values as a plain dict."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]
