"""``ConfigManager``: torchtitan's ``--module M --config C`` loader, parsed with tyro.

Precedence, as in torchtitan: CLI overrides > the config function's values.

- ``--module M``: a short name of this library's model registry (``llama3`` means
  ``torchtitan_spmd.models.llama3.config_registry``), or a fork's module: ``M`` is
  tried as ``M.config_registry``, then as ``M``.
- ``--config C``: a function of that module, returning any dataclass root (this
  library's ``JobConfig`` or a fork's own trainer config embedding its sections).
- ``--section.field value`` overrides, parsed by tyro on top of that config. Booleans
  are tyro flags (``--debug.deterministic`` / ``--debug.no-deterministic``); a
  ``list[str]`` takes one comma-separated value (``--checkpoint.exclude_from_loading
  optimizer,lr_scheduler``); hyphens and underscores are interchangeable.
- activation checkpointing in either generation's spelling: June's ``--activation_checkpoint.mode
  full`` (and its other fields), or upstream b5bcd76's subcommands ``activation-checkpoint:full``
  (``selective``, ``memory-budget``, ``none``) followed by that policy's fields. Unlike upstream's
  plain tyro, options may come in any order around the subcommand (tyro's
  ``CascadeSubcommandArgs``).
- ``--job.config_file F.toml`` instead of ``--module/--config``: the loader of forks
  from before torchtitan moved to Python registries (a TOML file over ``JobConfig``'s
  defaults), with the same tyro overrides on top.

Legacy ``full_dtensor`` flags are translated by one compat hook before tyro sees
them. A bad value on the command line is tyro's usual error (exit status 2); the
Python API (constructing sections) raises ``ValueError``/``TypeError``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import pkgutil
import re
import sys
import textwrap
import tomllib
import typing
import warnings
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torchtitan_spmd.compat import legacy as _legacy  # compat hook

from ._section import invalid_choice
from .activation_checkpoint import ActivationCheckpointConfig, ac_section, policy_classes
from .backends import backend_names, resolve_backend
from .configs import SpmdBackend, SpmdBackendSpelling, TrainingConfig
from .job_config import JobConfig
from .surface import get_surface

if TYPE_CHECKING:
    from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo

__all__ = ["FORK_FIRST", "LIBRARY_FIRST", "MODELS_PACKAGE", "ConfigManager", "short_module_names"]

#: This library's model families: its subpackages' ``config_registry`` modules.
MODELS_PACKAGE = "torchtitan_spmd.models"

#: Where a short ``--module NAME`` is looked for, in order, by a plain ``ConfigManager()``:
#: a fork's own packages first, as torchtitan's (``torchtitan.models.NAME``, then
#: ``torchtitan.experiments.NAME``), then this library's families.
FORK_FIRST: tuple[str, ...] = ("torchtitan.models", "torchtitan.experiments", MODELS_PACKAGE)

#: The order this library's trainer and parity command use: its own families first.
LIBRARY_FIRST: tuple[str, ...] = (MODELS_PACKAGE, "torchtitan.models", "torchtitan.experiments")

_EXAMPLE = "Example: --module llama3 --config llama3_debugmodel"

_ROLE = re.compile(r":[a-z]+:`~?\.?([^`]+)`")


def plain_text(doc: str) -> str:
    """A docstring as one plain paragraph: its hard line breaks joined, RST roles and literals
    (:class:`X`, ``x``) reduced to their text."""
    text = _ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1], doc)
    return " ".join(text.replace("``", "").split())


@contextlib.contextmanager
def _plain_helptext() -> Iterator[None]:
    """tyro's help, with every docstring it shows as :func:`plain_text` (re-flowed, no RST markup).

    tyro has no public hook for the help text of a field documented by a docstring (only
    ``tyro.conf.arg(help=...)`` per field, or a ``help`` metadata entry), so its docstring readers
    (``tyro._docstrings.get_field_docstring`` and ``get_callable_description``, read by tyro through
    the module at each call) are wrapped for this block; a tyro without them shows the docstrings
    as written."""
    try:
        docs = importlib.import_module("tyro._docstrings")
    except ImportError:
        yield
        return
    originals = {name: getattr(docs, name) for name in ("get_field_docstring", "get_callable_description")
                 if callable(getattr(docs, name, None))}

    def plain(read: Any) -> Any:
        def reader(*args: Any, **kwargs: Any) -> Any:
            text = read(*args, **kwargs)
            if not isinstance(text, str):
                return text
            text = plain_text(text)
            section = re.match(r"\[[a-z_.]+\]:\s*", text)  # a section's "[job]: ..." (its TOML table)
            return text[section.end():][:1].upper() + text[section.end() + 1:] if section else text
        return reader

    for name, read in originals.items():
        setattr(docs, name, plain(read))
    try:
        yield
    finally:
        for name, read in originals.items():
            setattr(docs, name, read)


def _prog() -> str:
    """The command as the user typed it: ``python -m torchtitan_spmd.train``, not a file path."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", "") or ""
    if name:
        return f"python -m {name.removesuffix('.__main__')}"
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


