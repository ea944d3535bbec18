"""``python -m torchtitan_spmd.config [--job.config_file F] [--section.field value ...]``

Prints the resolved configuration as TOML, after every override and legacy
translation, so a fork can check what its old config now means.
"""

from __future__ import annotations

import sys
import warnings

from . import ConfigManager


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def main(argv: list[str] | None = None) -> int:
    """Entry point: print the resolved config; return the exit status."""
    if not sys.warnoptions:
        # Show deprecations of legacy spellings to CLI users (Python hides them by default).
        warnings.simplefilter("default", DeprecationWarning)
    try:
        config = ConfigManager().parse_args(argv)
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for section, table in config.to_dict().items():
        print(f"[{section}]")
        for key, value in table.items():
            if value is not None:
                print(f"{key} = {_toml_value(value)}")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
