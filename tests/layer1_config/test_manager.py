"""Layer 1: ``ConfigManager`` — torchtitan's ``--module/--config`` contract, parsed by tyro.

A fork fixture (``fork_fixture/acme_titan``) has its own root dataclass embedding this
library's sections and its own ``config_registry``; ``fork_fixture/acme_models``
stands in for this library's model registry (short names).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from fork_helpers import FORK, fork_env

import torchtitan_spmd.config.manager as manager
from torchtitan_spmd.config import ConfigManager, JobConfig, ParallelismConfig
from torchtitan_spmd.config.__main__ import to_toml


def parse(*args: str) -> object:
    return ConfigManager().parse_args(list(args))


@pytest.fixture
def short_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Point ``--module NAME`` at the stand-in model registry ``acme_models`` (no fork named torchtitan)."""
    monkeypatch.setattr(manager, "MODELS_PACKAGE", "acme_models")
    monkeypatch.setattr(manager, "FORK_FIRST", ("torchtitan.models", "torchtitan.experiments", "acme_models"))


# --------------------------------------------------------------------------------------
# --module / --config
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ["--module", "acme_titan", "--config", "acme_debug"],
        ["--module=acme_titan", "--config=acme_debug"],
        ["--config", "acme_debug", "--module", "acme_titan.config_registry"],
    ],
)
def test_fork_module_and_config(args: list[str]) -> None:
    from acme_titan.trainer import AcmeTrainerConfig

    cm = ConfigManager()
    cfg = cm.parse_args(args)
    assert type(cfg) is AcmeTrainerConfig and cm.config is cfg
    assert cfg.training.steps == 10 and cfg.parallelism.tensor_parallel_degree == 2
    assert cfg.data.corpus == "acme-web"


def test_short_name_resolves_in_the_model_registry(short_names: None) -> None:
    cfg = parse("--module", "llama9", "--config", "llama9_debugmodel", "--training.steps", "5")
    assert isinstance(cfg, JobConfig)
    assert (cfg.model.name, cfg.model.flavor, cfg.training.steps) == ("llama9", "debugmodel", 5)
    assert manager.short_module_names() == ["llama9"]  # not the plain module nor the bare package


def test_short_name_list_without_a_model_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager, "MODELS_PACKAGE", "acme_no_such_models")
    assert manager.short_module_names() == []


@pytest.mark.parametrize(
    ("args", "exc", "needles"),
    [
        ([], ValueError, ["--module is required", "--module llama3 --config llama3_debugmodel"]),
        (["--config", "acme_debug"], ValueError, ["--module is required"]),
        (["--module", "acme_titan"], ValueError, ["--config is required"]),
        (["--module"], ValueError, ["--module requires a value"]),
        (["--module", "nonexistent", "--config", "foo"], ImportError,
         ["Cannot import module 'nonexistent' or 'nonexistent.config_registry'", "supported modules are: ['llama9']"]),
        (["--module", "acme_titan.nonexistent", "--config", "foo"], ImportError, ["Cannot import module"]),
        (["--module", "acme_titan", "--config", "acme_nope"], ValueError,
         ["Config function 'acme_nope' not found in acme_titan.config_registry",
          "Available config functions: ['acme_debug', 'acme_full_dtensor', 'acme_returns_dict']"]),
        (["--module", "acme_titan", "--config", "NOT_A_FUNCTION"], ValueError, ["not found"]),
        (["--module", "acme_titan", "--config", "acme_returns_dict"], TypeError,
         ["acme_titan.config_registry.acme_returns_dict() must return a dataclass instance", "got dict"]),
        (["--module", "acme_titan", "--config", "acme_debug", "--job.config_file", "x.toml"], ValueError,
         ["cannot be combined with --module/--config"]),
    ],
)
def test_errors_as_torchtitan(short_names: None, args: list[str], exc: type, needles: list[str]) -> None:
    with pytest.raises(exc) as err:
        parse(*args)
    assert type(err.value) is exc
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize("module", ["acme_broken", "acme_broken_pkg", "acme_broken_pkg.models"])
def test_an_import_error_inside_the_module_is_not_hidden(module: str) -> None:
    """The registry (or its package) exists but needs a missing dependency: say that."""
    with pytest.raises(ModuleNotFoundError) as err:
        parse("--module", module, "--config", "broken_debug")
    assert err.value.name == "acme_missing_dependency"