def short_help(width: int = 100) -> str:
    """``--help`` without a config: how to select one, and each section with its one-line summary;
    ``--help-all`` lists every field."""
    prog = _prog()
    lines = [f"usage: {prog} --module M --config C [--section.field VALUE ...]",
             f"       {prog} --job.config_file F.toml [--section.field VALUE ...]",
             f"       {prog} --help-all   (every field: type, default, description)", ""]
    lines += textwrap.wrap(_USAGE.replace(" The options below are those of torchtitan_spmd's JobConfig.", ""),
                           width)
    lines += ["", "sections (--section.field VALUE; --module M --config C --help lists a config's fields):"]
    for name, cls in JobConfig.section_types().items():
        summary = plain_text((cls.__doc__ or "").split("\n\n")[0])
        summary = re.sub(r"^\[[a-z_]+\]:\s*", "", summary).split(". ")[0].rstrip(".")
        lines.append(f"  {name:<23}" + textwrap.shorten(summary, width - 25, placeholder=" ..."))
    lines.append(f"  {'--hf_assets_path PATH':<23}a Hugging Face assets folder: its tokenizer (and weights)")
    return "\n".join(lines) + "\n"


_USAGE = (
    "Select a config with --module M --config C (a function of M's config_registry, e.g. "
    "--module llama3 --config llama3_debugmodel), or load a legacy TOML file with "
    "--job.config_file F.toml; then override fields with --section.field VALUE. "
    "The options below are those of torchtitan_spmd's JobConfig."
)


# --------------------------------------------------------------------------------------
# tyro (imported on first use: the config sections, and every layer importing them, work
# without it).
# --------------------------------------------------------------------------------------
def _tyro() -> Any:
    try:
        import tyro
        import tyro.constructors
    except ImportError as exc:
        raise ImportError(
            "ConfigManager parses the command line with tyro, which is not installed: "
            "pip install 'tyro>=1.0,<2' (or pip install torchtitan-spmd)."
        ) from exc
    return tyro


def _release_token_partners(config: Any, args: Sequence[str]) -> Any:
    """A copy of ``config`` whose batch/token pairs tyro can override one member at a time.

    ``training.seq_len`` and ``max_context_length`` (and the other June/August pairs of
    :class:`TrainingConfig`) are one setting each. tyro rebuilds a section from every field
    of the default, so a member given on the command line would meet its old partner and
    disagree: in the copy, each pair keeps only its source member (the one the config
    function wrote) and, for a member given in ``args``, not its partner.
    """
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return config
    given = {a.split("=", 1)[0].lstrip("-").replace("-", "_") for a in args if a.startswith("--")}
    copied = copy.deepcopy(config)

    def walk(obj: Any, path: str, depth: int) -> None:
        if isinstance(obj, TrainingConfig):
            names = {g[len(path) + 1:] for g in given if g.startswith(path + ".")} if path else set()
            obj.release_for_overrides(names)
            return
        if depth > 4 or not dataclasses.is_dataclass(obj):
            return
        for f in dataclasses.fields(obj):
            walk(getattr(obj, f.name, None), f"{path}.{f.name}" if path else f.name, depth + 1)

    walk(copied, "", 0)
    return copied


#: June's activation-checkpointing fields that no August policy has: given on the command line
#: over an August policy (or None) with no subcommand, they mean June's section.
_JUNE_AC_FLAGS = frozenset({"mode", "per_op_sac_force_recompute_mm_shapes_by_fqns", "early_stop", "no_early_stop"})


