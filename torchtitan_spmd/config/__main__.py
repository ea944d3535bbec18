"""``python -m torchtitan_spmd.config --module M --config C [--section.field value ...]``

Prints the resolved configuration as TOML, after every override and legacy
translation, so a fork can check what its config now means. Also accepts
``--job.config_file F.toml`` instead of ``--module/--config``.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any

from . import ConfigManager
from .converters import ModelConfigConverterConfig, converter_to_dict


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, ModelConfigConverterConfig):  # model.converters: inline tables, read back as such
        table = converter_to_dict(value)
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None) + "}"
    return repr(value)


def to_toml(config: Any, prefix: str = "") -> str:
    """``config`` (a dataclass) as TOML: scalars first, then one table per nested dataclass.

    None values are left out (TOML has no null).
    """
    scalars: list[str] = []
    tables: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            name = f"{prefix}{f.name}"
            tables.append(f"[{name}]\n{to_toml(value, name + '.')}")
        elif value is not None:
            scalars.append(f"{f.name} = {_toml_value(value)}\n")
    return "".join(scalars) + "".join("\n" + t for t in tables)


def main(argv: list[str] | None = None) -> int:
    """Entry point: print the resolved config; return the exit status."""
    if not sys.warnoptions:
        # Show deprecations of legacy spellings to CLI users (Python hides them by default).
        warnings.simplefilter("default", DeprecationWarning)
    try:
        config = ConfigManager().parse_args(argv)
    except (ValueError, TypeError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(to_toml(config).lstrip("\n"), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
