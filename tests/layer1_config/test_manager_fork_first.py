"""Layer 1: ``--module NAME`` as torchtitan resolves it, in a fork that uses this library's ConfigManager.

``fork_tt/`` is a stand-in fork laid out as upstream (a package named ``torchtitan`` with
``models/llama3`` and ``experiments/graph_trainer``) whose root config is upstream-shaped
(``dump_folder`` at the top level). It is put on ``sys.path`` only inside these tests.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchtitan_spmd.config import CompileConfig, ConfigManager, JobConfig, check_supported
from torchtitan_spmd.config.manager import FORK_FIRST, LIBRARY_FIRST

FORK_TT = Path(__file__).parent / "fork_tt"
DEBUG = ["--module", "llama3", "--config", "llama3_debugmodel"]


def _library_models_present() -> bool:
    """Whether the library's own model families (layer 3) are importable: not in layer 1's own
    stack prefix, where only a fork's families can be found."""
    try:
        return importlib.util.find_spec("torchtitan_spmd.models") is not None
    except ImportError:
        return False


needs_library_models = pytest.mark.skipif(
    not _library_models_present(), reason="the library's model families are layer 3's")


def _forget_fork() -> None:
    for name in [n for n in sys.modules if n == "torchtitan" or n.startswith("torchtitan.")]:
        del sys.modules[name]


@pytest.fixture
def fork_on_path() -> Iterator[None]:
    assert "torchtitan" not in sys.modules, "a real torchtitan is imported; these tests need the stand-in"
    sys.path.insert(0, str(FORK_TT))
    try:
        yield
    finally:
        sys.path.remove(str(FORK_TT))
        _forget_fork()


def test_short_name_finds_the_forks_package_first(fork_on_path: None) -> None:
    cfg = ConfigManager().parse_args([*DEBUG, "--dump_folder", "/tmp/fork-run", "--training.steps", "3"])
    assert type(cfg).__module__ == "torchtitan.config" and type(cfg).__name__ == "ForkTrainerConfig"
    assert cfg.dump_folder == "/tmp/fork-run"  # upstream's root field, as the fork's code reads it
    assert cfg.training.steps == 3
    assert not hasattr(cfg, "job")  # the fork's root type as it is, not JobConfig
    assert ConfigManager().parse_args(DEBUG).dump_folder == "./fork_outputs"  # the fork's function ran


def test_experiments_after_models(fork_on_path: None) -> None:
    cfg = ConfigManager().parse_args(["--module", "graph_trainer", "--config", "graph_debug"])
    assert type(cfg).__module__ == "torchtitan.experiments.graph_trainer.config_registry"


@needs_library_models
def test_library_trainer_finds_its_own_families_first(fork_on_path: None) -> None:
    cfg = ConfigManager(module_packages=LIBRARY_FIRST).parse_args(DEBUG)
    assert type(cfg) is JobConfig and cfg.model.name == "llama3"


@needs_library_models
def test_without_a_fork_short_names_fall_back_to_the_library() -> None:
    assert "torchtitan" not in sys.modules
    cfg = ConfigManager().parse_args(DEBUG)
    assert type(cfg) is JobConfig and cfg.model.name == "llama3"
    assert FORK_FIRST[-1] == LIBRARY_FIRST[0] == "torchtitan_spmd.models"


@needs_library_models
def test_unknown_short_name_lists_every_package(fork_on_path: None) -> None:
    with pytest.raises(ImportError, match=r"supported modules are: \[.*'graph_trainer'.*'llama3'.*qwen3.*\] "
                       r"\(looked for in torchtitan\.models, torchtitan\.experiments, torchtitan_spmd\.models\)"):
        ConfigManager().parse_args(["--module", "llama9", "--config", "x"])
    with pytest.raises(TypeError, match="module_packages must be a sequence of package names"):
        ConfigManager(module_packages="torchtitan.models")


# ----------------------------------------------------------------- a subclassed section
def test_a_forks_subclass_of_a_library_section_parses_and_validates(
    fork_on_path: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchtitan.config import GraphCompileConfig

    args = ["--module", "graph_trainer", "--config", "graph_debug"]
    cfg = ConfigManager().parse_args([*args, "--compile.mode", "aot", "--compile.passes", "fuse,dce",
                                      "--compile.backend", "aot_eager"])
    assert isinstance(cfg.compile, GraphCompileConfig) and isinstance(cfg.compile, CompileConfig)
    assert (cfg.compile.mode, cfg.compile.passes, cfg.compile.backend) == ("aot", ["fuse", "dce"], "aot_eager")
    assert cfg.compile.enable  # the config function's value, kept
    check_supported(cfg)  # the support table sees the subclass as the library's section
    # its own fields: tyro's choices on the command line, its own rule on construction
    for bad, says in ((["--compile.mode", "eager"], "invalid choice 'eager' for argument '--compile.mode'"),
                      (["--compile.passes", "fuse,fuse"], "compile.passes must not repeat a pass")):
        with pytest.raises(SystemExit) as exit_:
            ConfigManager().parse_args([*args, *bad])
        assert exit_.value.code == 2
        assert says in " ".join(capsys.readouterr().err.replace("│", " ").split())
    # the inherited fields keep the library's checks
    with pytest.raises(ValueError, match=r"compile\.mode: invalid value 'eager'"):
        GraphCompileConfig(mode="eager")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"compile\.enable: expected bool"):
        GraphCompileConfig(enable="yes")  # type: ignore[arg-type]