def _june_ac_over_policy(config: Any, args: Sequence[str]) -> Any:
    """``config``, or a copy whose ``activation_checkpoint`` is June's section when ``args`` set one of
    June's own fields (``--activation_checkpoint.mode none``) over an August policy config or None
    and name no subcommand: the same setting in June's section (:func:`ac_section`), which tyro then
    overrides, so a June flag keeps working under a config function written in August's spelling."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type) or not hasattr(config, "activation_checkpoint"):
        return config
    current = config.activation_checkpoint
    if isinstance(current, ActivationCheckpointConfig) or not (current is None or isinstance(current, policy_classes())):
        return config
    names = [a.split("=", 1)[0].lstrip("-").replace("-", "_") for a in args]
    if any(n.startswith("activation_checkpoint:") for n in names):  # an explicit subcommand decides
        return config
    if not any(n.startswith("activation_checkpoint.") and n.split(".", 1)[1] in _JUNE_AC_FLAGS for n in names):
        return config
    copied = copy.copy(config)
    object.__setattr__(copied, "activation_checkpoint", ac_section(current))
    return copied


def _comma_list_rule(info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec[Any] | None:
    """``list[str]`` takes one comma-separated value, as in torchtitan."""
    if info.type != list[str]:
        return None
    return _tyro().constructors.PrimitiveConstructorSpec(
        nargs=1,
        metavar="A,B,C,...",
        instance_from_str=lambda args: [item.strip() for item in args[0].split(",") if item.strip()],
        is_instance=lambda value: isinstance(value, list) and all(isinstance(v, str) for v in value),
        str_from_instance=lambda value: [",".join(value)],
    )


def _spmd_backend_rule(info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec[Any] | None:
    """``spmd_backend`` accepts its aliases and names the closest choice when wrong."""
    if info.type not in (SpmdBackend, SpmdBackendSpelling):
        return None
    choices = backend_names()  # the registry's, at parse time
    spelled = tuple(dict.fromkeys([*get_surface().spellings.values(), *choices]))

    def from_str(args: list[str]) -> str:
        try:
            resolve_backend(args[0])
        except ValueError:
            raise invalid_choice("", args[0], spelled) from None
        return args[0]  # as written: the fork reads back its own spelling

    def is_instance(value: Any) -> bool:
        try:
            resolve_backend(value)
        except ValueError:
            return False
        return True

    return _tyro().constructors.PrimitiveConstructorSpec(
        nargs=1,
        metavar="{" + ",".join(spelled) + "}",
        instance_from_str=from_str,
        is_instance=is_instance,
        str_from_instance=lambda value: [value],
    )


_REGISTERED: weakref.WeakSet[ConstructorRegistry] = weakref.WeakSet()


def _register(registry: ConstructorRegistry) -> None:
    if registry in _REGISTERED:
        return
    registry.primitive_rule(_comma_list_rule)
    registry.primitive_rule(_spmd_backend_rule)
    _REGISTERED.add(registry)


_CUSTOM_REGISTRY: list[ConstructorRegistry] = []


def _custom_registry() -> ConstructorRegistry:
    """The tyro registry :class:`ConfigManager` parses with, created with its rules on first use."""
    if not _CUSTOM_REGISTRY:
        registry = _tyro().constructors.ConstructorRegistry()
        _register(registry)
        _CUSTOM_REGISTRY.append(registry)
    return _CUSTOM_REGISTRY[0]


def __getattr__(name: str) -> Any:
    if name == "custom_registry":  # torchtitan's module-level name
        return _custom_registry()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------
# Finding the config function.
# --------------------------------------------------------------------------------------
def short_module_names(package: str | None = None) -> list[str]:
    """The ``--module`` short names of ``package`` (default :data:`MODELS_PACKAGE`): its
    subpackages with a ``config_registry``.

    Found on disk (only ``package``'s parents are imported); ``[]`` when it does not exist.
    """
    package = MODELS_PACKAGE if package is None else package
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    names = []
    for info in pkgutil.iter_modules(spec.submodule_search_locations):
        location = Path(getattr(info.module_finder, "path", "")) / info.name
        if info.ispkg and importlib.machinery.PathFinder.find_spec("config_registry", [str(location)]):
            names.append(info.name)
    return sorted(names)


def _exists(module_name: str) -> bool:
    """Whether ``module_name`` can be found; an error inside a found parent propagates."""
    try:
        return importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            return False
        raise


def _import_registry(name: str, packages: Sequence[str]) -> tuple[ModuleType, str]:
    """Import the module ``--module name`` means; return it and its dotted path.

    A short name is looked for in ``packages`` in order (``PKG.name.config_registry``);
    then ``name.config_registry`` and ``name`` themselves, as torchtitan's.
    """
    shorts = {package: short_module_names(package) for package in packages}
    candidates = [f"{package}.{name}.config_registry" for package in packages if name in shorts[package]]
    candidates += [f"{name}.config_registry", name]
    for candidate in candidates:
        if candidate and not candidate.startswith(".") and _exists(candidate):
            return importlib.import_module(candidate), candidate
    supported = sorted({n for names in shorts.values() for n in names})
    raise ImportError(
        f"Cannot import module '{name}' or '{name}.config_registry'. "
        f"For shorthands, supported modules are: {supported} (looked for in {', '.join(packages)})"
    )


def _config_functions(module: ModuleType) -> list[str]:
    return sorted(
        name for name, obj in vars(module).items()
        if not name.startswith("_") and inspect.isfunction(obj) and obj.__module__ == module.__name__
    )


def _take_option(args: list[str], names: Sequence[str]) -> tuple[str | None, list[str]]:
    """Remove ``--name V`` / ``--name=V`` (any of ``names``, hyphens or underscores) from ``args``."""
    value: str | None = None
    rest: list[str] = []
    i = 0
    while i < len(args):
        flag, eq, inline = args[i].partition("=")
        if flag.startswith("--") and "--" + flag[2:].replace("-", "_") in names:
            if eq:
                value = inline
            elif i + 1 < len(args):
                value = args[i + 1]
                i += 1
            else:
                raise ValueError(f"{flag} requires a value")
        else:
            rest.append(args[i])
        i += 1
    return value, rest


class ConfigManager:
    """Parses a config from ``--module/--config`` (or a legacy TOML file) and CLI overrides.

    Usage, as in torchtitan::

        config = ConfigManager().parse_args(["--module", "llama3", "--config",
                                             "llama3_debugmodel", "--training.steps", "5"])
    """

    def __init__(self, *, module_packages: Sequence[str] | None = None) -> None:
        """``module_packages``: where a short ``--module NAME`` is looked for, in order
        (default :data:`FORK_FIRST`: a fork's ``torchtitan.models``, ``torchtitan.experiments``,
        then this library's families; its trainer uses :data:`LIBRARY_FIRST`)."""
        self.register_tyro_rules(_custom_registry())
        if module_packages is None:
            module_packages = FORK_FIRST
        if isinstance(module_packages, str) or not all(isinstance(p, str) and p for p in module_packages):
            raise TypeError(
                f"ConfigManager: module_packages must be a sequence of package names, got {module_packages!r}."
            )
        self.module_packages: tuple[str, ...] = tuple(module_packages)
        self.config: Any = None

    def parse_args(self, args: Sequence[str] | None = None) -> Any:
        """Parse ``args`` (default ``sys.argv[1:]``) into a config; also kept as ``self.config``.

        Raises:
            ValueError: ``--module`` or ``--config`` missing (``"--module is required..."``),
                a config function that does not exist (the message lists the available
                ones), or ``--job.config_file`` combined with ``--module/--config``.
            ImportError: ``--module`` names no importable module (``"Cannot import module..."``).
            SystemExit: tyro's exit status 2 for a bad override, 0 after ``--help``.
        """
        loaded, rest = self._load_config(list(sys.argv[1:] if args is None else args))
        self.config = self.parse_overrides(loaded, rest)
        return self.config

    def parse_overrides(self, config: Any, args: Sequence[str]) -> Any:
        """Apply ``--section.field`` overrides in ``args`` to a copy of ``config`` with tyro.

        ``config`` is any dataclass root; it is left unchanged. No ``--module`` is needed.
        """
        args = _legacy.translate_legacy_cli_args(list(args))  # compat hook
        config = _june_ac_over_policy(_release_token_partners(config, args), args)
        tyro = _tyro()
        args = ["--help" if a == "--help-all" else a for a in args]  # with a config, --help is every field
        with _plain_helptext():
            return tyro.cli(type(config), args=args, default=config, registry=_custom_registry(),
                            config=(tyro.conf.CascadeSubcommandArgs,), prog=_prog())

    def _load_config(self, args: list[str]) -> tuple[Any, list[str]]:
        """Strip ``--module``/``--config`` (or ``--job.config_file``); return the config and the rest."""
        module_name, args = _take_option(args, ("--module",))
        config_name, args = _take_option(args, ("--config",))
        config_file, args = _take_option(args, ("--job.config_file",))
        if config_file is not None:
            if module_name is not None or config_name is not None:
                raise ValueError(
                    "--job.config_file (a legacy TOML config) cannot be combined with "
                    "--module/--config; use one or the other."
                )
            return self._load_toml(config_file), args
        if module_name is None and config_name is None and "--help-all" in args:
            with _plain_helptext():
                _tyro().cli(JobConfig, args=["--help"], description=_USAGE, registry=_custom_registry(), prog=_prog())
        if module_name is None and config_name is None and {"-h", "--help"} & set(args):
            print(short_help(), end="")
            raise SystemExit(0)
        if module_name is None:
            raise ValueError(f"--module is required. {_EXAMPLE}")
        if config_name is None:
            raise ValueError(f"--config is required. {_EXAMPLE}")
        module, module_path = _import_registry(module_name, self.module_packages)
        config_fn = getattr(module, config_name, None)
        if config_fn is None or not callable(config_fn):
            raise ValueError(
                f"Config function '{config_name}' not found in {module_path}. "
                f"Available config functions: {_config_functions(module)}"
            )
        loaded = config_fn()
        if not dataclasses.is_dataclass(loaded) or isinstance(loaded, type):
            raise TypeError(
                f"{module_path}.{config_name}() must return a dataclass instance (a config "
                f"root such as JobConfig), got {type(loaded).__name__}."
            )
        return loaded, args

    @staticmethod
    def _load_toml(path: str) -> JobConfig:
        file = Path(path)
        if file.is_dir():
            raise ValueError(f"job.config_file {path!r} is a directory, not a TOML file.")
        if not file.exists():
            raise ValueError(f"job.config_file: no such file {path!r}.")
        try:
            raw = file.read_bytes()
        except OSError as err:
            raise ValueError(f"job.config_file {path!r} cannot be read: {err.strerror or err}.") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            line = raw[: err.start].count(b"\n") + 1
            raise ValueError(
                f"job.config_file {path!r} is not UTF-8 text (TOML must be): byte "
                f"{raw[err.start:err.start + 1]!r} at offset {err.start}, line {line}."
            ) from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"job.config_file {path!r} is not valid TOML: {err}") from None
        data = _legacy.translate_legacy_toml(data, str(file), text)  # compat hook
        for section, table in data.items():
            if section in JobConfig.root_fields():  # upstream's root fields: a top-level key
                continue
            if not isinstance(table, dict):
                raise ValueError(
                    f"{path}: top-level key {section!r} must be a [section] table, "
                    f"got {type(table).__name__}."
                )
        config = JobConfig.from_dict(data)
        config.job.config_file = path
        return config

    @staticmethod
    def register_tyro_rules(registry: ConstructorRegistry) -> None:
        """Register this library's tyro rules on ``registry`` (once per registry).

        ``list[str]`` fields take one comma-separated value; ``spmd_backend``
        accepts ``"partial_dtensor"`` and suggests the closest choice when wrong.
        """
        _register(registry)

    @staticmethod
    def _merge_configs(base: type, custom: type) -> type:
        """Deprecated, as in torchtitan: a dataclass merging ``custom``'s fields into ``base``'s.

        Fields present in both whose types are both dataclasses are merged
        recursively; otherwise ``custom``'s field wins. The result subclasses ``base``.
        Return a fork's own root dataclass from a ``config_registry`` function instead.
        """
        warnings.warn(
            "ConfigManager._merge_configs is deprecated; return a fork's own root dataclass "
            "from a config_registry function instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return _merge(base, custom)


def _field_types(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - unresolvable forward references: keep the raw annotations
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _copy_field(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
    if f.default is not dataclasses.MISSING:
        return dataclasses.field(default=f.default, metadata=f.metadata)
    return dataclasses.field(metadata=f.metadata)


def _merge(base: type, custom: type) -> type:
    base_types, custom_types = _field_types(base), _field_types(custom)
    custom_fields = {f.name: f for f in dataclasses.fields(custom)}
    spec: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(base):
        theirs = custom_fields.get(f.name)
        mine_t, theirs_t = base_types[f.name], custom_types.get(f.name)
        if theirs is None:
            spec.append((f.name, mine_t, _copy_field(f)))
        elif dataclasses.is_dataclass(mine_t) and dataclasses.is_dataclass(theirs_t):
            merged = _merge(mine_t, theirs_t)  # type: ignore[arg-type]
            spec.append((f.name, merged, dataclasses.field(default_factory=merged)))
        else:
            spec.append((f.name, theirs_t, _copy_field(theirs)))
    for name, theirs in custom_fields.items():
        if name not in {n for n, _, _ in spec}:
            spec.append((name, custom_types[name], _copy_field(theirs)))
    return dataclasses.make_dataclass(f"Merged{base.__name__}", spec, bases=(base,), kw_only=True)
