"""Layer 1: every legacy ``full_dtensor`` channel, its warning, and the conflict error.

Each channel must emit exactly one DeprecationWarning that names the replacement
spelling and the removal release, attributed to the user's line.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from fork_helpers import FORK, fork_env

from torchtitan_spmd.compat import REMOVAL_RELEASE, LegacySpellingWarning
from torchtitan_spmd.config import ConfigManager, JobConfig, ParallelismConfig


def _one_warning(fn: Callable[[], object]) -> tuple[object, warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        result = fn()
    deprecations = [w for w in rec if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in rec]
    return result, deprecations[0]


def _assert_message(w: warnings.WarningMessage, replacement: str) -> None:
    assert issubclass(w.category, LegacySpellingWarning)
    assert issubclass(w.category, DeprecationWarning)
    text = str(w.message)
    assert "deprecated" in text and f"removed in torchtitan_spmd {REMOVAL_RELEASE}" in text
    assert replacement in text, text


def _line_of(marker: str) -> int:
    """Line number in this file of the (unique) line containing ``marker``."""
    lines = Path(__file__).read_text().splitlines()
    hits = [i for i, line in enumerate(lines, start=1) if marker in line and "_line_of" not in line]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


# Channel 1: constructor keyword ------------------------------------------------------
@pytest.mark.parametrize(("value", "backend"), [(True, "full_dtensor"), (False, "default")])
def test_channel1_constructor_keyword(value: bool, backend: str) -> None:
    cfg, w = _one_warning(lambda: ParallelismConfig(full_dtensor=value))  # CH1-CALL
    assert cfg.spmd_backend == backend  # type: ignore[attr-defined]
    _assert_message(w, f"ParallelismConfig(spmd_backend={backend!r})")
    assert (w.filename, w.lineno) == (__file__, _line_of("# CH1-CALL"))


def test_channel1_keeps_other_kwargs() -> None:
    cfg, _ = _one_warning(lambda: ParallelismConfig(tensor_parallel_degree=2, full_dtensor=True))
    assert cfg.tensor_parallel_degree == 2  # type: ignore[attr-defined]


def test_channel1_rejects_non_bool() -> None:
    with pytest.raises(TypeError, match="expected bool, got str"):
        ParallelismConfig(full_dtensor="yes")


# Channel 2: attribute read -----------------------------------------------------------
@pytest.mark.parametrize(("backend", "expected"), [("full_dtensor", True), ("default", False), ("spmd_types", False)])
def test_channel2_attribute_read(backend: str, expected: bool) -> None:
    cfg = ParallelismConfig(spmd_backend=backend)  # type: ignore[arg-type]
    value, w = _one_warning(lambda: cfg.full_dtensor)  # CH2-READ
    assert value is expected
    _assert_message(w, 'ParallelismConfig.spmd_backend == "full_dtensor"')
    assert (w.filename, w.lineno) == (__file__, _line_of("# CH2-READ"))


def test_channel2_property_is_marked_deprecated_for_type_checkers() -> None:
    prop = inspect.getattr_static(ParallelismConfig, "full_dtensor")
    assert isinstance(prop, property)
    assert "deprecated" in prop.fget.__deprecated__  # type: ignore[union-attr]
    assert "deprecated" in prop.fset.__deprecated__  # type: ignore[union-attr]


# Channel 3: attribute assignment -----------------------------------------------------
def test_channel3_attribute_assignment() -> None:
    cfg = ParallelismConfig()

    def assign_true() -> None:
        cfg.full_dtensor = True  # CH3-SET

    _, w = _one_warning(assign_true)
    assert cfg.spmd_backend == "full_dtensor"
    _assert_message(w, "ParallelismConfig.spmd_backend = 'full_dtensor'")
    assert (w.filename, w.lineno) == (__file__, _line_of("# CH3-SET"))

    def assign_false() -> None:
        cfg.full_dtensor = False

    _one_warning(assign_false)
    assert cfg.spmd_backend == "default"


# Channel 4: CLI flag, through tyro onto a fork's own root -------------------------------
@pytest.mark.parametrize(
    ("argv", "backend"),
    [
        (["--parallelism.full_dtensor"], "full_dtensor"),
        (["--parallelism.full-dtensor"], "full_dtensor"),
        (["--parallelism.full_dtensor", "true"], "full_dtensor"),
        (["--parallelism.full_dtensor=false"], "default"),
        (["--parallelism.full-dtensor", "False"], "default"),
        (["--parallelism.no-full_dtensor"], "default"),
        (["--parallelism.no-full-dtensor"], "default"),
        (["--parallelism.no_full_dtensor"], "default"),
    ],
)
def test_channel4_cli_flag(argv: list[str], backend: str) -> None:
    cfg, w = _one_warning(lambda: ConfigManager().parse_args([*FORK, *argv, "--training.steps", "2"]))  # CH4-CLI
    assert cfg.parallelism.spmd_backend == backend  # type: ignore[attr-defined]
    assert cfg.training.steps == 2  # type: ignore[attr-defined]
    assert cfg.parallelism.tensor_parallel_degree == 2  # type: ignore[attr-defined]  # the fork's value
    _assert_message(w, f"--parallelism.spmd_backend {backend}")
    assert (w.filename, w.lineno) == (__file__, _line_of("# CH4-CLI"))


def test_channel4_cli_flag_on_a_legacy_toml_config(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text("[training]\nsteps = 3\n")
    cfg, w = _one_warning(
        lambda: ConfigManager().parse_args(["--job.config_file", str(path), "--parallelism.no-full-dtensor"])
    )
    assert cfg.parallelism.spmd_backend == "default" and cfg.training.steps == 3  # type: ignore[attr-defined]
    _assert_message(w, "--parallelism.spmd_backend default")


def test_legacy_keyword_in_a_forks_config_function_warns_once_at_its_line() -> None:
    from acme_titan import config_registry

    cfg, w = _one_warning(lambda: ConfigManager().parse_args(["--module", "acme_titan", "--config", "acme_full_dtensor"]))
    assert cfg.parallelism.spmd_backend == "full_dtensor"  # type: ignore[attr-defined]
    _assert_message(w, "ParallelismConfig(spmd_backend='full_dtensor')")
    lines = Path(config_registry.__file__).read_text().splitlines()
    assert w.filename == config_registry.__file__
    assert "ParallelismConfig(" in lines[w.lineno - 1]


def test_channel4_cli_flag_via_subprocess_is_visible_by_default() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_spmd.config", *FORK, "--parallelism.full_dtensor"],
        capture_output=True, text=True, check=True, env=fork_env(),
    )
    assert 'spmd_backend = "full_dtensor"' in proc.stdout
    assert proc.stderr.count("LegacySpellingWarning") == 1
    assert "--parallelism.spmd_backend full_dtensor" in proc.stderr
    # run as `python -m`, no user frame calls the parse: the warning names the command line,
    # not Python's `<frozen runpy>:88`
    assert proc.stderr.startswith("<command line>:0: LegacySpellingWarning:"), proc.stderr
    assert "runpy" not in proc.stderr


# Channel 5: TOML key -----------------------------------------------------------------
@pytest.mark.parametrize(("text", "backend"), [("true", "full_dtensor"), ("false", "default")])
def test_channel5_toml_key_points_at_the_toml_line(tmp_path: Path, text: str, backend: str) -> None:
    path = tmp_path / "legacy.toml"
    path.write_text(
        f"# a fork's config\n[training]\nsteps = 3\n\n[parallelism]\ntensor_parallel_degree = 2\nfull_dtensor = {text}\n"
    )
    cfg, w = _one_warning(lambda: ConfigManager().parse_args(["--job.config_file", str(path)]))
    assert cfg.parallelism.spmd_backend == backend  # type: ignore[attr-defined]
    assert cfg.parallelism.tensor_parallel_degree == 2  # type: ignore[attr-defined]
    _assert_message(w, f'parallelism.spmd_backend = "{backend}"')
    assert (w.filename, w.lineno) == (str(path), 7)


def test_channel5_hyphenated_toml_key(tmp_path: Path) -> None:
    path = tmp_path / "legacy.toml"
    path.write_text("[parallelism]\nfull-dtensor = true\n")
    cfg, w = _one_warning(lambda: ConfigManager().parse_args(["--job.config_file", str(path)]))
    assert cfg.parallelism.spmd_backend == "full_dtensor"  # type: ignore[attr-defined]
    assert w.lineno == 2


# Channel 6: plain dict ---------------------------------------------------------------
def test_channel6_plain_dict() -> None:
    cfg, w = _one_warning(lambda: JobConfig.from_dict({"parallelism": {"full_dtensor": True}}))  # CH6-DICT
    assert cfg.parallelism.spmd_backend == "full_dtensor"  # type: ignore[attr-defined]
    _assert_message(w, 'parallelism.spmd_backend = "full_dtensor"')
    assert (w.filename, w.lineno) == (__file__, _line_of("# CH6-DICT"))


def test_channel6_section_dict() -> None:
    cfg, w = _one_warning(lambda: ParallelismConfig.from_dict({"full_dtensor": False}))
    assert cfg.spmd_backend == "default"  # type: ignore[attr-defined]
    assert w.filename == __file__


# Conflicts ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: ParallelismConfig(full_dtensor=True, spmd_backend="spmd_types"),
        lambda: ParallelismConfig(full_dtensor=False, spmd_backend="full_dtensor"),
        lambda: JobConfig.from_dict({"parallelism": {"full_dtensor": True, "spmd_backend": "default"}}),
        lambda: ConfigManager().parse_args([*FORK, "--parallelism.full_dtensor", "--parallelism.spmd_backend", "spmd_types"]),
        lambda: ConfigManager().parse_args([*FORK, "--parallelism.spmd_backend=full_dtensor", "--parallelism.no-full_dtensor"]),
    ],
)
def test_conflicting_spellings_raise_and_name_both(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError) as err:
        make()
    msg = str(err.value)
    assert "full_dtensor=" in msg and "spmd_backend=" in msg and "conflicting" in msg


def test_agreeing_spellings_are_accepted() -> None:
    cfg, _ = _one_warning(lambda: ParallelismConfig(full_dtensor=True, spmd_backend="full_dtensor"))
    assert cfg.spmd_backend == "full_dtensor"  # type: ignore[attr-defined]


def test_legacy_flag_given_twice_is_an_error() -> None:
    with pytest.raises(ValueError, match="given twice"):
        ConfigManager().parse_args([*FORK, "--parallelism.full_dtensor", "--parallelism.no-full_dtensor"])


# -W error::DeprecationWarning turns every channel into an error --------------------
_CHANNELS = {
    "ctor": "ParallelismConfig(full_dtensor=True)",
    "read": "ParallelismConfig().full_dtensor",
    "write": "c = ParallelismConfig(); c.full_dtensor = True",
    "cli": f"ConfigManager().parse_args({[*FORK, '--parallelism.full_dtensor']!r})",
    "toml": "ConfigManager().parse_args(['--job.config_file', TOML])",
    "dict": "JobConfig.from_dict({'parallelism': {'full_dtensor': True}})",
}


@pytest.mark.parametrize("channel", sorted(_CHANNELS))
def test_w_error_turns_each_channel_into_an_error(tmp_path: Path, channel: str) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("[parallelism]\nfull_dtensor = true\n")
    code = textwrap.dedent(
        f"""
        from torchtitan_spmd.config import ConfigManager, JobConfig, ParallelismConfig
        TOML = {str(toml)!r}
        {_CHANNELS[channel]}
        """
    )
    proc = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True, text=True,
        env=fork_env(),
    )
    assert proc.returncode != 0
    assert "LegacySpellingWarning" in proc.stderr and "deprecated" in proc.stderr
    ok = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=fork_env())
    assert ok.returncode == 0, ok.stderr
