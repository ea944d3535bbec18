"""``python -m torchtitan_spmd.config --module M --config C [--section.field value ...]``

Prints the resolved configuration as TOML, after every override and legacy
translation, so a fork can check what its config now means. Also accepts
``--job.config_file F.toml`` instead of ``--module/--config``.

Before printing, a ``JobConfig`` gets the trainer's own set-up checks (``validate_job``: the
flavour, the degrees against ``--world-size N``, the unimplemented values, the recipe's rules),
so a config the trainer would refuse exits 2 here with the trainer's one ``error:`` line.
Without ``--world-size`` the degrees are checked against the world they name (a ``-1`` FSDP
degree counted as 1). The trainer is found by name (:data:`TRAINER_CHECK`), as the backend
registry names its representations: this module, at the config's level, imports nothing of the
runtime; a tree without the trainer says so in one line and checks the sections alone.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import sys
import warnings
from typing import Any

from . import ConfigManager, JobConfig
from .converters import ModelConfigConverterConfig, converter_to_dict

#: ``module:function`` of the trainer's set-up checks, ``function(config, world_size, device_type)``.
TRAINER_CHECK = "torchtitan_spmd.train:validate_job"

_WORLD_SIZE_FLAG = "--world-size"


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


def pop_world_size(argv: list[str]) -> tuple[int | None, list[str]]:
    """``--world-size N`` (or ``--world-size=N``) taken out of ``argv``: N (None if absent) and the rest.
    ``ValueError`` naming the flag unless N is an integer >= 1."""
    rest: list[str] = []
    world: int | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == _WORLD_SIZE_FLAG or arg.startswith(_WORLD_SIZE_FLAG + "="):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{_WORLD_SIZE_FLAG} must be an integer >= 1 (the number of ranks the job "
                                 f"would run on), got {value!r}.")
            world = int(value)
            continue
        rest.append(arg)
        i += 1
    return world, rest


def named_world_size(config: JobConfig) -> int:
    """The world the degrees name: their product, an inferred (``-1``) FSDP degree counted as 1."""
    par = config.parallelism
    return math.prod([par.pipeline_parallel_degree, par.data_parallel_replicate_degree,
                      max(par.data_parallel_shard_degree, 1), par.context_parallel_degree,
                      par.tensor_parallel_degree])


def trainer_check(config: JobConfig, world_size: int) -> bool:
    """Run :data:`TRAINER_CHECK` on ``config`` for ``world_size`` CPU ranks (its errors propagate);
    False, after one line saying so, when this tree has no trainer."""
    module, _, function = TRAINER_CHECK.partition(":")
    if importlib.util.find_spec(module) is None:
        print(f"note: {module} is not installed: only the sections' own checks ran.", file=sys.stderr)
        return False
    getattr(importlib.import_module(module), function)(config, world_size, "cpu")
    return True


def main(argv: list[str] | None = None) -> int:
    """Entry point: check the config as the trainer would, print it; return the exit status."""
    if not sys.warnoptions:
        # Show deprecations of legacy spellings to CLI users (Python hides them by default).
        warnings.simplefilter("default", DeprecationWarning)
    try:
        world_size, args = pop_world_size(list(sys.argv[1:] if argv is None else argv))
        config = ConfigManager().parse_args(args)
        if isinstance(config, JobConfig):
            trainer_check(config, world_size or named_world_size(config))
    except (ValueError, TypeError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(to_toml(config).lstrip("\n"), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
