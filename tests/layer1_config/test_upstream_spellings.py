"""Layer 1: upstream's (a0c831c49) root ``hf_assets_path`` and ``[tokenizer]`` section, and the
legacy ``model.hf_assets_path`` / ``training.dataset*`` spellings, in every channel (dict, TOML,
command line): the new spelling is accepted silently, the old one warns once
(``LegacySpellingWarning``, a ``DeprecationWarning``) and lands where the new one does.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from torchtitan_spmd.compat import REMOVAL_RELEASE, LegacySpellingWarning
from torchtitan_spmd.config import ConfigManager, JobConfig, TokenizerConfig

ASSETS = "tests/assets/tokenizer"


def _deprecations(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``fn()`` and its deprecation warnings' texts; each a ``LegacySpellingWarning`` blamed on a
    line of this file (the user's), not on the library's or tyro's."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        result = fn()
    for w in rec:
        if issubclass(w.category, DeprecationWarning):
            assert issubclass(w.category, LegacySpellingWarning), w
            assert w.filename == __file__, (w.filename, str(w.message))
    return result, [str(w.message) for w in rec if issubclass(w.category, DeprecationWarning)]


def _toml(tmp_path: Path, text: str) -> JobConfig:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return ConfigManager().parse_args(["--job.config_file", str(path)])  # type: ignore[no-any-return]


# ------------------------------------------------------------------ the new spellings, silently
def test_defaults_and_the_tokenizer_section_has_upstreams_no_fields() -> None:
    cfg = JobConfig()
    # upstream's default is "./tests/assets/tokenizer", a path inside its own repository; this
    # library's None is its byte tokenizer (a documented difference)
    assert cfg.hf_assets_path is None and cfg.model.hf_assets_path is None
    assert dataclasses.fields(TokenizerConfig) == ()  # HuggingFaceTokenizer.Config has none
    assert isinstance(cfg.tokenizer, TokenizerConfig)
    assert JobConfig.root_fields() == ("hf_assets_path",)


@pytest.mark.parametrize("channel", ["dict", "toml", "cli"])
def test_root_hf_assets_path_and_tokenizer_section_are_accepted_silently(tmp_path: Path, channel: str) -> None:
    make = {
        "dict": lambda: JobConfig.from_dict({"hf_assets_path": ASSETS, "tokenizer": {}}),
        "toml": lambda: _toml(tmp_path, f'hf_assets_path = "{ASSETS}"\n[tokenizer]\n[model]\nname = "llama3"\n'),
        "cli": lambda: ConfigManager().parse_overrides(JobConfig(), ["--hf_assets_path", ASSETS]),
    }[channel]
    cfg, warned = _deprecations(make)
    assert warned == []
    assert (cfg.hf_assets_path, cfg.model.hf_assets_path) == (ASSETS, None)


def test_the_root_field_round_trips_through_to_dict() -> None:
    cfg = JobConfig.from_dict({"hf_assets_path": ASSETS})
    data = cfg.to_dict()
    assert data["hf_assets_path"] == ASSETS and data["model"]["hf_assets_path"] is None
    assert JobConfig.from_dict(data) == cfg


# ------------------------------------------------------------------ the old spellings warn once
@pytest.mark.parametrize("channel", ["dict", "toml", "cli"])
def test_model_hf_assets_path_warns_once_and_moves_to_the_root(tmp_path: Path, channel: str) -> None:
    make = {
        "dict": lambda: JobConfig.from_dict({"model": {"hf_assets_path": ASSETS}}),
        "toml": lambda: _toml(tmp_path, f'[model]\nhf_assets_path = "{ASSETS}"\n'),
        "cli": lambda: ConfigManager().parse_overrides(JobConfig(), ["--model.hf_assets_path", ASSETS]),
    }[channel]
    cfg, warned = _deprecations(make)
    assert warned == [f"model.hf_assets_path is deprecated and will be removed in torchtitan_spmd "
                      f"{REMOVAL_RELEASE}; use hf_assets_path instead."], warned
    assert (cfg.hf_assets_path, cfg.model.hf_assets_path) == (ASSETS, None)
    _, again = _deprecations(cfg.validate)  # the trainer validates again: no second warning
    assert again == []


@pytest.mark.parametrize("channel", ["dict", "cli"])
def test_training_dataset_fields_warn_once_each_and_move_to_dataloader(tmp_path: Path, channel: str) -> None:
    path = str(tmp_path / "d.jsonl")
    make = {
        "dict": lambda: JobConfig.from_dict({"training": {"dataset": "json", "dataset_path": path}}),
        "cli": lambda: ConfigManager().parse_overrides(
            JobConfig(), ["--training.dataset", "json", "--training.dataset_path", path]),
    }[channel]
    cfg, warned = _deprecations(make)
    assert sorted(warned) == sorted(
        f"training.{f} is deprecated and will be removed in torchtitan_spmd {REMOVAL_RELEASE}; "
        f"use dataloader.{f} instead." for f in ("dataset", "dataset_path"))
    assert (cfg.dataloader.dataset, cfg.dataloader.dataset_path) == ("json", path)
    assert (cfg.training.dataset, cfg.training.dataset_path) == (None, None)


# ------------------------------------------------------------------ bad values: one line naming the field
@pytest.mark.parametrize(("data", "error", "needle"), [
    ({"hf_assets_path": 3}, TypeError, "hf_assets_path: expected str, got int 3."),
    ({"hf_assets_path": "a", "model": {"hf_assets_path": "b"}}, ValueError,
     "conflicting settings model.hf_assets_path='b' and hf_assets_path='a': drop the deprecated "
     "model.hf_assets_path."),
    ({"tokenizer": {"tokenizer_path": "x"}}, ValueError,
     "[tokenizer]: unknown key 'tokenizer_path'; the section has no fields"),
    ({"hf_asset_path": "a"}, ValueError, "Did you mean 'hf_assets_path'?"),
])
def test_a_bad_value_is_one_line_naming_the_field(data: dict[str, Any], error: type, needle: str) -> None:
    with pytest.raises(error) as err:
        JobConfig.from_dict(data)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_both_flags_given_reach_the_config_and_conflict_there(capsys: pytest.CaptureFixture[str]) -> None:
    """``--training.dataset`` with ``--dataloader.dataset``: the config names the conflict (tyro's
    exit status 2, its message on stderr)."""
    with pytest.raises(SystemExit) as exit_:
        ConfigManager().parse_overrides(JobConfig(), ["--training.dataset", "c4_test", "--dataloader.dataset",
                                                      "json", "--dataloader.dataset_path", "d.jsonl"])
    assert exit_.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "conflicting settings training.dataset='c4_test' and dataloader.dataset='json'" in err, err


def test_the_same_value_in_both_spellings_is_not_a_conflict() -> None:
    cfg, warned = _deprecations(lambda: JobConfig.from_dict({"hf_assets_path": ASSETS,
                                                             "model": {"hf_assets_path": ASSETS}}))
    assert cfg.hf_assets_path == ASSETS and len(warned) == 1