# --------------------------------------------------------------------------------------
# tyro overrides on the loaded config
# --------------------------------------------------------------------------------------
def test_overrides_of_every_kind_on_a_fork_root() -> None:
    cfg = parse(
        *FORK,
        "--training.steps", "5",                                  # an int
        "--training.max-norm", "0.5",                             # hyphens work too
        "--dump_folder", "/tmp/acme",                             # a root field of the fork
        "--data.corpus", "acme-books", "--data.no-shuffle",       # the fork's own section
        "--debug.deterministic", "--debug.seed", "7",             # a flag; int | None
        "--checkpoint.exclude_from_loading", "optimizer,lr_scheduler",  # comma list
        "--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0", "layers.1,norm",
        "--parallelism.context_parallel_load_balancer", "None",
        "--activation_checkpoint.mode", "none",
    )
    assert cfg.training.steps == 5 and cfg.training.max_norm == 0.5
    assert cfg.training.local_batch_size == 2  # from the config function
    assert cfg.dump_folder == "/tmp/acme"
    assert cfg.data.corpus == "acme-books" and cfg.data.shuffle is False
    assert cfg.debug.deterministic is True and cfg.debug.seed == 7
    assert cfg.checkpoint.exclude_from_loading == ["optimizer", "lr_scheduler"]
    assert cfg.parallelism.module_fqns_per_model_part == [["tok_embeddings", "layers.0"], ["layers.1", "norm"]]
    assert cfg.parallelism.context_parallel_load_balancer is None
    assert cfg.activation_checkpoint.mode == "none"


def test_list_defaults_and_empty_comma_list() -> None:
    cfg = parse(*FORK)
    assert cfg.checkpoint.exclude_from_loading == [] and cfg.compile.components == ["model", "loss"]
    assert parse(*FORK, "--compile.components", "").compile.components == []


def test_parse_overrides_leaves_the_given_config_alone() -> None:
    base = JobConfig()
    cfg = ConfigManager().parse_overrides(base, ["--training.steps", "3", "--parallelism.spmd_backend", "spmd_types"])
    assert (cfg.training.steps, cfg.parallelism.spmd_backend) == (3, "spmd_types")
    assert (base.training.steps, base.parallelism.spmd_backend) == (10000, "default")


