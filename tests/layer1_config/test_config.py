"""Layer 1: the new config, its validation and ConfigManager's TOML + CLI parsing."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from torchtitan_spmd.config import (
    SPMD_BACKENDS,
    ConfigManager,
    DebugConfig,
    JobConfig,
    ParallelismConfig,
    SpmdTypecheckingWarning,
    TrainingConfig,
)


def test_parallelism_defaults_mirror_torchtitan() -> None:
    p = ParallelismConfig()
    assert (
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.context_parallel_degree,
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
        p.expert_parallel_degree,
        p.enable_sequence_parallel,
        p.disable_loss_parallel,
        p.spmd_backend,
    ) == (1, -1, 1, 1, 1, 1, True, False, "default")
    assert SPMD_BACKENDS == ("default", "full_dtensor", "spmd_types")
    d = DebugConfig()
    assert d.spmd_typechecking is False and d.deterministic is False


def test_every_parallelism_field_has_a_docstring() -> None:
    from torchtitan_spmd.config.manager import _field_docs

    docs = _field_docs(ParallelismConfig)
    missing = [n for n in ParallelismConfig.field_names() if not docs.get(n)]
    assert not missing, missing
    assert "spmd_typechecking" in _field_docs(DebugConfig)


@pytest.mark.parametrize("backend", SPMD_BACKENDS)
def test_each_backend_value_accepted(backend: str) -> None:
    assert ParallelismConfig(spmd_backend=backend).spmd_backend == backend
    cfg = ConfigManager().parse_args(["--parallelism.spmd_backend", backend])
    assert cfg.parallelism.spmd_backend == backend


def test_unknown_backend_names_field_value_choices_and_suggestion() -> None:
    with pytest.raises(ValueError) as err:
        ParallelismConfig(spmd_backend="spmd_type")  # type: ignore[arg-type]
    msg = str(err.value)
    assert "parallelism.spmd_backend" in msg and "'spmd_type'" in msg
    for choice in SPMD_BACKENDS:
        assert repr(choice) in msg
    assert "Did you mean 'spmd_types'?" in msg


def test_unknown_backend_rejected_on_assignment_too() -> None:
    p = ParallelismConfig()
    with pytest.raises(ValueError, match="full_dtensr"):
        p.spmd_backend = "full_dtensr"  # type: ignore[assignment]
    assert p.spmd_backend == "default"


def test_partial_dtensor_is_normalised_to_default() -> None:
    assert ParallelismConfig(spmd_backend="partial_dtensor").spmd_backend == "default"  # type: ignore[arg-type]
    cfg = ConfigManager().parse_args(["--parallelism.spmd_backend=partial_dtensor"])
    assert cfg.parallelism.spmd_backend == "default"


def test_typechecking_with_pp_is_an_error() -> None:
    with pytest.raises(ValueError) as err:
        JobConfig(
            parallelism=ParallelismConfig(pipeline_parallel_degree=2, spmd_backend="spmd_types"),
            debug=DebugConfig(spmd_typechecking=True),
        )
    assert "spmd_typechecking" in str(err.value) and "pipeline_parallel_degree=2" in str(err.value)
    with pytest.raises(ValueError, match="pipeline_parallel_degree"):
        ConfigManager().parse_args(
            ["--debug.spmd_typechecking", "--parallelism.pipeline_parallel_degree", "4",
             "--parallelism.spmd_backend", "spmd_types"]
        )


@pytest.mark.parametrize("backend", ["default", "full_dtensor"])
def test_typechecking_without_spmd_types_warns_no_effect(backend: str) -> None:
    with pytest.warns(SpmdTypecheckingWarning, match="no effect") as rec:
        JobConfig(
            parallelism=ParallelismConfig(spmd_backend=backend),  # type: ignore[arg-type]
            debug=DebugConfig(spmd_typechecking=True),
        )
    assert rec[0].filename == __file__


def test_typechecking_with_spmd_types_is_silent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = JobConfig(
            parallelism=ParallelismConfig(spmd_backend="spmd_types"),
            debug=DebugConfig(spmd_typechecking=True),
        )
    assert cfg.debug.spmd_typechecking


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"tensor_parallel_degree": "2"}, "expected int, got str"),
        ({"tensor_parallel_degree": True}, "expected int, got bool"),
        ({"enable_sequence_parallel": 1}, "expected bool, got int"),
        ({"spmd_backend": 3}, "invalid value 3"),
    ],
)
def test_wrong_types_name_the_field(kwargs: dict, needle: str) -> None:
    with pytest.raises((TypeError, ValueError)) as err:
        ParallelismConfig(**kwargs)
    assert f"parallelism.{next(iter(kwargs))}" in str(err.value)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [("tensor_parallel_degree", 0), ("data_parallel_shard_degree", -2), ("expert_parallel_degree", -1)],
)
def test_degrees_must_be_positive(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"parallelism.{field}.*{value}"):
        ParallelismConfig(**{field: value})


def test_training_bounds() -> None:
    with pytest.raises(ValueError, match="training.steps must be >= 1, got 0"):
        TrainingConfig(steps=0)
    assert TrainingConfig(max_norm=2).max_norm == 2.0  # int widened to float


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_toml_then_cli_overrides(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
[parallelism]
tensor_parallel_degree = 2
spmd_backend = "full_dtensor"

[training]
steps = 7
local-batch-size = 3
""",
    )
    cfg = ConfigManager().parse_args(
        ["--job.config_file", path, "--training.steps", "9", "--parallelism.spmd-backend", "spmd_types"]
    )
    assert cfg.parallelism.tensor_parallel_degree == 2
    assert cfg.parallelism.spmd_backend == "spmd_types"
    assert cfg.training.steps == 9 and cfg.training.local_batch_size == 3
    assert cfg.job.config_file == path


