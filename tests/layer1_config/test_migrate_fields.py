"""The codemod's field-move step (``compat/migrate_fields.py``): a fork's tree from
``training.dataset*`` / ``model.hf_assets_path`` to upstream's (a0c831c49) ``dataloader.*`` and
root ``hf_assets_path``.

Fixture inputs live in ``fixtures/migrate_fields``; each ``NAME.expected`` is the text the
codemod must produce (reviewed by hand). Beyond the text, the migrated files must mean what
the originals meant, with no deprecation warning left: the TOML loads to the same config,
the shell flags parse to the same config, the Python sets and reads the same fields.
"""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from torchtitan_spmd.compat.migrate import main
from torchtitan_spmd.config import ConfigManager, JobConfig

FIXTURES = Path(__file__).parent / "fixtures" / "migrate_fields"
INPUTS = ["fork_config.py", "job.toml", "job_with_dataloader.toml", "run.sh"]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A migrated copy of the fixture inputs (the originals stay in ``FIXTURES``)."""
    root = tmp_path / "fork"
    root.mkdir()
    for name in INPUTS:
        shutil.copy(FIXTURES / name, root / name)
    assert main([str(root)]) == 0
    return root


def _deprecations(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in rec if issubclass(w.category, DeprecationWarning)]


def _module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"fork_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_file_becomes_its_expected_text_and_a_second_run_changes_nothing(
        tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in INPUTS:
        assert (tree / name).read_text() == (FIXTURES / f"{name}.expected").read_text(), name
    capsys.readouterr()
    assert main(["--check", str(tree)]) == 0  # idempotent
    assert "0 file(s) would be rewritten" in capsys.readouterr().out


def test_keywords_of_the_old_sections_are_reported_not_guessed(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copy(FIXTURES / "fork_config.py", tmp_path / "fork_config.py")
    assert main(["--check", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    for name in ("dataset", "dataset_path"):
        assert (f"fork_config.py:21: review: TrainingConfig({name}=...): upstream moved this field to "
                f"dataloader.{name}") in err, err


def _toml(path: Path) -> dict[str, Any]:
    data = ConfigManager().parse_args(["--job.config_file", str(path)]).to_dict()
    data["job"].pop("config_file")
    return data  # type: ignore[no-any-return]


def test_a_migrated_toml_loads_to_the_same_config_without_a_warning(tree: Path) -> None:
    before, old_warnings = _deprecations(lambda: _toml(FIXTURES / "job.toml"))
    after, new_warnings = _deprecations(lambda: _toml(tree / "job.toml"))
    assert len(old_warnings) == 3 and new_warnings == [], (old_warnings, new_warnings)
    assert after == before
    assert (after["dataloader"]["dataset_path"], after["hf_assets_path"]) == ("data/train.jsonl",
                                                                             "tests/assets/tokenizer")


def test_a_toml_split_over_both_spellings_loads_once_migrated(tree: Path) -> None:
    """``[dataloader] dataset`` with ``[training] dataset_path``: the section is checked before the
    runtime moves the old field, so only the migrated file loads (the key joins ``[dataloader]``)."""
    with pytest.raises(ValueError, match="dataloader.dataset='json' needs dataloader.dataset_path"):
        _toml(FIXTURES / "job_with_dataloader.toml")
    after, new_warnings = _deprecations(lambda: _toml(tree / "job_with_dataloader.toml"))
    assert new_warnings == []
    assert (after["dataloader"]["dataset"], after["dataloader"]["dataset_path"]) == ("json", "data/train.jsonl")


def _flags(path: Path) -> list[str]:
    words = shlex.split(path.read_text().replace("\\\n", " "), comments=True)
    flags = words[words.index("torchtitan_spmd.train") + 1:]
    for option in ("--module", "--config"):  # the registry is a layer above this one
        i = flags.index(option)
        del flags[i:i + 2]
    return flags


def test_migrated_flags_parse_to_the_same_config_without_a_warning(tree: Path) -> None:
    parse = ConfigManager().parse_overrides
    before, old_warnings = _deprecations(lambda: parse(JobConfig(), _flags(FIXTURES / "run.sh")))
    after, new_warnings = _deprecations(lambda: parse(JobConfig(), _flags(tree / "run.sh")))
    assert len(old_warnings) == 3 and new_warnings == [], (old_warnings, new_warnings)
    assert after == before
    assert (after.dataloader.dataset_path, after.hf_assets_path) == ("data/train.jsonl", "tests/assets/tokenizer")


def test_migrated_python_sets_and_reads_the_new_fields_without_a_warning(tree: Path) -> None:
    fork = _module(tree / "fork_config.py")

    def run() -> tuple[Any, Any, Any]:
        cfg = fork.use_local_data(JobConfig.from_dict({"hf_assets_path": "tok"}), "d.jsonl")
        cfg.validate()  # as the trainer does
        parsed = ConfigManager().parse_overrides(JobConfig(), fork.argv("tok"))
        return cfg, fork.describe(cfg), parsed

    (cfg, described, parsed), new_warnings = _deprecations(run)
    assert new_warnings == []
    assert (cfg.dataloader.dataset, cfg.dataloader.dataset_path) == ("json", "d.jsonl")
    assert described == ("json", "d.jsonl", "tok")
    assert (parsed.dataloader.dataset, parsed.hf_assets_path) == ("c4_test", "tok")