@pytest.mark.parametrize("spelling", ["--parallelism.spmd_backend=partial_dtensor", "--parallelism.spmd-backend"])
def test_partial_dtensor_is_accepted_through_tyro(spelling: str) -> None:
    args = [spelling] if "=" in spelling else [spelling, "partial_dtensor"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an alias, not a deprecated spelling (June surface)
        parallelism = parse(*FORK, *args).parallelism
    assert (parallelism.spmd_backend, parallelism.backend_name) == ("partial_dtensor", "default")  # as written


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--parallelism.spmd_backend", "full_dtensr"],
         ["invalid value 'full_dtensr'", "'default', 'full_dtensor', 'spmd_types'", "Did you mean 'full_dtensor'?"]),
        (["--activation_checkpoint.mode", "selectiv"], ["selectiv", "selective"]),
        (["--parallelism.tensor_paralel_degree", "2"], ["Unrecognized options", "--parallelism.tensor-parallel-degree"]),
        (["--parallelism.tensor_parallel_degree", "two"], ["--parallelism.tensor-parallel-degree", "two"]),
        (["--parallelism.tensor_parallel_degree", "0"], ["parallelism.tensor_parallel_degree must be >= 1, got 0"]),
        (["--debug.deterministic", "true"], ["Unrecognized", "true"]),
    ],
)
def test_bad_values_are_tyro_errors_with_exit_2(
    args: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as err:
        parse(*FORK, *args)
    assert err.value.code == 2
    text = " ".join(capsys.readouterr().err.split())  # tyro wraps its messages in a box
    text = text.replace("│ │", " ").replace("│", " ")
    text = " ".join(text.split())
    for needle in needles:
        assert needle in text, text


def test_help_lists_the_forks_options_with_their_docstrings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        parse(*FORK, "--help")
    assert err.value.code == 0
    out = capsys.readouterr().out
    assert "--parallelism.spmd-backend" in out and "--data.corpus" in out
    words = " ".join(" ".join(line.strip(" │") for line in out.splitlines()).split())  # tyro's box, unwrapped
    assert "(plain local tensors typed with spmd_types)" in words  # the spmd_backend field docstring


def test_help_without_a_module_explains_the_contract(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        parse("--help-all")
    assert err.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--module M --config C" in out and "--job.config_file" in out
    assert "--debug.spmd-typechecking" in out


#: The short ``--help``: 3 usage lines, the contract, one line per section and the root field.
HELP_LINE_BUDGET = 30
#: ``--help-all`` at 80 columns: every field with its re-flowed docstring (measured 560 lines; 646
#: when tyro kept the docstrings' hard line breaks; 627 with upstream's ``[fault_tolerance]``
#: section, 13 fields, issue 43). A new section raises it by what it measures, no more.
HELP_ALL_LINE_BUDGET = 640
#: RST markup that must not reach a help screen.
MARKUP = ("``", ":class:", ":func:", ":mod:", ":meth:", ":attr:", ":data:")


@pytest.mark.parametrize("argv", [("--help-all",), (*FORK, "--help")], ids=["help-all", "config-help"])
def test_the_full_help_is_plain_reflowed_text(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as err:
        parse(*argv)
    assert err.value.code == 0
    out = capsys.readouterr().out
    for markup in MARKUP:
        assert markup not in out, (markup, [line for line in out.splitlines() if markup in line][:3])
    words = " ".join(" ".join(line.strip(" │") for line in out.splitlines()).split())  # tyro's box, unwrapped
    # docstrings of several source lines with markup, as plain sentences
    assert ("How parallelism is expressed: \"default\" (DTensor on TP/EP axes plus FSDP2; upstream's August "
            "spelling \"partial_dtensor\"), \"full_dtensor\"") in words
    if argv == ("--help-all",):
        assert len(out.splitlines()) <= HELP_ALL_LINE_BUDGET, len(out.splitlines())
        assert "--job.dump-folder STR Folder for logs and other outputs of the run." in words
        assert "Legacy TOML source and output folder." in words  # the section, without its "``[job]``:"


def test_short_help_is_one_screen_of_plain_text(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(sys, "argv", ["train.py", "--help"])
    fake_main = type(sys)("__main__")
    fake_main.__spec__ = importlib.util.find_spec("torchtitan_spmd.config.__main__")  # as `python -m` sets it
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    with pytest.raises(SystemExit) as err:
        parse("--help")
    assert err.value.code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) <= HELP_LINE_BUDGET, len(lines)
    assert lines[0] == "usage: python -m torchtitan_spmd.config --module M --config C [--section.field VALUE ...]"
    assert "--help-all" in out
    for markup in ("``", ":class:", ":func:", ":mod:", "/work", ".py "):
        assert markup not in out, markup
    assert all(len(line) <= 100 for line in lines)
    for name in JobConfig.section_types():
        assert sum(line.startswith(f"  {name} ") for line in lines) == 1, name


@dataclasses.dataclass
class CustomCheckpoint:
    convert_path: str = "/custom/path"


@dataclasses.dataclass
class CustomRoot:
    checkpoint: CustomCheckpoint
    extra: int = 3


def test_merge_configs_is_deprecated_but_works() -> None:
    with pytest.warns(DeprecationWarning, match="_merge_configs is deprecated"):
        merged = ConfigManager._merge_configs(JobConfig, CustomRoot)
    cfg = merged()
    assert isinstance(cfg, JobConfig)
    assert cfg.checkpoint.convert_path == "/custom/path" and cfg.checkpoint.interval == 500
    assert cfg.extra == 3 and cfg.parallelism == ParallelismConfig()


# --------------------------------------------------------------------------------------
# The legacy TOML loader (forks from before torchtitan's Python registries)
# --------------------------------------------------------------------------------------
def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_toml_then_cli_overrides(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[parallelism]\ntensor_parallel_degree = 2\nspmd_backend = "full_dtensor"\n\n'
        "[training]\nsteps = 7\nlocal-batch-size = 3\n",
    )
    cfg = parse("--job.config_file", path, "--training.steps", "9", "--parallelism.spmd-backend", "spmd_types")
    assert isinstance(cfg, JobConfig)
    assert cfg.parallelism.tensor_parallel_degree == 2 and cfg.parallelism.spmd_backend == "spmd_types"
    assert cfg.training.steps == 9 and cfg.training.local_batch_size == 3
    assert cfg.job.config_file == path
    assert parse(f"--job.config-file={path}").training.steps == 7


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("[paralelism]\ntensor_parallel_degree = 2\n", ["unknown config section [paralelism]", "Did you mean 'parallelism'"]),
        ("[parallelism]\ntensor_paralel_degree = 2\n", ["unknown key 'tensor_paralel_degree'", "Did you mean 'tensor_parallel_degree'"]),
        ("[parallelism]\ntensor_parallel_degree = '2'\n", ["parallelism.tensor_parallel_degree", "expected int, got str"]),
        ("[parallelism]\nspmd_backend = 'fsdp'\n", ["parallelism.spmd_backend", "'fsdp'", "'spmd_types'"]),
        ("steps = 3\n", ["top-level key 'steps'"]),
        ("[parallelism\n", ["not valid TOML"]),
    ],
)
def test_toml_errors(tmp_path: Path, text: str, needles: list[str]) -> None:
    with pytest.raises((ValueError, TypeError)) as err:
        parse("--job.config_file", _write(tmp_path, text))
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--optimizer.lr", "nan"], "optimizer.lr must be a finite number > 0, got nan"),
        (["--optimizer.lr=-1"], "optimizer.lr must be a finite number > 0, got -1.0"),
        (["--optimizer.eps", "0"], "optimizer.eps must be a finite number > 0, got 0.0"),
        (["--debug.seed=-5"], "debug.seed must be >= 0 and < 2**64 (torch.manual_seed's range), or None, got -5"),
        (["--comm.init_timeout_seconds", "0"], "comm.init_timeout_seconds must be in [1, 1000000000], got 0"),
        (["--comm.train_timeout_seconds", "0"], "comm.train_timeout_seconds must be in [1, 1000000000], got 0"),
        (["--debug.spmd_typechecking", "--debug.spmd_typechecking_steps", "0"],
         "debug.spmd_typechecking_steps must be >= 1 (type-check the first N steps), or None (every step), got 0"),
    ],
)
def test_bad_numbers_on_the_command_line_name_the_field(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as err:  # a TOML job: layer 1 alone has no model registry
        parse("--job.config_file", _write(tmp_path, "[training]\nsteps = 1\n"), *args)
    assert err.value.code == 2
    text = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert needle in text, text


@pytest.mark.parametrize(("flags", "steps"), [
    ([], None),
    (["--debug.spmd_typechecking_steps", "1"], 1),
    (["--debug.spmd-typechecking-steps=3"], 3),
    (["--debug.spmd_typechecking_steps", "None"], None),
])
def test_typechecking_steps_on_the_command_line(flags: list[str], steps: int | None, tmp_path: Path) -> None:
    cfg = parse("--job.config_file", _write(tmp_path, "[training]\nsteps = 1\n"),
                "--parallelism.spmd_backend", "spmd_types", "--debug.spmd_typechecking", *flags)
    assert cfg.debug.spmd_typechecking and cfg.debug.spmd_typechecking_steps == steps  # type: ignore[attr-defined]


def test_missing_config_file() -> None:
    with pytest.raises(ValueError, match="no such file"):
        parse("--job.config_file", "/nonexistent/job.toml")


def test_a_directory_as_the_config_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        parse("--job.config_file", str(tmp_path))
    assert str(err.value) == f"job.config_file {str(tmp_path)!r} is a directory, not a TOML file."


def test_a_config_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes("[job]\ndescription = 'caf\u00e9'\n".encode("latin-1"))
    with pytest.raises(ValueError) as err:
        parse("--job.config_file", str(path))
    msg = str(err.value)
    assert f"job.config_file {str(path)!r} is not UTF-8 text" in msg and "line 2" in msg, msg


# --------------------------------------------------------------------------------------
# python -m torchtitan_spmd.config
# --------------------------------------------------------------------------------------
def _config_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_spmd.config", *args],
        capture_output=True, text=True, env=fork_env(), timeout=120,
    )