def test_toml_override_of_hyphenated_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "[training]\nlocal-batch-size = 3\n")
    cfg = ConfigManager().parse_args(["--job.config-file", path, "--training.local_batch_size", "5"])
    assert cfg.training.local_batch_size == 5


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--debug.spmd_typechecking"], True),
        (["--debug.spmd-typechecking"], True),
        (["--debug.spmd_typechecking", "false"], False),
        (["--debug.spmd_typechecking=False"], False),
        (["--debug.no-spmd_typechecking"], False),
        (["--debug.no-spmd-typechecking"], False),
        (["--debug.spmd_typechecking", "--debug.no_spmd_typechecking"], False),
    ],
)
def test_bare_and_negative_booleans(argv: list[str], expected: bool) -> None:
    argv = [*argv, "--parallelism.spmd_backend", "spmd_types"]
    assert ConfigManager().parse_args(argv).debug.spmd_typechecking is expected


def test_cli_values_are_typed() -> None:
    cfg = ConfigManager().parse_args(
        ["--parallelism.tensor_parallel_degree", "2", "--optimizer.lr", "3e-4", "--debug.seed", "7",
         "--debug.deterministic"]
    )
    assert cfg.parallelism.tensor_parallel_degree == 2
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.debug.seed == 7 and cfg.debug.deterministic is True


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--parallelism.spmd_backend", "spmd_type"], ["spmd_backend", "'spmd_type'", "Did you mean 'spmd_types'"]),
        (["--parallelism.tensor_parallel_degre", "2"], ["unknown option", "--parallelism.tensor_parallel_degree"]),
        (["--paralelism.tensor_parallel_degree", "2"], ["unknown option", "Did you mean"]),
        (["--parallelism.tensor_parallel_degree", "two"], ["--parallelism.tensor_parallel_degree", "expected int"]),
        (["--parallelism.tensor_parallel_degree"], ["missing value"]),
        (["--debug.spmd_typechecking=maybe"], ["invalid boolean 'maybe'"]),
        (["--training.no-steps"], ["only boolean options"]),
        (["stray"], ["unexpected argument 'stray'"]),
    ],
)
def test_cli_errors(argv: list[str], needles: list[str]) -> None:
    with pytest.raises((ValueError, TypeError)) as err:
        ConfigManager().parse_args(argv)
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("[paralelism]\ntensor_parallel_degree = 2\n", ["unknown config section [paralelism]", "Did you mean 'parallelism'"]),
        ("[parallelism]\ntensor_paralel_degree = 2\n", ["[parallelism]", "unknown key 'tensor_paralel_degree'", "Did you mean 'tensor_parallel_degree'"]),
        ("[parallelism]\ntensor_parallel_degree = '2'\n", ["parallelism.tensor_parallel_degree", "expected int, got str"]),
        ("[parallelism]\nspmd_backend = 'fsdp'\n", ["parallelism.spmd_backend", "'fsdp'", "'spmd_types'"]),
        ("steps = 3\n", ["top-level key 'steps'"]),
        ("[parallelism\n", ["not valid TOML"]),
    ],
)
def test_toml_errors(tmp_path: Path, text: str, needles: list[str]) -> None:
    path = _write(tmp_path, text)
    with pytest.raises((ValueError, TypeError)) as err:
        ConfigManager().parse_args(["--job.config_file", path])
    for needle in needles:
        assert needle in str(err.value)


def test_missing_config_file() -> None:
    with pytest.raises(ValueError, match="no such file"):
        ConfigManager().parse_args(["--job.config_file", "/nonexistent/job.toml"])


def test_from_dict_roundtrip() -> None:
    cfg = JobConfig.from_dict({"parallelism": {"tensor_parallel_degree": 2}, "debug": {"seed": 3}})
    again = JobConfig.from_dict(cfg.to_dict())
    assert again == cfg


def test_config_cli_prints_resolved_toml(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "torchtitan_spmd.config", "--parallelism.spmd_backend", "spmd_types",
         "--parallelism.tensor_parallel_degree", "2"],
        capture_output=True, text=True, check=True,
    ).stdout
    assert '[parallelism]' in out and 'spmd_backend = "spmd_types"' in out
    assert "tensor_parallel_degree = 2" in out


def test_config_cli_reports_errors_with_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_spmd.config", "--parallelism.spmd_backend", "nope"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2 and "parallelism.spmd_backend" in proc.stderr


def test_help_lists_options() -> None:
    text = ConfigManager().help_text()
    assert "--parallelism.spmd_backend" in text and "--debug.spmd_typechecking" in text
    assert "plain local tensors" in text  # the field docstring is shown
