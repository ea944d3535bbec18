"""``ConfigManager``: TOML file plus torchtitan-style CLI overrides.

The parser is deliberately small and hand-rolled rather than built on tyro or
argparse: every value, whether it comes from Python, a TOML file, a dict or the
command line, goes through the same dataclass validation and so fails with the
same ``ValueError``/``TypeError`` (naming the field, the bad value and the valid
choices) instead of a parser-specific ``SystemExit``.

Accepted spellings::

    --section.field value        --section.field=value
    --section.bool_field         (sets True)
    --section.no-bool_field      (sets False; also --section.bool_field false)

Hyphens and underscores are interchangeable in section and field names.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from torchtitan_spmd._errors import suggest
from torchtitan_spmd.compat import legacy as _legacy  # compat hook

from .job_config import JobConfig

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _norm(name: str) -> str:
    """Normalise hyphens to underscores, keeping a leading ``--``."""
    if name.startswith("--"):
        return "--" + name[2:].replace("-", "_")
    return name.replace("-", "_")


def _is_bool(tp: Any) -> bool:
    if tp is bool:
        return True
    if get_origin(tp) in (typing.Union, types.UnionType):
        members = [m for m in get_args(tp) if m is not type(None)]
        return members == [bool]
    return False


def _parse_value(flag: str, raw: str, tp: Any) -> Any:
    """Convert a CLI string to the annotated type; the dataclass then validates it."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        members = [m for m in get_args(tp) if m is not type(None)]
        if raw.lower() == "none" and type(None) in get_args(tp):
            return None
        if len(members) == 1:
            return _parse_value(flag, raw, members[0])
        return raw
    if tp is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"{flag}: invalid boolean {raw!r}; use true or false.")
    if tp is int:
        try:
            return int(raw)
        except ValueError:
            raise TypeError(f"{flag}: expected int, got {raw!r}.") from None
    if tp is float:
        try:
            return float(raw)
        except ValueError:
            raise TypeError(f"{flag}: expected float, got {raw!r}.") from None
    if origin is Literal:
        return raw
    return raw


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) of a section class."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


class ConfigManager:
    """Builds a :class:`JobConfig` from an optional TOML file and CLI overrides."""

    def __init__(self, config_cls: type[JobConfig] = JobConfig) -> None:
        self.config_cls = config_cls
        self._flags: dict[str, tuple[str, str, Any]] = {}
        for section, cls in config_cls.section_types().items():
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                self._flags[f"--{section}.{f.name}"] = (section, f.name, hints[f.name])

    def help_text(self) -> str:
        """A ``--help`` listing of every option with its type, default and doc."""
        lines = ["Options (hyphens and underscores are interchangeable):"]
        for section, cls in self.config_cls.section_types().items():
            lines.append(f"\n[{section}]  {(cls.__doc__ or '').strip()}")
            docs = _field_docs(cls)
            defaults = cls()
            for flag, (sec, name, tp) in self._flags.items():
                if sec != section:
                    continue
                kind = "bool" if _is_bool(tp) else getattr(tp, "__name__", str(tp))
                lines.append(f"  {flag}  ({kind}, default {getattr(defaults, name)!r})")
                if docs.get(name):
                    lines.append(f"      {docs[name]}")
        return "\n".join(lines)

    def parse_args(self, argv: Sequence[str] | None = None) -> JobConfig:
        """Parse ``argv`` (default ``sys.argv[1:]``) into a validated :class:`JobConfig`.

        ``--job.config_file PATH`` loads a TOML file first; the other flags override it.
        ``-h``/``--help`` prints the options and exits.
        """
        args = list(sys.argv[1:] if argv is None else argv)
        if "-h" in args or "--help" in args:
            print(self.help_text())
            raise SystemExit(0)
        args = _legacy.translate_legacy_cli_args(args)  # compat hook
        overrides = self._parse_overrides(args)
        config_file = next(
            (value for (section, name), value in overrides.items() if (section, name) == ("job", "config_file")),
            None,
        )
        data: dict[str, dict[str, Any]] = {}
        if config_file is not None:
            data = self._load_toml(config_file)
        for (section, name), value in overrides.items():
            table = data.setdefault(section, {})
            # A TOML key spelled with hyphens would otherwise survive next to the override.
            for key in [k for k in table if _norm(k) == name]:
                del table[key]
            table[name] = value
        return self.config_cls.from_dict(data)

    def _load_toml(self, path: str) -> dict[str, dict[str, Any]]:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"job.config_file: no such file {path!r}.")
        text = file.read_text()
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"job.config_file {path!r} is not valid TOML: {err}") from None
        data = _legacy.translate_legacy_toml(data, str(file), text)  # compat hook
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ValueError(
                    f"{path}: top-level key {section!r} must be a [section] table, "
                    f"got {type(table).__name__}."
                )
        return data

    def _parse_overrides(self, args: list[str]) -> dict[tuple[str, str], Any]:
        overrides: dict[tuple[str, str], Any] = {}
        i = 0
        while i < len(args):
            arg = args[i]
            if not arg.startswith("--"):
                raise ValueError(
                    f"unexpected argument {arg!r}; options look like --section.field value."
                )
            flag, eq, inline = arg.partition("=")
            negative = False
            key = _norm(flag)
            if key not in self._flags:
                section, _, name = key[2:].partition(".")
                if name.startswith("no_") and f"--{section}.{name[3:]}" in self._flags:
                    key, negative = f"--{section}.{name[3:]}", True
                else:
                    raise ValueError(
                        f"unknown option {flag!r}.{suggest(key, self._flags)} "
                        "Run with --help to list the options."
                    )
            section, name, tp = self._flags[key]
            if negative and not _is_bool(tp):
                raise ValueError(f"{flag}: only boolean options have a --section.no-field form.")
            if _is_bool(tp):
                if eq:
                    value = _parse_value(flag, inline, tp)
                elif i + 1 < len(args) and args[i + 1].lower() in _TRUE | _FALSE:
                    value = _parse_value(flag, args[i + 1], tp)
                    i += 1
                else:
                    value = True
                if negative:
                    if eq:
                        raise ValueError(f"{flag}: the --no- form takes no value.")
                    value = not value
            else:
                if eq:
                    raw = inline
                elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                    raw = args[i + 1]
                    i += 1
                else:
                    raise ValueError(f"{flag}: missing value.")
                value = _parse_value(flag, raw, tp)
            overrides[(section, name)] = value
            i += 1
        return overrides