def test_config_cli_prints_the_resolved_fork_config() -> None:
    proc = _config_cli(*FORK, "--parallelism.spmd_backend", "spmd_types", "--data.corpus", "x")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith('dump_folder = "./outputs"\n')
    assert '[parallelism]\n' in proc.stdout and 'spmd_backend = "spmd_types"' in proc.stdout
    assert '[data]\ncorpus = "x"\nshuffle = true\n' in proc.stdout
    assert 'components = ["model", "loss"]' in proc.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([*FORK, "--parallelism.spmd_backend", "nope"], "spmd-backend"),
        (["--config", "acme_debug"], "error: --module is required"),
        (["--module", "acme_nope", "--config", "x"], "error: Cannot import module 'acme_nope'"),
    ],
)
def test_config_cli_errors_exit_2(args: list[str], needle: str) -> None:
    proc = _config_cli(*args)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


def test_to_toml_nests_tables_and_skips_none() -> None:
    text = to_toml(JobConfig())
    assert "[parallelism]\n" in text and "seed" not in text.split("[debug]")[1].split("[")[0]
    assert 'exclude_from_loading = []' in text


def test_sections_work_without_tyro_and_the_manager_says_what_is_missing() -> None:
    """Machines with a preinstalled torch and no package index (GPU boxes) may lack tyro:
    the sections, and every layer that imports them, must not need it."""
    code = "\n".join([
        "import sys",
        "sys.modules['tyro'] = None  # import tyro -> ImportError",
        "from torchtitan_spmd.config import ConfigManager, JobConfig, check_supported",
        "check_supported(JobConfig.from_dict({'parallelism': {'tensor_parallel_degree': 2}}))",
        "try:",
        "    ConfigManager()",
        "except ImportError as err:",
        "    print(err)",
    ])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "ConfigManager parses the command line with tyro, which is not installed" in proc.stdout
    assert "pip install 'tyro>=1.0,<2'" in proc.stdout
