"""Malformed layers.toml and usage errors: friendly messages, exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from stack_synth import BASE_LAYERS, MAIN, Repo

from stack.config import ConfigError, load_config


def _layers(**changes: dict) -> list[dict]:
    layers = [dict(x) for x in BASE_LAYERS]
    for index, change in changes.items():
        i = int(index[1:]) - 1
        for key, value in change.items():
            if value is None:
                layers[i].pop(key)
            else:
                layers[i][key] = value
    return layers


def test_missing_and_unknown_keys(synthetic_repo: Repo) -> None:
    synthetic_repo.layers(_layers(l2={"tests": None, "summary": None, "titel": "x"}))
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 2
    text = (synthetic_repo.root / "stack/layers.toml").read_text().splitlines()
    header = [i + 1 for i, ln in enumerate(text) if ln == "[[layer]]"][1]
    assert "stack: malformed layer list" in r.err
    assert (f"stack/layers.toml:{header}: layer 2 (mid): missing required key(s): "
            f"summary, tests") in r.err
    assert f"stack/layers.toml:{header}: layer 2 (mid): unknown key 'titel' (did you mean " \
           f"'title'?)" in r.err


def test_duplicate_slugs_and_bad_types(synthetic_repo: Repo) -> None:
    synthetic_repo.layers(_layers(l3={"slug": "mid", "paths": "pkg/top.py"},
                                  l1={"slug": "Bad Slug"}))
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 2
    assert "layer 3 (mid): duplicate slug 'mid' (already used by layer 2)" in r.err
    assert "layer 3 (mid): paths must be a list of strings, got 'pkg/top.py'" in r.err
    assert "layer 1 (Bad Slug): slug 'Bad Slug' must match" in r.err


def test_invalid_toml_and_missing_file(synthetic_repo: Repo, tmp_path: Path) -> None:
    synthetic_repo.write("stack/layers.toml", "[[layer]]\nslug = \n")
    r = synthetic_repo.run("check", "--no-tests")
    assert r.code == 2
    assert "stack/layers.toml: not valid TOML:" in r.err and "line 2" in r.err
    r = synthetic_repo.run("check", "--config", str(tmp_path / "nope.toml"))
    assert r.code == 2
    assert "cannot read the layer list" in r.err


def test_unknown_top_level_and_stack_table(tmp_path: Path) -> None:
    path = tmp_path / "layers.toml"
    path.write_text('[stack]\npackages = ["pkg"]\nrequire = []\n\n[layers]\nx = 1\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert "unknown key 'layers' (did you mean 'layer'?)" in text
    assert ":1: [stack]: unknown key 'require' (did you mean 'require_owned'?)" in text
    assert "no [[layer]] tables" in text


def test_paths_must_be_relative(tmp_path: Path) -> None:
    path = tmp_path / "layers.toml"
    path.write_text('[[layer]]\nslug = "a"\ntitle = "A"\nsummary = ""\ntest_plan = ""\n'
                    'paths = ["/abs", "../up", "ok/", "ok/"]\ntests = []\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert "'/abs' must be a plain path relative to the repository root" in text
    assert "'../up' must be a plain path" in text
    assert "lists 'ok/' twice" in text


def test_usage_errors(synthetic_repo: Repo, tmp_path: Path) -> None:
    r = synthetic_repo.run("check", "--layers", "7")
    assert r.code == 2 and "--layers 7: the stack has layers 1..3" in r.err
    (tmp_path / "plain").mkdir()
    r = synthetic_repo.run("check", "--root", str(tmp_path / "plain"))
    assert r.code == 2 and "not inside a git repository" in r.err
    r = synthetic_repo.run("verify-export", str(tmp_path / "missing"))
    assert r.code == 2 and "no such directory" in r.err


def test_cli_entry_point_exit_codes() -> None:
    env = {**os.environ, "PYTHONPATH": str(MAIN)}
    proc = subprocess.run([sys.executable, "-m", "stack", "frobnicate"], cwd=MAIN, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid choice: 'frobnicate'" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "stack", "--help"], cwd=MAIN, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0
    assert "verify-export" in proc.stdout
